"""The torch backend's logits path: ``logits_logprobs`` (whole rows per block through ATen's fused softmax
kernels), its autograd Function and the row plans that pick the rows each block computes."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.backends.contract import DEFAULT_MEMORY_BUDGET
from gspo_kernels.backends.tiling import next_token_base, row_blocks
from gspo_kernels.backends.torch.rows import (
    _accelerated,
    _carries_gradient,
    _half_softmax,
    _label_columns,
    _log_p_floor,
    _RowGradient,
    _rows_backward,
    _rows_forward_accelerated,
    _scale_probabilities,
    _to_host,
    _Workspace,
)
from gspo_kernels.checks import host_reads_allowed
from gspo_kernels.options import DEFAULT_OPTIONS, CallOptions
from gspo_kernels.precision import compute_dtype

LOGITS_BLOCK_ELEMENTS = 1 << 23  # logits path: whole rows per block, about this many elements (32 MiB fp32)
ACCELERATOR_BUDGET: Optional[int] = None  # bytes of logits-path scratch on accelerators (None: the default budget)


def _scaled(tile: Tensor, tau: float, cdt: torch.dtype, ws: _Workspace) -> Tensor:
    """``tile / tau`` in ``cdt``: the tile itself when nothing changes, else written into a scratch tile."""
    if tile.dtype == cdt and tau == 1.0:
        return tile
    out = ws.input_tile(*tile.shape)
    if tile.dtype == cdt:
        return torch.div(tile, tau, out=out)
    out.copy_(tile)
    return out if tau == 1.0 else out.div_(tau)


def _logits_block_rows(V: int, device: torch.device, tiles: int, itemsize: int) -> int:
    """Rows per block of the logits path. CPU: about ``LOGITS_BLOCK_ELEMENTS`` elements (cache-sized blocks
    are fastest there). Accelerator: ``tiles`` scratch blocks of ``[rows, V]`` in the compute dtype fill
    ``ACCELERATOR_BUDGET`` bytes (None: :data:`DEFAULT_MEMORY_BUDGET`): at V = 151936 fp32 with 3 tiles,
    589 rows, so 16384 rows take ~28-32 launches of each op instead of ~300."""
    if not _accelerated(device):
        return max(1, LOGITS_BLOCK_ELEMENTS // max(V, 1))
    budget = DEFAULT_MEMORY_BUDGET if ACCELERATOR_BUDGET is None else ACCELERATOR_BUDGET
    return max(1, budget // (tiles * max(V, 1) * itemsize))


_SKIP = "skip"  # a chunk none of whose rows is selected


def _row_plan(blocks, mask: Optional[Tensor], device: torch.device) -> list:
    """``[(r0, r1, sel)]`` for the row blocks ``[(r0, r1, ...)]`` and the rows to compute ``mask [N]`` (None: all).

    ``sel``: None (every row of the block), ``_SKIP`` (none), a ``[k]`` int64 tensor on ``device`` of the
    block's selected rows (relative to ``r0``), or, where no host read is allowed (``torch.compile``, CUDA-graph
    capture), the block's ``[r1 - r0]`` bool mask itself: every row is computed and the others' results are
    replaced by 0. One host read of ``mask`` per plan (none for CPU tensors, none without a mask); the indices
    of partially selected blocks go back to the device in one copy that does not wait for it.
    """
    if mask is None:
        return [(r0, r1, None) for r0, r1, *_ in blocks]
    if not host_reads_allowed():
        return [(r0, r1, mask[r0:r1]) for r0, r1, *_ in blocks]
    host = _to_host(mask)
    csum = torch.cat((host.new_zeros(1, dtype=torch.int64), host.cumsum(0)))
    bounds = torch.tensor([(r0, r1) for r0, r1, *_ in blocks], dtype=torch.int64, device="cpu").reshape(-1, 2)
    counts = (csum[bounds[:, 1]] - csum[bounds[:, 0]]).tolist()
    plan, parts = [], []
    for (r0, r1, *_), k in zip(blocks, counts):
        if k == 0:
            plan.append((r0, r1, _SKIP))
        elif k == r1 - r0:
            plan.append((r0, r1, None))
        else:
            parts.append(torch.nonzero(host[r0:r1])[:, 0])
            plan.append((r0, r1, len(parts) - 1))
    if parts:
        flat = torch.cat(parts)
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        else:
            flat = flat.to(device)
        pieces = torch.split(flat, [p.numel() for p in parts])
        plan = [(r0, r1, pieces[sel] if isinstance(sel, int) else sel) for r0, r1, sel in plan]
    return plan


def _is_index(sel) -> bool:
    return isinstance(sel, Tensor) and sel.dtype != torch.bool


def _pick(t: Tensor, r0: int, r1: int, sel) -> Tensor:
    """Rows ``[r0, r1)`` of ``t [N]`` (or ``[N, V]`` views), restricted to ``sel`` when it is an index."""
    part = t[r0:r1]
    return part.index_select(0, sel) if _is_index(sel) else part


def _store(dst: Tensor, r0: int, r1: int, sel, values: Tensor) -> None:
    """``dst[r0:r1] = values`` for the plan entry ``sel`` (no host read; unselected rows keep / get 0)."""
    if sel is None:
        dst[r0:r1] = values
    elif _is_index(sel):
        dst[r0:r1].index_copy_(0, sel, values)
    else:
        dst[r0:r1] = torch.where(sel, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _scaled_rows(rows: Tensor, tau: float, cdt: torch.dtype, ws: _Workspace, cap: Optional[float] = None) -> Tensor:
    """``rows / tau`` for the fused ops: the rows themselves when they are already ``cdt`` at tau = 1
    (fp16/bf16 rows at tau = 1 too: the softmax ops convert them to fp32 exactly themselves).
    With the soft cap ``c``: ``c tanh(rows / c) / tau`` in a scratch tile."""
    if cap is not None:
        out = ws.input_tile(*rows.shape)
        out.copy_(rows)  # converted first: the cap is computed in cdt, never in the rows' half dtype
        return out.div_(cap).tanh_().mul_(cap / tau)
    if tau == 1.0:
        return rows
    return _scaled(rows, tau, cdt, ws)


def _cap_slope(z: Tensor, cap: float, out: Tensor) -> Tensor:
    """``d(c tanh(z / c))/dz = sech^2(z / c) = cosh(z / c)^-2`` into ``out`` (0 where cosh overflows, and at
    ``z = +-inf``; NaN stays NaN)."""
    out.copy_(z)
    return torch.cosh(out.div_(cap), out=out).pow_(-2)


def _rows_forward(x: Tensor, col: Tensor, inside: Tensor, cdt: torch.dtype, ws: _Workspace,
                  return_entropy: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """``(log p_y [r], entropy [r] | None)`` of the scaled logits rows ``x [r, V]``, their labels' columns
    ``col [r]`` and ``inside [r]`` (:func:`_label_columns`; NaN where False).

    One fused ``log_softmax`` pass; no host read, no index sort. The entropy ``-sum p log p``: on an accelerator
    ``exp``, ``entr`` (``-p log p``, 0 at ``p = 0``: a ``-inf`` logit adds 0, never ``0 * -inf``) and a row sum
    (26 bytes per logit in all for fp32 scratch, against 38 for the CPU's form); on CPU, where ``entr`` is not
    vectorized, ``log p`` clamped to a floor where ``exp`` is exactly 0, ``exp``, a product and a row sum.
    """
    if _accelerated(x.device):
        return _rows_forward_accelerated(x, col, inside, cdt, ws, return_entropy)
    lp, p = ws.tiles(*x.shape)
    torch.log_softmax(x, 1, dtype=cdt, out=lp)
    picked = lp.gather(1, col[:, None])[:, 0]
    logp = torch.where(inside, picked, float("nan"))  # a label outside [0, V) is never read
    if not return_entropy:
        return logp, None
    lp.clamp_(min=_log_p_floor(cdt))  # exp is exactly 0 there: -inf logits add 0, not 0 * -inf
    torch.exp(lp, out=p)
    return logp, -p.mul_(lp).sum(dim=1)


def _direct_half_backward(rows: Tensor, device: torch.device, tau: float, cap: Optional[float], grad_entropy, inplace: bool,
                          cdt: torch.dtype) -> bool:
    """Whether the accelerator route writes the gradient of fp16/bf16 rows straight from a softmax in their own dtype
    (:func:`_rows_backward_direct`): the rows are read as they are (tau = 1, no cap), no entropy gradient, the gradient
    not written over the rows themselves, and no softmax kernel that reads half rows into fp32 (:func:`_half_softmax`;
    with one, the fp32 route costs 16 bytes per logit and rounds once)."""
    return (_accelerated(device) and rows.dtype in (torch.float16, torch.bfloat16) and cdt == torch.float32
            and tau == 1.0 and cap is None and grad_entropy is None and not inplace
            and not _half_softmax(device, rows.dtype))


def logits_gradient_roundings(device: torch.device, dtype: torch.dtype) -> int:
    """The most times an entry of the logits path's gradient is rounded to ``dtype`` on ``device``: 2 where fp16 /
    bf16 rows may take :func:`_rows_backward_direct` (``p`` rounded, then the product; the label's entry once), else
    1 (the library's rule for the logits path). What ``gspo_kernels.testing.gradient_tolerance`` asks."""
    half = dtype in (torch.float16, torch.bfloat16)
    return 2 if half and _accelerated(device) and not _half_softmax(device, dtype) else 1


def _rows_backward_direct(x: Tensor, col: Tensor, inside: Tensor, coef: Tensor, label_grad: Tensor,
                          out: Tensor) -> None:
    """``out = coef (softmax(x) - onehot)`` for fp16/bf16 rows ``x`` into ``out`` (their dtype, not their storage) in
    12 bytes per logit for bf16 (a softmax in the rows' dtype, fp32 inside, written into ``out``; one in-place
    multiply), where converting the rows into fp32 scratch first costs 28. ``p`` is rounded to the rows' dtype before
    the multiply: each entry rounded twice (at most 1 ulp of the dtype, against 1/2 ulp when rounded once). The
    label's entry is ``coef (p_y - 1) = coef expm1(log p_y)`` from the forward's fp32 log-prob (``label_grad``, in
    ``out``'s dtype), rounded once (``p_y - 1`` is never formed from a rounded ``p_y``); a row whose label is outside ``[0, V)``
    keeps its clamped column's ``coef p``."""
    torch.softmax(x, 1, out=out)
    _scale_probabilities(out, coef, col, inside, label_grad)


class _LogitsLogprobs(torch.autograd.Function):
    """Whole rows at a time, through ATen's fused ``log_softmax`` / ``softmax`` kernels (one pass each,
    ``(x - max) - log sum`` kept apart inside), into scratch blocks of whole rows (CPU: about
    ``LOGITS_BLOCK_ELEMENTS`` elements each; accelerators: a byte budget): the fewest passes over the logits
    plain PyTorch allows, and no ``[N, V]`` intermediate.

    Rows: the forward computes the ``active`` rows, the backward the active rows whose incoming gradient is
    non-zero; the others get exactly 0 and are never read. Each selection is one host read of an ``[N]`` mask
    on an accelerator (none on CPU tensors, none in the forward without ``active``), never one per block.
    Where no host read is allowed (``torch.compile``, CUDA-graph capture) every row of the forward's selection
    is computed and the results of the others are replaced by 0 (``torch.where`` / ``masked_fill``).
    """

    @staticmethod
    def forward(ctx, logits, labels, active, options: CallOptions, extra_position=False):
        # the call's options (temperature, return_entropy, softcap read; inplace_backward by the backward)
        temperature, return_entropy, softcap = float(options.temperature), options.return_entropy, options.softcap
        ctx.extra = extra_position  # ``logits`` is the [B, T + 1, V] base of the rows read (its [:, :-1])
        source = logits
        if extra_position:
            logits = logits[:, :-1]
        V = logits.shape[-1]
        n = labels.shape[0]
        cdt = compute_dtype(logits.dtype)
        device = logits.device
        logp = torch.zeros(n, dtype=cdt, device=device)
        entropy = torch.zeros(n, dtype=cdt, device=device)
        scaled = softcap is not None or temperature != 1.0
        tiles = 2 + scaled + (softcap is not None) + (active is not None)
        R = _logits_block_rows(V, device, tiles, torch.empty((), dtype=cdt).element_size())
        blocks = row_blocks(logits, R, balanced=_accelerated(device))
        plan = _row_plan(blocks, active, device)
        col, inside = _label_columns(labels, V)
        ws = _Workspace(R, V, cdt, device)
        for (r0, r1, rows), (_, _, sel) in zip(blocks, plan):
            if sel is _SKIP:
                continue
            x = _scaled_rows(_pick(rows, 0, r1 - r0, sel), temperature, cdt, ws, softcap)
            lp_rows, ent_rows = _rows_forward(x, _pick(col, r0, r1, sel), _pick(inside, r0, r1, sel), cdt, ws,
                                              return_entropy)
            _store(logp, r0, r1, sel, lp_rows)
            if return_entropy:
                _store(entropy, r0, r1, sel, ent_rows)
        if _accelerated(device):  # the rows' forward leaves this to one op per call
            logp = torch.where(inside, logp, float("nan"))
        ctx.save_for_backward(source, labels, entropy)
        # p_y - 1 of each row for the half rows' backward (an intermediate, not the output: that may be changed in place)
        ctx.em1 = torch.expm1(logp) if _accelerated(device) else None
        ctx.active = active
        ctx.plan, ctx.rows = plan, R
        ctx.options = options  # the call's options, whole (the backward reads temperature, softcap, inplace_backward)
        ctx.set_materialize_grads(False)  # an unused entropy gets grad None, not a zero-filled tensor
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, entropy = ctx.saved_tensors
        tau, cap = float(ctx.options.temperature), ctx.options.softcap
        V = logits.shape[-1]
        n = labels.shape[0]
        cdt = entropy.dtype
        device = logits.device
        source = logits.detach()
        full = source if ctx.options.inplace_backward else torch.empty_like(logits, memory_format=torch.contiguous_format)
        grad = full
        if ctx.extra:  # the base's gradient: 0 at the last position, the rows' gradient written into the others
            full[:, -1].zero_()
            source, grad = source[:, :-1], full[:, :-1]
            V = source.shape[-1]
        g_all = grad_logp if grad_logp is not None else torch.zeros_like(entropy)
        plan = ctx.plan
        if host_reads_allowed():  # skip every row without gradient: one host read of the mask (none on CPU)
            carries = _carries_gradient(grad_logp, grad_entropy, n, device)
            if ctx.active is not None:
                carries &= ctx.active
            plan = _row_plan([(r0, r1) for r0, r1, _ in plan], carries, device)
        col, inside = _label_columns(labels, V)
        ws = _Workspace(ctx.rows, V, cdt, device)
        pre = direct = None
        if _direct_half_backward(source, device, tau, cap, grad_entropy, ctx.options.inplace_backward, cdt):  # per call, not per block
            coef = -g_all / tau
            direct = (coef, (ctx.em1 * coef).to(grad.dtype))  # the label's entry, rounded once
        elif _accelerated(device) and grad_entropy is None:
            pre = (torch.where(inside, -1.0, 0.0).to(cdt), -g_all / tau)
        for r0, r1, sel in plan:
            target = _row_view(grad, r0, r1)
            if sel is _SKIP:
                target.zero_()
                continue
            index = _is_index(sel)
            # (an index reads a copy of the rows, before the in-place target is zeroed)
            sub = _pick(_row_view(source, r0, r1), 0, r1 - r0, sel)
            slope = None if cap is None else _cap_slope(sub, cap, ws.slope_tile(*sub.shape))
            x = _scaled_rows(sub, tau, cdt, ws, cap)
            out = torch.empty(x.shape, dtype=grad.dtype, device=device) if index else target
            ge = None if grad_entropy is None else _pick(grad_entropy, r0, r1, sel)
            if direct is not None:
                _rows_backward_direct(x, _pick(col, r0, r1, sel), _pick(inside, r0, r1, sel),
                                      _pick(direct[0], r0, r1, sel), _pick(direct[1], r0, r1, sel), out)
            else:
                rows = _RowGradient(col=_pick(col, r0, r1, sel), inside=_pick(inside, r0, r1, sel),
                                    g=_pick(g_all, r0, r1, sel), ge=ge, ent=_pick(entropy, r0, r1, sel),
                                    pre=None if pre is None else (_pick(pre[0], r0, r1, sel), _pick(pre[1], r0, r1, sel)))
                _rows_backward(x, rows, tau, cdt, ws, slope, out)
            if index:
                target.zero_()
                target.index_copy_(0, sel, out)
            elif sel is not None:  # a device mask (no host read allowed): the other rows are exactly 0
                target.masked_fill_(~sel[:, None], 0)
        return full, None, None, None, None


def _row_view(x: Tensor, r0: int, r1: int) -> Tensor:
    """Rows ``[r0, r1)`` of ``x`` (``[N, V]`` or ``[B, T, V]``) as a view; blocks never cross a batch row."""
    if x.dim() == 2:
        return x[r0:r1]
    try:
        return x.view(-1, x.shape[-1])[r0:r1]
    except RuntimeError:
        T = x.shape[1]
        return x[r0 // T, r0 % T : r0 % T + (r1 - r0)]


def logits_logprobs(logits: Tensor, labels: Tensor, active: Optional[Tensor] = None,
                    options: CallOptions = DEFAULT_OPTIONS) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-token ``(logp [N], entropy [N] | None)`` from ``logits [N, V]`` / ``[B, T, V]``.

    fp16/bf16/fp32 logits: fp32 math and outputs; fp64 logits: fp64 math and outputs. Extra memory:
    ``O(N)`` plus two (three with a temperature or a soft cap, four in the capped backward, one more for the
    rows of partly selected blocks) scratch blocks of whole rows: on CPU about ``LOGITS_BLOCK_ELEMENTS``
    elements each; on an accelerator all of them together about ``DEFAULT_MEMORY_BUDGET`` bytes (1 GiB).
    The backward writes one gradient the size of the logits (or into the logits with ``inplace_backward``).
    Host reads: one ``[N]`` bool mask per forward with ``active`` and one per backward (none on CPU tensors,
    none under ``torch.compile`` / CUDA-graph capture, where every row of a block is computed and the others'
    results replaced by 0). ``softcap``: see the backend contract.
    """
    base = None
    if _accelerated(logits.device) and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        base = next_token_base(logits)  # [B, T + 1, V] read as [:, :-1]: its gradient written here, no slice_backward
    logp, entropy = _LogitsLogprobs.apply(logits if base is None else base, labels, active, options, base is not None)
    return logp, (entropy if options.return_entropy else None)
