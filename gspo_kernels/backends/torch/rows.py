"""The row math both paths of the torch backend share: the scratch workspace, the route switch (CPU or
accelerator), the host read of a row mask, each row's label column, and the softmax rows' forward
(:func:`_rows_forward_accelerated`) and gradient (:func:`_rows_backward`, :func:`_scale_probabilities`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor


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


def _label_columns(labels: Tensor, V: int) -> Tuple[Tensor, Tensor]:
    """``(col [N] int64, inside [N] bool)``: each label clamped into ``[0, V)`` and whether it was there (once
    per call, not per block; a label outside is never read)."""
    return labels.clamp(0, V - 1), (labels >= 0) & (labels < V)


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


@dataclass(frozen=True)
class _RowGradient:
    """What :func:`_rows_backward` reads of ``r`` rows besides their logits: each row's label column ``col [r]``
    int64 and whether the label is in ``[0, V)`` (``inside [r]`` bool; :func:`_label_columns`), the incoming
    gradients ``g [r]`` (of the log-prob) and ``ge [r]`` (of the entropy; None: no entropy gradient), the rows'
    entropy ``ent [r]`` (read only with ``ge``), and ``pre``: the rows' ``(-1 where inside else 0, -g/tau)`` in the
    compute dtype, formed once per call by the caller (the accelerator route without ``ge``), or None."""

    col: Tensor
    inside: Tensor
    g: Tensor
    ge: Optional[Tensor]
    ent: Optional[Tensor]
    pre: Optional[Tuple[Tensor, Tensor]] = None


def _rows_backward(x: Tensor, rows: _RowGradient, tau: float, cdt: torch.dtype, ws: _Workspace,
                   slope: Optional[Tensor], out: Tensor) -> None:
    """Write ``dL/dlogits`` of the rows into ``out [r, V]`` (the logits' dtype, possibly their own storage:
    ``x`` is read before ``out`` is written): ``(g/tau)(onehot - p) - (ge/tau) p (log p + H)``, times the
    soft cap's ``slope`` when given. Formed in the compute dtype and rounded once when stored.

    Without an entropy gradient: ``p = softmax(x)``, ``p_y -= 1`` (a ``scatter_add``: no sort, no host read),
    then one multiply by ``-g/tau`` written straight into ``out``: two passes over the rows (``rows.pre``, when
    given, holds the ``-1`` entries and ``-g/tau``).
    """
    col, inside, g, ge, ent, pre = rows.col[:, None], rows.inside, rows.g, rows.ge, rows.ent, rows.pre
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


def _scale_probabilities(p: Tensor, coef: Tensor, col: Tensor, inside: Tensor, label_grad: Tensor) -> Tensor:
    """``p [r, V]`` (half-precision probabilities) into ``coef (p - onehot)`` in place: one multiply, then each
    row's label entry set to ``label_grad`` (``coef (p_y - 1)`` formed in fp32, rounded once), except a row whose
    label is outside ``[0, V)`` (``inside`` False), which keeps its clamped column's ``coef p``."""
    p.mul_(coef[:, None])
    c = col[:, None]
    return p.scatter_(1, c, torch.where(inside[:, None], label_grad.to(p.dtype)[:, None], p.gather(1, c)))
