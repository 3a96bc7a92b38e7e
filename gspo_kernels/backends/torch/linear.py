"""The torch backend's hidden-state path: ``linear_logprobs`` (``hidden @ weight.T + bias`` in row chunks, or
rows x vocabulary tiles with an online softmax on CPU tensors) and its autograd Function."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.backends.contract import DEFAULT_MEMORY_BUDGET
from gspo_kernels.backends.tiling import as_rows
from gspo_kernels.backends.torch.rows import (
    _accelerated,
    _carries_gradient,
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

LINEAR_ROW_BLOCK = 1024  # rows per tile of the hidden-state path (the weight is streamed once per block)
LINEAR_VOCAB_BLOCK = 4096


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


@dataclass(frozen=True)
class _TileRows:
    """What :func:`_grad_tile` reads of a block's ``r`` rows, the same for each of its vocabulary tiles: the
    forward's statistics ``m [r]`` and ``log_s [r]`` (``log p = (x - m) - log s``) and ``entropy [r]``, and the
    incoming gradients ``g [r]`` (of the log-prob) and ``ge [r]`` (of the entropy; None: no entropy gradient)."""

    m: Tensor
    log_s: Tensor
    entropy: Tensor
    g: Tensor
    ge: Optional[Tensor]


def _grad_tile(x: Tensor, rows: _TileRows, local: Tensor, tau: float, ws: _Workspace, out: Tensor) -> None:
    """Write ``dL/dlogits`` of one tile into ``out``: ``(g/tau)(onehot - p) - (ge/tau) p (log p + H)``.

    ``x``: the scaled logits tile (not modified); ``local [r]``: each row's label minus the tile's first column;
    ``out`` may be a strided view of the gradient (or of the logits themselves: ``x`` is read before ``out`` is
    written).
    """
    m, log_s, entropy, g, ge = rows.m, rows.log_s, rows.entropy, rows.g, rows.ge
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


def _row_selection(rows: Optional[Tensor], n: int, device: torch.device) -> Tuple[Tensor, Optional[Tensor]]:
    """``(index [k] int64, keep)``: the rows the CPU route computes, of the ``[N]`` bool mask ``rows`` (None: all).

    Eager: only the selected rows (``nonzero``, a data-dependent count: the saving of skipped rows), ``keep``
    None. Where no host read is allowed (``torch.compile`` tracing, CUDA-graph capture): every row, and ``keep``
    = ``rows``, the mask the caller applies to each block's operands and results (a shape known before the
    values: one graph, no ``nonzero``). The selected rows get the same values either way."""
    if rows is not None and host_reads_allowed():
        return torch.nonzero(rows)[:, 0], None
    return torch.arange(n, device=device), rows


def _kept_rows(t: Tensor, keep: Optional[Tensor]) -> Tensor:
    """``t [r, ...]`` with the rows where ``keep [r]`` is False set to 0 (``t`` itself when ``keep`` is None)."""
    if keep is None:
        return t
    return torch.where(keep.reshape(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))


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


def _linear_forward_accelerated(ctx, hidden, weight, bias, labels, active, options: CallOptions, graph=False):
    """Row chunks sized from the budget, no vocabulary tiles: per chunk one GEMM into an fp32 ``[c, V]`` tile,
    then the logits path's argmax + softmax + entr + sum (:func:`_rows_forward_accelerated`). One host read (the
    ``active`` rows, compacted) at most; nothing saved but the inputs (the backward recomputes the logits), unless
    ``p`` is kept (:func:`_keeps_probabilities`; ``graph``: autograd records this call, so a backward may follow).
    ``options``: ``temperature``, ``return_entropy``, ``softcap`` and ``memory_budget`` read."""
    tau, return_entropy = float(options.temperature), options.return_entropy
    cap, memory_budget = options.softcap, options.memory_budget
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
    return logp, entropy


def _saved_geometry(ctx, weight: Tensor, bias: Tensor, labels: Tensor):
    """What both backwards read of the forward besides its tensors: the bias (None where the forward had none),
    temperature, softcap, the row count ``n`` and the weight's ``V, H``."""
    V, H = weight.shape
    return (bias if ctx.has_bias else None), float(ctx.options.temperature), ctx.options.softcap, labels.shape[0], V, H


def _linear_backward_accelerated(ctx, grad_logp, grad_entropy):
    """Per row chunk: the logits recomputed (one GEMM), ``dZ`` formed in fp32 and cast once to the operand dtype
    (into the logits tile's own storage), ``dH = dZ @ W`` written into its rows, ``dW += dZ.T @ h`` into one fp32
    accumulator (the first chunk writes it). No host read: rows without gradient (of log-prob or entropy, or
    inactive) go through as zero rows, their hidden rows zeroed first so that NaN padding cannot reach ``dW``."""
    hidden, weight, bias, labels, entropy, index, active = ctx.saved_tensors
    bias, tau, cap, n, V, H = _saved_geometry(ctx, weight, bias, labels)
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
        rows = _SelectedRows(h=h_all, carries=carries, g=g_all, col=col, inside=inside, index=index, n=n)
        return _linear_backward_kept(ctx, kept, rows, gemms, hidden, weight, bias)
    kept = None  # an entropy gradient needs log p: freed before the recomputation's buffers
    tiles = 2 + (ge_all is not None) + (cap is not None)
    C = _linear_rows(m, V, cdt, tiles, ctx.options.memory_budget)
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
        rows = _RowGradient(col=col[r0:r1], inside=inside[r0:r1], g=g_all[r0:r1],
                            ge=None if ge_all is None else ge_all[r0:r1], ent=ent_all[r0:r1],
                            pre=None if pre is None else (pre[0][r0:r1], pre[1][r0:r1]))
        _rows_backward(z, rows, tau, cdt, ws, slope, dz)
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
    return grad_hidden, grad_weight, grad_bias, None, None, None, None


@dataclass(frozen=True)
class _SelectedRows:
    """The ``m`` rows the accelerator route's backward visits (all ``n``, or the forward's active rows, compacted):
    their hidden states ``h [m, H]``, ``carries [m]`` bool (a nonzero incoming gradient, in an active row), the
    log-prob's gradient ``g [m]`` (0 where not carried), their labels' ``col [m]`` and ``inside [m]``
    (:func:`_label_columns`), and ``index [m]`` int64, their positions among the ``n`` rows (read where the forward
    compacted them, ``ctx.compacted``)."""

    h: Tensor
    carries: Tensor
    g: Tensor
    col: Tensor
    inside: Tensor
    index: Tensor
    n: int


def _linear_backward_kept(ctx, kept, rows: _SelectedRows, gemms: "_Gemms", hidden, weight, bias):
    """The backward from the forward's kept ``p`` (:func:`_keeps_probabilities`): no logits GEMM. ``dZ = coef (p -
    onehot)`` formed in ``p``'s storage (one in-place multiply; the label's entry ``coef expm1(log p_y)`` from the
    forward's fp32 log-prob, rounded once; the others rounded twice for fp16/bf16 operands: ``p``, then the
    product), ``dH = dZ @ W`` and ``dW = dZ.T @ h`` one GEMM each, ``dW`` written in the weight's dtype (no fp32
    accumulator). Rows without gradient have ``coef = 0``: zero ``dZ`` rows, their hidden rows zeroed too."""
    h_all, carries, g_all, col, inside, index, n = rows.h, rows.carries, rows.g, rows.col, rows.inside, rows.index, rows.n
    p, em1 = kept
    tau = float(ctx.options.temperature)
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
    return grad_hidden, grad_weight, grad_bias, None, None, None, None


class _LinearLogprobs(torch.autograd.Function):
    """``(hidden, weight, bias, labels, active, options, graph) -> (logp, entropy)``; ``options``: the call's
    :class:`~gspo_kernels.options.CallOptions` (``temperature``, ``return_entropy``, ``softcap``, ``memory_budget``
    read); ``graph``: whether a backward will follow (the accelerated path may keep ``p`` for it)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, active, options: CallOptions, graph=False):
        temperature, return_entropy, softcap = float(options.temperature), options.return_entropy, options.softcap
        ctx.has_bias = bias is not None
        ctx.options = options  # the call's options, whole (the backward reads temperature, softcap, memory_budget)
        ctx.set_materialize_grads(False)  # an unused entropy gets grad None, not a zero-filled tensor
        ctx.accelerated = False
        if _accelerated(hidden.device):
            return _linear_forward_accelerated(ctx, hidden, weight, bias, labels, active, options, graph)
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
        index_all, keep_all = _row_selection(active, n, device)
        for b0 in range(0, index_all.numel(), LINEAR_ROW_BLOCK):
            index = index_all[b0 : b0 + LINEAR_ROW_BLOCK]
            keep = None if keep_all is None else keep_all[b0 : b0 + LINEAR_ROW_BLOCK]
            h = _kept_rows(rows_all[index].to(cdt), keep)
            state = _OnlineSoftmax(index.numel(), labels[index], cdt, device)
            for v0 in range(0, V, LINEAR_VOCAB_BLOCK):
                x, _ = _linear_tile(h, weight, shifted, v0, cdt, temperature, softcap)
                state.fold(x, v0, ws, return_entropy)
            results = state.finish()
            if keep is not None:  # the rows not selected: 0, as eager leaves them
                results = tuple(torch.where(keep, r, 0.0) for r in results)
            logp[index], entropy[index], stats[:, index] = results
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), labels, stats, entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        if ctx.accelerated:
            return _linear_backward_accelerated(ctx, grad_logp, grad_entropy)
        hidden, weight, bias, labels, stats, entropy = ctx.saved_tensors
        bias, tau, cap, n, V, H = _saved_geometry(ctx, weight, bias, labels)
        cdt = stats.dtype
        device = hidden.device
        rows_all = as_rows(hidden)
        shifted = _shifted_bias(bias, cdt, cap)
        ws = _Workspace(LINEAR_ROW_BLOCK, min(LINEAR_VOCAB_BLOCK, V), cdt, device)
        index_all, keep_all = _row_selection(_carries_gradient(grad_logp, grad_entropy, n, device), n, device)
        g_all = grad_logp if grad_logp is not None else torch.zeros_like(entropy)
        d_hidden = torch.zeros(n, H, dtype=cdt, device=device)
        d_weight = torch.zeros(V, H, dtype=cdt, device=device)  # fp32 accumulator: V*H*4 bytes
        d_bias = torch.zeros(V, dtype=cdt, device=device) if bias is not None else None
        for b0 in range(0, index_all.numel(), LINEAR_ROW_BLOCK):
            index = index_all[b0 : b0 + LINEAR_ROW_BLOCK]
            keep = None if keep_all is None else keep_all[b0 : b0 + LINEAR_ROW_BLOCK]
            h = _kept_rows(rows_all[index].to(cdt), keep)  # a row without gradient adds 0 to dW, never NaN
            g = _kept_rows(g_all[index], keep)
            ge = _kept_rows(grad_entropy[index], keep) if grad_entropy is not None else None
            rows = _TileRows(m=stats[0, index], log_s=stats[1, index], entropy=entropy[index], g=g, ge=ge)
            dh = torch.zeros_like(h)
            for v0 in range(0, V, LINEAR_VOCAB_BLOCK):
                z, slope = _linear_tile(h, weight, shifted, v0, cdt, tau, cap, slope=True)
                _grad_tile(z, rows, labels[index] - v0, tau, ws, out=z)  # dz, in place
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
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


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


def linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                    active: Optional[Tensor] = None, options: CallOptions = DEFAULT_OPTIONS, *,
                    leaves: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-token ``(logp [N], entropy [N] | None)`` of ``hidden @ weight.T + bias``. ``leaves`` (the contract's):
    not used, the gradients reach the caller's tensors through the precision policy's casts.

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
    if options.batch_invariant:
        raise ValueError("batch_invariant=True needs backend='triton' or backend='cpu': the 'torch' backend's "
                         "matmuls round a row depending on the batch's shape")
    graph = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    logp, entropy = _LinearLogprobs.apply(hidden, weight, bias, labels, active, options, graph)
    return logp, (entropy if options.return_entropy else None)
