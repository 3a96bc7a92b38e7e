"""``backend="torch"``: the portable chunked heavy stage (any device), and the blueprint of the others.

fp32 math (fp64 for fp64 inputs); no ``[N, V]`` fp32 intermediate exists.
Logits path: blocks of whole rows through ATen's fused ``log_softmax`` / ``softmax`` kernels into two
scratch blocks: forward 1 fused pass + 3 for the entropy; backward 2 passes (5 when the entropy carries
gradient), writing the gradient directly. Block size: on CPU about ``LOGITS_BLOCK_ELEMENTS`` elements; on an
accelerator (CUDA) the scratch blocks fill ``DEFAULT_MEMORY_BUDGET`` (bf16 [16384, 151936] logits: 32 blocks,
~15 kernels each, where 55-row blocks made 304). Rows to compute (the forward's ``active``, the backward's rows
with gradient) are read to the host once per call, never per block; no op sorts (``scatter_add``, not
``index_put(accumulate=True)``); ``tests/test_torch_backend_launches.py`` counts both.
On an accelerator (CUDA) the logits path's forward is max(dim=1) + one softmax + entr + sum (log p_y from the max's
column, :func:`_rows_forward_accelerated`) and a ``[B, T + 1, V]`` base read as ``[:, :-1]`` takes its gradient
directly; fp16/bf16 rows that no softmax kernel reads into fp32 (bf16 on CUDA) get their gradient from a softmax in
their own dtype written into it (:func:`_rows_backward_direct`). The hidden-state path there: row chunks sized from
``memory_budget``, one GEMM per chunk with fp32 output, no vocabulary tiles, dZ cast once, dW in one fp32
accumulator, one host read per call (:func:`_linear_forward_accelerated`, :func:`_linear_backward_accelerated`);
when ``p`` of all rows takes no more bytes than that accumulator, the forward keeps it and the backward makes no
logits GEMM (:func:`_keeps_probabilities`, :func:`_linear_backward_kept`).
``benchmarks/count_torch_backend.py`` counts the accelerator route's ops, bytes and GEMM FLOPs on CPU tensors.
Hidden-state path on CPU: rows x vocabulary tiles, an online softmax (running max ``m``,
``s = sum e^(x-m)``, ``a = sum e^(x-m)(x-m)``) with the label's logit and the entropy folded in;
one ``[rows, vocab_block]`` logits tile exists at a time.
Both keep the row max and ``log s`` apart (never one fp32 ``lse = m + log s``): log-probs and the
entropy come from shifted logits, so logits offset by 1e4 or divided by a temperature of 1e-6 keep
fp32 accuracy. Backward: recomputes from the logits (or tiles from the saved ``(m, log s)``),
accumulates in fp32, and visits only the rows whose incoming gradient (of log-prob or entropy) is
non-zero; the others get exactly zero gradient. ``-inf`` logits on non-label columns give ``p = 0`` and a zero gradient (never NaN).
Labels outside ``[0, V)`` are never read (possible only when the public checks are skipped, under
``torch.compile``): that row's log-prob is NaN.
Soft cap ``c`` (``softcap=``): the scaled logits are ``x = c tanh(z / c) / tau`` (a scratch tile), the bias is
not shifted, and each tile's gradient is multiplied by ``sech^2(z / c)`` (from ``cosh``, accurate where
``tanh`` saturates and ``1 - tanh^2`` would cancel); the uncapped path runs exactly the code it ran before.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.backends import DEFAULT_MEMORY_BUDGET, Backend
from gspo_kernels.backends.tiling import as_rows, next_token_base, row_blocks
from gspo_kernels.checks import host_reads_allowed
from gspo_kernels.precision import compute_dtype

LOGITS_BLOCK_ELEMENTS = 1 << 23  # logits path: whole rows per block, about this many elements (32 MiB fp32)
LINEAR_ROW_BLOCK = 1024  # rows per tile of the hidden-state path (the weight is streamed once per block)
LINEAR_VOCAB_BLOCK = 4096
ACCELERATOR_BUDGET: Optional[int] = None  # bytes of logits-path scratch on accelerators (None: the default budget)


def _log_p_floor(dtype: torch.dtype) -> float:
    """A log-probability below which ``exp`` is exactly 0 in ``dtype`` (used to keep ``-inf`` out of products)."""
    return -800.0 if dtype == torch.float64 else -120.0


class _Workspace:
    """Flat scratch buffers of ``rows * cols`` elements, viewed as contiguous ``[r, c]`` tiles: two work
    tiles, and one for a converted / scaled copy of the input tile (allocated when first needed)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> None:
        self.size, self.dtype, self.device = rows * cols, dtype, device
        self.a: Optional[Tensor] = None  # allocated when first needed (a softmax alone uses only b)
        self.b: Optional[Tensor] = None  # (none at all where the gradient is written without scratch)
        self.x: Optional[Tensor] = None
        self.s: Optional[Tensor] = None  # the soft cap's sech^2 tile (allocated when first needed)

    def tiles(self, r: int, c: int) -> Tuple[Tensor, Tensor]:
        if self.a is None:
            self.a = torch.empty(self.size, dtype=self.dtype, device=self.device)
        return self.a[: r * c].view(r, c), self.second(r, c)

    def second(self, r: int, c: int) -> Tensor:
        """The second work tile alone."""
        if self.b is None:
            self.b = torch.empty(self.size, dtype=self.dtype, device=self.device)
        return self.b[: r * c].view(r, c)

    def input_tile(self, r: int, c: int) -> Tensor:
        if self.x is None:
            self.x = torch.empty(self.size, dtype=self.dtype, device=self.device)
        return self.x[: r * c].view(r, c)

    def slope_tile(self, r: int, c: int) -> Tensor:
        if self.s is None:
            self.s = torch.empty(self.size, dtype=self.dtype, device=self.device)
        return self.s[: r * c].view(r, c)


def _scaled(tile: Tensor, tau: float, cdt: torch.dtype, ws: _Workspace) -> Tensor:
    """``tile / tau`` in ``cdt``: the tile itself when nothing changes, else written into a scratch tile."""
    if tile.dtype == cdt and tau == 1.0:
        return tile
    out = ws.input_tile(*tile.shape)
    if tile.dtype == cdt:
        return torch.div(tile, tau, out=out)
    out.copy_(tile)
    return out if tau == 1.0 else out.div_(tau)


class _OnlineSoftmax:
    """Per row: running max ``m`` of the scaled logits ``x``, ``s = sum e^(x-m)``, ``a = sum e^(x-m) (x-m)``
    and the label's ``x``. ``m`` and ``log s`` stay apart (``log p = (x - m) - log s``): no fp32
    ``lse = m + log s`` whose rounding grows with the size of the logits."""

    def __init__(self, rows: int, labels: Tensor, dtype: torch.dtype, device: torch.device) -> None:
        self.m = torch.full((rows,), float("-inf"), dtype=dtype, device=device)
        self.s = torch.zeros(rows, dtype=dtype, device=device)
        self.a = torch.zeros(rows, dtype=dtype, device=device)
        self.label_x = torch.full((rows,), float("nan"), dtype=dtype, device=device)  # NaN: label not in [0, V)
        self.labels = labels

    def fold(self, x: Tensor, v0: int, ws: _Workspace, entropy: bool) -> None:
        """Fold the scaled logits tile ``x [rows, vb]`` covering vocabulary ``[v0, v0 + vb)``."""
        m_new = torch.maximum(self.m, x.amax(dim=1))
        m_ref = torch.where(m_new == float("-inf"), 0.0, m_new)  # a row of -inf so far: e = 0, not NaN
        d, e = ws.tiles(*x.shape)
        torch.sub(x, m_ref[:, None], out=d)
        torch.exp(d, out=e)
        s_tile = e.sum(dim=1)
        seen = self.s > 0
        shift = torch.where(seen, self.m - m_ref, 0.0)  # <= 0
        scale = torch.where(seen, torch.exp(shift), 0.0)
        if entropy:
            a_tile = torch.nansum(e.mul_(d), dim=1)  # e * d is 0 * -inf = NaN only where e = 0 (a -inf logit)
            self.a = scale * (self.a + shift * self.s) + a_tile
        self.s = self.s * scale + s_tile
        self.m = m_ref
        local = self.labels - v0
        inside = (local >= 0) & (local < x.shape[1])
        picked = x.gather(1, local.clamp(0, x.shape[1] - 1)[:, None])[:, 0]
        self.label_x = torch.where(inside, picked, self.label_x)

    def finish(self) -> Tuple[Tensor, Tensor, Tensor]:
        """``(logp, entropy, stats [2, rows])``: ``log p_y = (x_y - m) - log s``, ``H = log s - a / s``."""
        log_s = torch.log(self.s)
        return (self.label_x - self.m) - log_s, log_s - self.a / self.s, torch.stack((self.m, log_s))
def _grad_tile(x: Tensor, m: Tensor, log_s: Tensor, entropy: Tensor, g: Tensor, ge: Optional[Tensor],
               local: Tensor, tau: float, ws: _Workspace, out: Tensor) -> None:
    """Write ``dL/dlogits`` of one tile into ``out``: ``(g/tau)(onehot - p) - (ge/tau) p (log p + H)``.

    ``x``: the scaled logits tile (not modified); ``log p = (x - m) - log s``; ``out`` may be a strided
    view of the gradient (or of the logits themselves: ``x`` is read before ``out`` is written).
    """
    d, p = ws.tiles(*x.shape)
    torch.sub(x, m[:, None], out=d)
    d.sub_(log_s[:, None])  # log p
    if ge is None:
        torch.exp(d, out=p)
        torch.mul(p, (-g / tau)[:, None], out=out)
    else:
        d.clamp_(min=_log_p_floor(d.dtype))  # exp is still exactly 0 there; no 0 * inf below
        torch.exp(d, out=p)
        alpha = -(g + ge * entropy) / tau
        torch.addcmul(alpha[:, None], d, (-ge / tau)[:, None], out=d)
        torch.mul(p, d, out=out)
    inside = (local >= 0) & (local < x.shape[1])  # the label's column is in this tile: add g / tau there
    col = local.clamp(0, x.shape[1] - 1)[:, None]
    out.scatter_add_(1, col, torch.where(inside, g / tau, 0.0).to(out.dtype)[:, None])  # no host read, no sort


def _carries_gradient(grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], n: int, device) -> Tensor:
    """``[N]`` bool: rows whose incoming gradient (of log-prob or entropy) is non-zero."""
    carries = torch.zeros(n, dtype=torch.bool, device=device)
    if grad_logp is not None:
        carries |= grad_logp != 0
    if grad_entropy is not None:
        carries |= grad_entropy != 0
    return carries


def _accelerated(device: torch.device) -> bool:
    """Whether ``device`` takes the accelerator route (CUDA and any other non-CPU device): chunks sized from a
    byte budget, no host read per chunk, none in the backward (the tests force it on CPU tensors)."""
    return device.type != "cpu"


def _logits_block_rows(V: int, device: torch.device, tiles: int, itemsize: int) -> int:
    """Rows per block of the logits path. CPU: about ``LOGITS_BLOCK_ELEMENTS`` elements (cache-sized blocks
    are fastest there). Accelerator: ``tiles`` scratch blocks of ``[rows, V]`` in the compute dtype fill
    ``ACCELERATOR_BUDGET`` bytes (None: :data:`DEFAULT_MEMORY_BUDGET`): at V = 151936 fp32 with 3 tiles,
    589 rows, so 16384 rows take ~28-32 launches of each op instead of ~300."""
    if not _accelerated(device):
        return max(1, LOGITS_BLOCK_ELEMENTS // max(V, 1))
    budget = DEFAULT_MEMORY_BUDGET if ACCELERATOR_BUDGET is None else ACCELERATOR_BUDGET
    return max(1, budget // (tiles * max(V, 1) * itemsize))


_half_softmax_ok: dict = {}  # (device type, dtype) -> whether ATen's softmax reads half rows into fp32 itself


def _half_softmax(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``aten::_softmax(x, dim, half_to_float=True)`` runs for ``dtype`` rows on ``device`` (one pass: reads
    the half rows, writes fp32). CUDA has it for fp16; bf16 only where the installed PyTorch added it; CPU never.
    Probed once per (device type, dtype) on a ``[1, 2]`` tensor."""
    key = (device.type, dtype)
    if key not in _half_softmax_ok:
        ok = False
        if dtype in (torch.float16, torch.bfloat16):
            try:
                out = torch.ops.aten._softmax(torch.zeros(1, 2, dtype=dtype, device=device), 1, True)
                ok = out.dtype == torch.float32 and bool(torch.all(out == 0.5))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _half_softmax_ok[key] = ok
    return _half_softmax_ok[key]


def _softmax_rows(x: Tensor, cdt: torch.dtype, ws: "_Workspace", out: Tensor) -> Tensor:
    """``out = softmax(x)`` (rows) in ``cdt`` on the accelerator route: one pass from half rows where the kernel
    reads them (:func:`_half_softmax`), else the rows converted into the input scratch tile first (the pass that
    ``torch.softmax(x, dtype=cdt)`` makes into a fresh tensor, made into the workspace instead)."""
    if x.dtype == cdt:
        return torch.softmax(x, 1, out=out)
    if _half_softmax(x.device, x.dtype) and cdt == torch.float32:
        return torch.ops.aten._softmax.out(x, 1, True, out=out)
    return torch.softmax(ws.input_tile(*x.shape).copy_(x), 1, out=out)


def _to_host(mask: Tensor) -> Tensor:
    """``mask [N]`` bool on the CPU: the one host read of a forward call on an accelerator (free on CPU)."""
    return mask if mask.device.type == "cpu" else mask.to("cpu")


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


def _label_columns(labels: Tensor, V: int) -> Tuple[Tensor, Tensor]:
    """``(col [N] int64, inside [N] bool)``: each label clamped into ``[0, V)`` and whether it was there (once
    per call, not per block; a label outside is never read)."""
    return labels.clamp(0, V - 1), (labels >= 0) & (labels < V)


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


def _rows_forward_accelerated(x: Tensor, col: Tensor, inside: Tensor, cdt: torch.dtype, ws: _Workspace,
                              return_entropy: bool, keep: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`_rows_forward` on the accelerator route, in fewer bytes per logit: the row max and its column
    (``max(dim=1)``, one read of the rows in their own dtype), ``p = softmax(x)`` (one fused pass, from half rows directly
    where the kernel reads them, else after one conversion into scratch), then ``log p_y = (x_y - m) - log s`` with
    ``log s = -log p[argmax]`` (``p`` at the max is ``1/s``, never below ``1/V``: no underflow; ``m`` and ``log s``
    stay apart) and the entropy ``sum entr(p)`` (``entr``, a row sum). bf16 rows, no direct half read: 2 + 6 + 8 + 8
    + 4 = 28 bytes per logit (20 with it), where log_softmax + exp + entr + sum read and wrote 34."""
    m, arg = x.max(dim=1)  # the max and its column in one reduction
    p = ws.second(*x.shape)
    _softmax_rows(x, cdt, ws, p)
    logp = x.gather(1, col[:, None])[:, 0].to(cdt).sub_(m).add_(torch.log(p.gather(1, arg[:, None])[:, 0]))
    if keep is not None:  # p kept for the backward (the hidden path's kept rows), before entr overwrites it
        keep.copy_(p)
    # (a label outside [0, V) is never read: the caller sets its row's log-prob to NaN, once per call)
    if not return_entropy:
        return logp, None
    return logp, torch.special.entr(p, out=p).sum(dim=1)


def _rows_backward(x: Tensor, col: Tensor, inside: Tensor, g: Tensor, ge: Optional[Tensor], ent: Optional[Tensor],
                   tau: float, cdt: torch.dtype, ws: _Workspace, slope: Optional[Tensor], out: Tensor,
                   pre: Optional[Tuple[Tensor, Tensor]] = None) -> None:
    """Write ``dL/dlogits`` of the rows into ``out [r, V]`` (the logits' dtype, possibly their own storage:
    ``x`` is read before ``out`` is written): ``(g/tau)(onehot - p) - (ge/tau) p (log p + H)``, times the
    soft cap's ``slope`` when given. Formed in the compute dtype and rounded once when stored.

    Without an entropy gradient: ``p = softmax(x)``, ``p_y -= 1`` (a ``scatter_add``: no sort, no host read),
    then one multiply by ``-g/tau`` written straight into ``out``: two passes over the rows. ``pre``: the rows'
    ``(-1 where inside else 0, -g/tau)`` in ``cdt``, formed once per call by the caller (the accelerator route).
    """
    col = col[:, None]
    if ge is None:
        p = ws.second(*x.shape)
        if _accelerated(x.device):
            _softmax_rows(x, cdt, ws, p)
        else:
            torch.softmax(x, 1, dtype=cdt, out=p)
        minus_one, coef = pre if pre is not None else (torch.where(inside, -1.0, 0.0).to(cdt), -g / tau)
        p.scatter_add_(1, col, minus_one[:, None])  # p - onehot
        coef = coef[:, None]
        if slope is None:
            torch.mul(p, coef, out=out)
        else:
            torch.mul(p.mul_(coef), slope, out=out)
        return
    lp, p = ws.tiles(*x.shape)
    torch.log_softmax(x, 1, dtype=cdt, out=lp)
    lp.clamp_(min=_log_p_floor(cdt))  # p = 0 there, and p * (log p + H) stays 0
    torch.exp(lp, out=p)
    alpha = -(g + ge * ent) / tau
    torch.addcmul(alpha[:, None], lp, (-ge / tau)[:, None], out=lp)
    lp.mul_(p)
    lp.scatter_add_(1, col, torch.where(inside, g / tau, 0.0).to(cdt)[:, None])
    if slope is not None:
        lp.mul_(slope)
    out.copy_(lp)


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


def _scale_probabilities(p: Tensor, coef: Tensor, col: Tensor, inside: Tensor, label_grad: Tensor) -> Tensor:
    """``p [r, V]`` (half-precision probabilities) into ``coef (p - onehot)`` in place: one multiply, then each
    row's label entry set to ``label_grad`` (``coef (p_y - 1)`` formed in fp32, rounded once), except a row whose
    label is outside ``[0, V)`` (``inside`` False), which keeps its clamped column's ``coef p``."""
    p.mul_(coef[:, None])
    c = col[:, None]
    return p.scatter_(1, c, torch.where(inside[:, None], label_grad.to(p.dtype)[:, None], p.gather(1, c)))


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
    def forward(ctx, logits, labels, active, temperature, return_entropy, inplace_backward, softcap,
                extra_position=False):
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
        ctx.temperature = temperature
        ctx.softcap = softcap
        ctx.inplace = inplace_backward
        ctx.set_materialize_grads(False)  # an unused entropy gets grad None, not a zero-filled tensor
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, entropy = ctx.saved_tensors
        tau, cap = ctx.temperature, ctx.softcap
        V = logits.shape[-1]
        n = labels.shape[0]
        cdt = entropy.dtype
        device = logits.device
        source = logits.detach()
        full = source if ctx.inplace else torch.empty_like(logits, memory_format=torch.contiguous_format)
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
        if _direct_half_backward(source, device, tau, cap, grad_entropy, ctx.inplace, cdt):  # per call, not per block
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
                _rows_backward(x, _pick(col, r0, r1, sel), _pick(inside, r0, r1, sel), _pick(g_all, r0, r1, sel),
                               ge, _pick(entropy, r0, r1, sel), tau, cdt, ws, slope, out,
                               None if pre is None else (_pick(pre[0], r0, r1, sel), _pick(pre[1], r0, r1, sel)))
            if index:
                target.zero_()
                target.index_copy_(0, sel, out)
            elif sel is not None:  # a device mask (no host read allowed): the other rows are exactly 0
                target.masked_fill_(~sel[:, None], 0)
        return full, None, None, None, None, None, None, None


def _row_view(x: Tensor, r0: int, r1: int) -> Tensor:
    """Rows ``[r0, r1)`` of ``x`` (``[N, V]`` or ``[B, T, V]``) as a view; blocks never cross a batch row."""
    if x.dim() == 2:
        return x[r0:r1]
    try:
        return x.view(-1, x.shape[-1])[r0:r1]
    except RuntimeError:
        T = x.shape[1]
        return x[r0 // T, r0 % T : r0 % T + (r1 - r0)]


_mm_fp32_out_ok: dict = {}  # (device type, dtype) -> whether mm / addmm take out_dtype=float32 with out=


def _mm_fp32_out(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm`` / ``torch.addmm`` multiply ``dtype`` (fp16/bf16) operands into a given fp32 tensor
    (``out_dtype=torch.float32, out=``): CUDA on current PyTorch; not CPU. Probed once per (device type, dtype)."""
    key = (device.type, dtype)
    if key not in _mm_fp32_out_ok:
        try:
            a = torch.ones(1, 1, dtype=dtype, device=device)
            c = torch.empty(1, 1, dtype=torch.float32, device=device)
            torch.mm(a, a, out_dtype=torch.float32, out=c)
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
            ok = True
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _mm_fp32_out_ok[key] = ok
    return _mm_fp32_out_ok[key]


class _Gemms:
    """The accelerator route's three GEMMs with operands in their dtype ``op`` and results in ``cdt``: for
    fp16/bf16 operands one GEMM writing fp32 (``out_dtype``) where torch has it; elsewhere (CPU tensors, older
    torch) the operands converted to ``cdt`` first (exact; the weight once per call: ``V*H*4`` bytes more)."""

    def __init__(self, weight: Tensor, op: torch.dtype, cdt: torch.dtype) -> None:
        self.op, self.cdt = op, cdt
        self.native = op == cdt or _mm_fp32_out(weight.device, op)
        self.w = weight.to(op) if self.native else weight.to(cdt)

    def _up(self, t: Tensor) -> Tensor:
        return t if self.native else t.to(self.cdt)

    def logits(self, h: Tensor, out: Tensor) -> None:
        """``out [c, V] cdt = h @ W.T``."""
        if self.op == self.cdt or not self.native:
            torch.mm(self._up(h), self.w.t(), out=out)
        else:
            torch.mm(h, self.w.t(), out_dtype=self.cdt, out=out)

    def d_hidden(self, dz: Tensor, out: Tensor) -> None:
        """``out [c, H] = dz @ W`` (``out`` in the hidden states' dtype: written straight into its rows)."""
        if self.native and out.dtype == self.op:
            torch.mm(dz, self.w, out=out)
        else:
            out.copy_(torch.mm(self._up(dz), self.w))

    def d_weight_once(self, dz: Tensor, h: Tensor, dtype: torch.dtype) -> Tensor:
        """``dz.T @ h`` over all rows in one GEMM of the operands as they are (fp32 accumulation inside the GEMM),
        returned in ``dtype`` (the weight's; cast only where the operand dtype differs from it)."""
        out = torch.mm(self._up(dz).t(), self._up(h))
        return out if out.dtype == dtype else out.to(dtype)

    def d_weight(self, dw: Tensor, dz: Tensor, h: Tensor, first: bool) -> None:
        """``dw [V, H] cdt (+)= dz.T @ h`` (``first``: written, nothing read)."""
        a, b = self._up(dz).t(), self._up(h)
        if self.op == self.cdt or not self.native:
            torch.mm(a, b, out=dw) if first else dw.addmm_(a, b)
        elif first:
            torch.mm(a, b, out_dtype=self.cdt, out=dw)
        else:
            torch.addmm(dw, a, b, out_dtype=self.cdt, out=dw)


def _active_index(active: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    """The ``[k]`` int64 rows of ``active`` on ``device`` (one host read), or None: every row (``active`` None or
    all True), or no host read allowed (the caller then computes every row and zeroes the others)."""
    if active is None or not host_reads_allowed():
        return None
    host = _to_host(active)
    if bool(host.all()):
        return None
    index = torch.nonzero(host)[:, 0]
    return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index.to(device)


def _linear_rows(n: int, V: int, cdt: torch.dtype, tiles: int, memory_budget: Optional[int]) -> int:
    """Rows per chunk of the accelerator route: ``tiles`` ``[rows, V]`` tiles in ``cdt`` fill the budget."""
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
    item = torch.empty((), dtype=cdt).element_size()
    return max(1, min(max(n, 1), budget // (tiles * max(V, 1) * item)))


def _scale_logits(z: Tensor, bias: Optional[Tensor], tau: float, cap: Optional[float],
                  slope: Optional[Tensor]) -> None:
    """In place: ``z = (c tanh((z + b) / c)) / tau`` (or ``(z + b) / tau``), with the cap's ``sech^2`` in ``slope``."""
    if bias is not None:
        z.add_(bias)
    if cap is None:
        if tau != 1.0:
            z.div_(tau)
        return
    z.div_(cap)
    if slope is not None:
        torch.cosh(z, out=slope).pow_(-2)
    z.tanh_().mul_(cap / tau)


def _keeps_probabilities(ctx, m: int, weight: Tensor, gemms: "_Gemms", cap: Optional[float]) -> bool:
    """Whether the accelerator route's forward keeps ``p`` of its ``m`` rows (``[m, V]`` in the operand dtype) for the
    backward, which then makes no logits GEMM and writes ``dW`` in one GEMM in the weight's dtype: when those bytes
    are at most the fp32 ``dW`` accumulator's (``V*H*4``) that the backward without them allocates (``m <= 2H``
    for bf16 operands: N = 4096 rows at H = 4096), so the peak does not grow. Only where ``dW`` is wanted, with a
    host read allowed (the rows are then the active ones, compacted: no padding row's NaN in ``p``), without a
    soft cap (its ``sech^2`` would have to be kept too), and where the GEMMs take the operands as they are (half
    operands with fp32 output: no upcast copy of ``dZ``, which would take more bytes than the accumulator)."""
    if m == 0 or cap is not None or not gemms.native or not host_reads_allowed():
        return False
    if not ctx.needs_input_grad[1]:
        return False
    item = torch.empty((), dtype=gemms.op).element_size()
    return m * item <= 4 * weight.shape[1]


def _linear_forward_accelerated(ctx, hidden, weight, bias, labels, active, tau, return_entropy, cap, memory_budget,
                                graph=False):
    """Row chunks sized from the budget, no vocabulary tiles: per chunk one GEMM into an fp32 ``[c, V]`` tile,
    then the logits path's argmax + softmax + entr + sum (:func:`_rows_forward_accelerated`). One host read (the
    ``active`` rows, compacted) at most; nothing saved but the inputs (the backward recomputes the logits), unless
    ``p`` is kept (:func:`_keeps_probabilities`; ``graph``: autograd records this call, so a backward may follow)."""
    rows_all = as_rows(hidden)
    n, V = labels.shape[0], weight.shape[0]
    cdt = compute_dtype(hidden.dtype)
    device = hidden.device
    op = hidden.dtype if hidden.dtype == weight.dtype else cdt
    gemms = _Gemms(weight, op, cdt)
    shifted = _shifted_bias(bias, cdt, cap)
    index = _active_index(active, device)
    h_all = rows_all if index is None else rows_all.index_select(0, index)
    lab = labels if index is None else labels.index_select(0, index)
    m = h_all.shape[0]
    col, inside = _label_columns(lab, V)
    C = _linear_rows(m, V, cdt, 2, memory_budget)
    ws = _Workspace(C, V, cdt, device)  # a: the logits tile, b: p
    logp_c = torch.empty(m, dtype=cdt, device=device)
    ent_c = torch.empty(m, dtype=cdt, device=device)
    kept = None
    if graph and _keeps_probabilities(ctx, m, weight, gemms, cap):
        kept = torch.empty(m, V, dtype=op, device=device)
    for r0 in range(0, m, C):
        r1 = min(r0 + C, m)
        z = ws.tiles(r1 - r0, V)[0]
        gemms.logits(h_all[r0:r1].to(op), z)
        _scale_logits(z, shifted, tau, cap, None)
        lp, ent = _rows_forward_accelerated(z, col[r0:r1], inside[r0:r1], cdt, ws, return_entropy,
                                            None if kept is None else kept[r0:r1])
        logp_c[r0:r1] = lp
        if return_entropy:
            ent_c[r0:r1] = ent
    logp_c = torch.where(inside, logp_c, float("nan"))
    if not return_entropy:
        ent_c.zero_()
    if index is None:
        logp, entropy = logp_c, ent_c
        if active is not None:  # no host read allowed: every row computed, the others' results 0
            logp = torch.where(active, logp, 0.0)
            entropy = torch.where(active, entropy, 0.0)
    else:
        logp = torch.zeros(n, dtype=cdt, device=device).index_copy_(0, index, logp_c)
        entropy = torch.zeros(n, dtype=cdt, device=device).index_copy_(0, index, ent_c)
    ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), labels, entropy,
                          index if index is not None else torch.empty(0, dtype=torch.long),
                          active if active is not None else torch.empty(0, dtype=torch.bool))
    ctx.accelerated, ctx.compacted, ctx.has_active = True, index is not None, active is not None
    # intermediates (not inputs or outputs): on ctx, dropped by the backward that uses them
    ctx.kept = None if kept is None else (kept, torch.expm1(logp_c))
    ctx.memory_budget = memory_budget
    return logp, entropy


def _linear_backward_accelerated(ctx, grad_logp, grad_entropy):
    """Per row chunk: the logits recomputed (one GEMM), ``dZ`` formed in fp32 and cast once to the operand dtype
    (into the logits tile's own storage), ``dH = dZ @ W`` written into its rows, ``dW += dZ.T @ h`` into one fp32
    accumulator (the first chunk writes it). No host read: rows without gradient (of log-prob or entropy, or
    inactive) go through as zero rows, their hidden rows zeroed first so that NaN padding cannot reach ``dW``."""
    hidden, weight, bias, labels, entropy, index, active = ctx.saved_tensors
    bias = bias if ctx.has_bias else None
    tau, cap = ctx.temperature, ctx.softcap
    n = labels.shape[0]
    V, H = weight.shape
    cdt = entropy.dtype
    device = hidden.device
    op = hidden.dtype if hidden.dtype == weight.dtype else cdt
    gemms = _Gemms(weight, op, cdt)
    shifted = _shifted_bias(bias, cdt, cap)
    rows_all = as_rows(hidden)
    carries = _carries_gradient(grad_logp, grad_entropy, n, device)
    if ctx.has_active and not ctx.compacted:
        carries &= active
    g_all = grad_logp if grad_logp is not None else torch.zeros_like(entropy)
    g_all = torch.where(carries, g_all, 0.0)
    ge_all = None if grad_entropy is None else torch.where(carries, grad_entropy, 0.0)
    sel = (lambda t: t) if not ctx.compacted else (lambda t: t.index_select(0, index))
    h_all, g_all, carries, ent_all = sel(rows_all), sel(g_all), sel(carries), sel(entropy)
    ge_all = None if ge_all is None else sel(ge_all)
    col, inside = _label_columns(sel(labels), V)
    m = h_all.shape[0]
    kept, ctx.kept = ctx.kept, None  # dZ is formed in its storage: a second backward (retain_graph) recomputes
    if kept is not None and ge_all is None:
        return _linear_backward_kept(ctx, kept, h_all, carries, g_all, col, inside, gemms, index, n, hidden, weight,
                                     bias)
    kept = None  # an entropy gradient needs log p: freed before the recomputation's buffers
    tiles = 2 + (ge_all is not None) + (cap is not None)
    C = _linear_rows(m, V, cdt, tiles, ctx.memory_budget)
    ws = _Workspace(C, V, cdt, device)  # the logits tile (then dZ in its storage), p, and lp / the cap's slope
    z_buf = torch.empty(C * V, dtype=cdt, device=device)
    dz_buf = z_buf.view(op) if op != cdt else z_buf
    pre = None if ge_all is not None else (torch.where(inside, -1.0, 0.0).to(cdt), -g_all / tau)
    want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    want_b = bias is not None and ctx.needs_input_grad[2]
    dh = torch.empty(m, H, dtype=hidden.dtype, device=device) if want_h else None
    dw = torch.zeros(V, H, dtype=cdt, device=device) if m == 0 and want_w else None
    db = torch.zeros(V, dtype=cdt, device=device) if want_b else None
    for r0 in range(0, m, C):
        r1 = min(r0 + C, m)
        c = r1 - r0
        h = torch.where(carries[r0:r1, None], h_all[r0:r1], 0).to(op)
        z = z_buf[: c * V].view(c, V)
        gemms.logits(h, z)
        slope = ws.slope_tile(c, V) if cap is not None else None
        _scale_logits(z, shifted, tau, cap, slope)
        dz = dz_buf[: c * V].view(c, V)  # the logits tile's own storage: z is not read after its softmax
        _rows_backward(z, col[r0:r1], inside[r0:r1], g_all[r0:r1], None if ge_all is None else ge_all[r0:r1],
                       ent_all[r0:r1], tau, cdt, ws, slope, dz,
                       None if pre is None else (pre[0][r0:r1], pre[1][r0:r1]))
        if want_h:
            gemms.d_hidden(dz, dh[r0:r1])
        if want_w:
            if dw is None:
                dw = torch.empty(V, H, dtype=cdt, device=device)
                gemms.d_weight(dw, dz, h, first=True)
            else:
                gemms.d_weight(dw, dz, h, first=False)
        if want_b:
            db += dz.sum(dim=0, dtype=cdt)
    grad_hidden = None
    if want_h:
        if ctx.compacted:
            dh = torch.zeros(n, H, dtype=hidden.dtype, device=device).index_copy_(0, index, dh)
        grad_hidden = dh.reshape(hidden.shape)
    grad_weight = dw.to(weight.dtype) if want_w else None
    grad_bias = db.to(bias.dtype) if want_b else None
    return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def _linear_backward_kept(ctx, kept, h_all, carries, g_all, col, inside, gemms, index, n, hidden, weight, bias):
    """The backward from the forward's kept ``p`` (:func:`_keeps_probabilities`): no logits GEMM. ``dZ = coef (p -
    onehot)`` formed in ``p``'s storage (one in-place multiply; the label's entry ``coef expm1(log p_y)`` from the
    forward's fp32 log-prob, rounded once; the others rounded twice for fp16/bf16 operands: ``p``, then the
    product), ``dH = dZ @ W`` and ``dW = dZ.T @ h`` one GEMM each, ``dW`` written in the weight's dtype (no fp32
    accumulator). Rows without gradient have ``coef = 0``: zero ``dZ`` rows, their hidden rows zeroed too."""
    p, em1 = kept
    tau = ctx.temperature
    m, H = h_all.shape
    cdt = g_all.dtype
    device = h_all.device
    coef = -g_all / tau
    dz = _scale_probabilities(p, coef, col, inside, em1 * coef)  # (NaN where the label is outside [0, V): not read)
    want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    want_b = bias is not None and ctx.needs_input_grad[2]
    grad_hidden = grad_weight = grad_bias = None
    if want_h:
        dh = torch.empty(m, H, dtype=hidden.dtype, device=device)
        gemms.d_hidden(dz, dh)
        if ctx.compacted:
            dh = torch.zeros(n, H, dtype=hidden.dtype, device=device).index_copy_(0, index, dh)
        grad_hidden = dh.reshape(hidden.shape)
    if want_w:
        h = torch.where(carries[:, None], h_all, 0).to(gemms.op)
        grad_weight = gemms.d_weight_once(dz, h, weight.dtype)
    if want_b:
        grad_bias = dz.sum(dim=0, dtype=cdt).to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, active, temperature, return_entropy, softcap, memory_budget=None,
                graph=False):
        ctx.has_bias = bias is not None
        ctx.temperature = temperature
        ctx.softcap = softcap
        ctx.set_materialize_grads(False)  # an unused entropy gets grad None, not a zero-filled tensor
        ctx.accelerated = False
        if _accelerated(hidden.device):
            return _linear_forward_accelerated(ctx, hidden, weight, bias, labels, active, temperature, return_entropy,
                                               softcap, memory_budget, graph)
        rows_all = as_rows(hidden)
        n = labels.shape[0]
        V = weight.shape[0]
        cdt = compute_dtype(hidden.dtype)
        device = hidden.device
        logp = torch.zeros(n, dtype=cdt, device=device)
        entropy = torch.zeros(n, dtype=cdt, device=device)
        stats = torch.zeros(2, n, dtype=cdt, device=device)
        shifted = _shifted_bias(bias, cdt, softcap)
        ws = _Workspace(LINEAR_ROW_BLOCK, min(LINEAR_VOCAB_BLOCK, V), cdt, device)
        index_all = torch.arange(n, device=device) if active is None else torch.nonzero(active)[:, 0]
        for b0 in range(0, index_all.numel(), LINEAR_ROW_BLOCK):
            index = index_all[b0 : b0 + LINEAR_ROW_BLOCK]
            h = rows_all[index].to(cdt)
            state = _OnlineSoftmax(index.numel(), labels[index], cdt, device)
            for v0 in range(0, V, LINEAR_VOCAB_BLOCK):
                x, _ = _linear_tile(h, weight, shifted, v0, cdt, temperature, softcap)
                state.fold(x, v0, ws, return_entropy)
            logp[index], entropy[index], stats[:, index] = state.finish()
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), labels, stats, entropy)
        ctx.has_bias = bias is not None
        ctx.temperature = temperature
        ctx.softcap = softcap
        ctx.set_materialize_grads(False)  # an unused entropy gets grad None, not a zero-filled tensor
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        if ctx.accelerated:
            return _linear_backward_accelerated(ctx, grad_logp, grad_entropy)
        hidden, weight, bias, labels, stats, entropy = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        tau, cap = ctx.temperature, ctx.softcap
        n = labels.shape[0]
        V, H = weight.shape
        cdt = stats.dtype
        device = hidden.device
        rows_all = as_rows(hidden)
        shifted = _shifted_bias(bias, cdt, cap)
        ws = _Workspace(LINEAR_ROW_BLOCK, min(LINEAR_VOCAB_BLOCK, V), cdt, device)
        index_all = torch.nonzero(_carries_gradient(grad_logp, grad_entropy, n, device))[:, 0]
        g_all = grad_logp if grad_logp is not None else torch.zeros_like(entropy)
        d_hidden = torch.zeros(n, H, dtype=cdt, device=device)
        d_weight = torch.zeros(V, H, dtype=cdt, device=device)  # fp32 accumulator: V*H*4 bytes
        d_bias = torch.zeros(V, dtype=cdt, device=device) if bias is not None else None
        for b0 in range(0, index_all.numel(), LINEAR_ROW_BLOCK):
            index = index_all[b0 : b0 + LINEAR_ROW_BLOCK]
            h = rows_all[index].to(cdt)
            g = g_all[index]
            ge = grad_entropy[index] if grad_entropy is not None else None
            m, log_s, ent = stats[0, index], stats[1, index], entropy[index]
            dh = torch.zeros_like(h)
            for v0 in range(0, V, LINEAR_VOCAB_BLOCK):
                z, slope = _linear_tile(h, weight, shifted, v0, cdt, tau, cap, slope=True)
                _grad_tile(z, m, log_s, ent, g, ge, labels[index] - v0, tau, ws, out=z)  # dz, in place
                if slope is not None:
                    z.mul_(slope)
                w_tile = weight[v0 : v0 + LINEAR_VOCAB_BLOCK].to(cdt)
                dh.addmm_(z, w_tile)
                d_weight[v0 : v0 + LINEAR_VOCAB_BLOCK].addmm_(z.T, h)
                if d_bias is not None:
                    d_bias[v0 : v0 + LINEAR_VOCAB_BLOCK] += z.sum(dim=0)
            d_hidden[index] = dh
        grad_hidden = d_hidden.to(hidden.dtype).reshape(hidden.shape) if ctx.needs_input_grad[0] else None
        grad_weight = d_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = d_bias.to(bias.dtype) if d_bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def _shifted_bias(bias: Optional[Tensor], cdt: torch.dtype, cap: Optional[float] = None) -> Optional[Tensor]:
    """``bias - max(bias)`` in ``cdt`` (softmax is shift-invariant): a bias of 1e4 + noise then adds
    no rounding of 1e4-sized numbers to the logits. Unchanged when its max is not finite, or under a soft
    cap (``c tanh(z / c)`` is not shift-invariant)."""
    if bias is None or bias.numel() == 0 or cap is not None:
        return None if bias is None else bias.to(cdt)
    b = bias.to(cdt)
    top = b.max()
    return torch.where(torch.isfinite(top), b - top, b)


def _linear_tile(h: Tensor, weight: Tensor, bias: Optional[Tensor], v0: int, cdt: torch.dtype, tau: float,
                 cap: Optional[float] = None, slope: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Scaled logits ``(h @ W[v0:v1].T + b[v0:v1]) / tau`` of one vocabulary tile, accumulated in ``cdt``
    (fp16/bf16 operands are converted to fp32 exactly: exact products, fp32 sums); with the soft cap ``c``,
    ``c tanh(z / c) / tau``, and with ``slope`` the tile's ``sech^2(z / c)`` (else None)."""
    w_tile = weight[v0 : v0 + LINEAR_VOCAB_BLOCK].to(cdt)
    z = h @ w_tile.T
    if bias is not None:
        z += bias[v0 : v0 + LINEAR_VOCAB_BLOCK]
    if cap is None:
        return (z if tau == 1.0 else z.div_(tau)), None
    z.div_(cap)
    s = torch.cosh(z).pow_(-2) if slope else None
    return z.tanh_().mul_(cap / tau), s


def logits_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
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
    cap = None if softcap is None else float(softcap)
    base = None
    if _accelerated(logits.device) and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        base = next_token_base(logits)  # [B, T + 1, V] read as [:, :-1]: its gradient written here, no slice_backward
    logp, entropy = _LogitsLogprobs.apply(logits if base is None else base, labels, active, float(temperature),
                                          return_entropy, inplace_backward, cap, base is not None)
    return logp, (entropy if return_entropy else None)


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    labels: Tensor,
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    memory_budget: Optional[int] = None,
    batch_invariant: bool = False,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-token ``(logp [N], entropy [N] | None)`` of ``hidden @ weight.T + bias``.

    ``softcap``: see the backend contract. ``batch_invariant=True`` is refused: the BLAS this backend calls picks its kernels by shape.
    fp16/bf16/fp32 inputs: converted to fp32 exactly (exact products), fp32 accumulation and outputs;
    fp64 inputs: fp64 math and outputs. On CPU tensors no logits are kept between forward and backward (recomputed).
    CPU tensors: ``memory_budget`` is ignored; extra memory ``O(N)`` plus a few ``[1024, 4096]`` tiles; the
    backward adds accumulators for ``dW`` (``V*H*4`` bytes), ``dH`` (``N*H*4``) and ``dbias`` (``V*4``).
    Accelerators: ``[rows, V]`` fp32 tiles filling ``memory_budget`` (None: ``DEFAULT_MEMORY_BUDGET``; 2 tiles in
    the forward, 2 in the backward, 3 with an entropy gradient, one more with a soft cap), plus the fp32 ``dW``
    accumulator (``V*H*4``), ``dH`` in the hidden states' dtype, and, where the GEMMs cannot write fp32 from half
    operands (no ``out_dtype``), an fp32 copy of the weight. One host read per forward with ``active``, none in the
    backward. There, when the weight's gradient is wanted, a graph is recorded, no soft cap is given, the GEMMs
    write fp32 from half operands (``out_dtype``) and ``p`` of
    the ``m`` active rows (``[m, V]`` in the operand dtype) takes at most the fp32 ``dW`` accumulator's bytes
    (``m <= 2H`` for bf16), the forward keeps ``p`` instead: the backward then makes no logits GEMM (6NHV in all,
    not 8NHV) and no fp32 accumulator (``dW`` in the weight's dtype from one GEMM); with an entropy gradient it
    recomputes as above.
    """
    if batch_invariant:
        raise ValueError("batch_invariant=True needs backend='triton' or backend='cpu': the 'torch' backend's "
                         "matmuls round a row depending on the batch's shape")
    cap = None if softcap is None else float(softcap)
    graph = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    logp, entropy = _LinearLogprobs.apply(hidden, weight, bias, labels, active, float(temperature), return_entropy,
                                          cap, memory_budget, graph)
    return logp, (entropy if return_entropy else None)


def make_backend() -> Backend:
    return Backend("torch", logits_logprobs, linear_logprobs)
