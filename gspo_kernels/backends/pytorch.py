"""``backend="torch"``: the portable chunked heavy stage (any device), and the blueprint of the others.

Forward: rows x vocabulary tiles, an online logsumexp with the label's logit and the entropy folded
in, fp32 math; no ``[N, V]`` fp32 tensor exists (the logits path reads the caller's logits a tile at
a time; the hidden-state path forms one ``[rows, vocab_block]`` logits tile at a time).
Backward: recomputes tiles from the saved logsumexp, accumulates in fp32, and visits only the rows
whose incoming gradient (of log-prob or entropy) is non-zero; the others get exactly zero gradient.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.backends import Backend
from gspo_kernels.backends.tiling import as_rows, row_blocks

ROW_BLOCK = 256  # rows per tile
VOCAB_BLOCK = 16384  # vocabulary entries per tile (64 KiB of fp32 per row)
LINEAR_ROW_BLOCK = 1024  # rows per tile of the hidden-state path (the weight is streamed once per block)
LINEAR_VOCAB_BLOCK = 4096


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _OnlineSoftmax:
    """Running max ``m``, ``s = sum e^(z-m)``, ``t = sum e^(z-m) z`` and the label's logit, per row."""

    def __init__(self, rows: int, labels: Tensor, dtype: torch.dtype, device: torch.device) -> None:
        self.m = torch.full((rows,), float("-inf"), dtype=dtype, device=device)
        self.s = torch.zeros(rows, dtype=dtype, device=device)
        self.t = torch.zeros(rows, dtype=dtype, device=device)
        self.label_logit = torch.zeros(rows, dtype=dtype, device=device)
        self.labels = labels

    def fold(self, z: Tensor, v0: int) -> None:
        """Fold the scaled logits tile ``z [rows, vb]`` covering vocabulary ``[v0, v0 + vb)``."""
        m_new = torch.maximum(self.m, z.amax(dim=1))
        scale = torch.exp(self.m - m_new)
        e = torch.exp(z - m_new[:, None])
        self.s = self.s * scale + e.sum(dim=1)
        self.t = self.t * scale + torch.where(e > 0, e * z, 0.0).sum(dim=1)  # -inf logits add 0
        self.m = m_new
        local = self.labels - v0
        inside = (local >= 0) & (local < z.shape[1])
        picked = z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0]
        self.label_logit = torch.where(inside, picked, self.label_logit)

    def finish(self) -> Tuple[Tensor, Tensor, Tensor]:
        """``(logp, entropy, lse)`` with ``lse = m + log s`` and ``H = lse - t / s``."""
        lse = self.m + torch.log(self.s)
        return self.label_logit - lse, lse - self.t / self.s, lse


def _logit_grad(z: Tensor, lse: Tensor, entropy: Tensor, g: Tensor, h: Optional[Tensor], local: Tensor, tau: float) -> Tensor:
    """``dL/dlogits`` of one tile: ``(g/tau)(onehot - p) - (h/tau) p (log p + H)``.

    ``z`` is the scaled logits tile, a fresh tensor that is overwritten in place (one tile of memory).
    """
    dz = z.sub_(lse[:, None])  # log p
    if h is not None:
        log_p_plus_h = dz + entropy[:, None]
    dz.exp_()  # p
    if h is not None:
        # p (log p + H) with 0 where p == 0 (a -inf logit): no 0 * inf
        entropy_term = log_p_plus_h.mul_(dz).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).mul_(h[:, None])
    dz.mul_((-g / tau)[:, None])
    if h is not None:
        dz.sub_(entropy_term.mul_(1.0 / tau))
    inside = (local >= 0) & (local < z.shape[1])
    rows = torch.nonzero(inside)[:, 0]
    dz[rows, local[rows]] += g[rows] / tau
    return dz


def _carries_gradient(grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], n: int, device) -> Tensor:
    """``[N]`` bool: rows whose incoming gradient (of log-prob or entropy) is non-zero."""
    carries = torch.zeros(n, dtype=torch.bool, device=device)
    if grad_logp is not None:
        carries |= grad_logp != 0
    if grad_entropy is not None:
        carries |= grad_entropy != 0
    return carries


class _LogitsLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, active, temperature, return_entropy, inplace_backward):
        V = logits.shape[-1]
        n = labels.shape[0]
        cdt = _compute_dtype(logits.dtype)
        logp = torch.zeros(n, dtype=cdt, device=logits.device)
        entropy = torch.zeros(n, dtype=cdt, device=logits.device)
        lse = torch.zeros(n, dtype=cdt, device=logits.device)
        for r0, r1, rows in row_blocks(logits, ROW_BLOCK):
            index = torch.arange(r0, r1, device=logits.device)
            if active is not None:
                index = index[active[r0:r1]]
                if index.numel() == 0:
                    continue
                if index.numel() < r1 - r0:
                    rows = rows[index - r0]
            state = _OnlineSoftmax(index.numel(), labels[index], cdt, logits.device)
            for v0 in range(0, V, VOCAB_BLOCK):
                state.fold(rows[:, v0 : v0 + VOCAB_BLOCK].to(cdt) / temperature, v0)
            logp[index], entropy[index], lse[index] = state.finish()
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.temperature = temperature
        ctx.inplace = inplace_backward
        ctx.mark_non_differentiable(lse)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, lse, entropy = ctx.saved_tensors
        tau = ctx.temperature
        V = logits.shape[-1]
        n = labels.shape[0]
        carries = _carries_gradient(grad_logp, grad_entropy, n, logits.device)
        grad = logits.detach() if ctx.inplace else torch.zeros_like(logits)
        g_all = grad_logp if grad_logp is not None else torch.zeros_like(lse)
        for r0, r1, rows in row_blocks(logits.detach(), ROW_BLOCK):
            index = torch.arange(r0, r1, device=logits.device)[carries[r0:r1]]
            target = _row_view(grad, r0, r1)
            if index.numel() == 0:
                if ctx.inplace:
                    target.zero_()
                continue
            full = index.numel() == r1 - r0
            sub = rows if full else rows[index - r0]
            g = g_all[index]
            h = grad_entropy[index] if grad_entropy is not None else None
            if ctx.inplace and not full:
                target.zero_()
            for v0 in range(0, V, VOCAB_BLOCK):
                z = sub[:, v0 : v0 + VOCAB_BLOCK].to(lse.dtype, copy=True).div_(tau)
                dz = _logit_grad(z, lse[index], entropy[index], g, h, labels[index] - v0, tau)
                if full:
                    target[:, v0 : v0 + VOCAB_BLOCK].copy_(dz)
                else:
                    target[index - r0, v0 : v0 + VOCAB_BLOCK] = dz.to(grad.dtype)
        return grad, None, None, None, None, None


def _row_view(x: Tensor, r0: int, r1: int) -> Tensor:
    """Rows ``[r0, r1)`` of ``x`` (``[N, V]`` or ``[B, T, V]``) as a view; blocks never cross a batch row."""
    if x.dim() == 2:
        return x[r0:r1]
    try:
        return x.view(-1, x.shape[-1])[r0:r1]
    except RuntimeError:
        T = x.shape[1]
        return x[r0 // T, r0 % T : r0 % T + (r1 - r0)]


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, active, temperature, return_entropy):
        rows_all = as_rows(hidden)
        n = labels.shape[0]
        V = weight.shape[0]
        cdt = _compute_dtype(hidden.dtype)
        device = hidden.device
        logp = torch.zeros(n, dtype=cdt, device=device)
        entropy = torch.zeros(n, dtype=cdt, device=device)
        lse = torch.zeros(n, dtype=cdt, device=device)
        index_all = torch.arange(n, device=device) if active is None else torch.nonzero(active)[:, 0]
        for b0 in range(0, index_all.numel(), LINEAR_ROW_BLOCK):
            index = index_all[b0 : b0 + LINEAR_ROW_BLOCK]
            h = rows_all[index].to(cdt)
            state = _OnlineSoftmax(index.numel(), labels[index], cdt, device)
            for v0 in range(0, V, LINEAR_VOCAB_BLOCK):
                state.fold(_linear_tile(h, weight, bias, v0, cdt, temperature), v0)
            logp[index], entropy[index], lse[index] = state.finish()
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), labels, lse, entropy)
        ctx.has_bias = bias is not None
        ctx.temperature = temperature
        ctx.mark_non_differentiable(lse)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        tau = ctx.temperature
        n = labels.shape[0]
        V, H = weight.shape
        cdt = lse.dtype
        device = hidden.device
        rows_all = as_rows(hidden)
        index_all = torch.nonzero(_carries_gradient(grad_logp, grad_entropy, n, device))[:, 0]
        g_all = grad_logp if grad_logp is not None else torch.zeros_like(lse)
        d_hidden = torch.zeros(n, H, dtype=cdt, device=device)
        d_weight = torch.zeros(V, H, dtype=cdt, device=device)  # fp32 accumulator: V*H*4 bytes
        d_bias = torch.zeros(V, dtype=cdt, device=device) if bias is not None else None
        for b0 in range(0, index_all.numel(), LINEAR_ROW_BLOCK):
            index = index_all[b0 : b0 + LINEAR_ROW_BLOCK]
            h = rows_all[index].to(cdt)
            g = g_all[index]
            he = grad_entropy[index] if grad_entropy is not None else None
            dh = torch.zeros_like(h)
            for v0 in range(0, V, LINEAR_VOCAB_BLOCK):
                z = _linear_tile(h, weight, bias, v0, cdt, tau)
                dz = _logit_grad(z, lse[index], entropy[index], g, he, labels[index] - v0, tau)
                w_tile = weight[v0 : v0 + LINEAR_VOCAB_BLOCK].to(cdt)
                dh.addmm_(dz, w_tile)
                d_weight[v0 : v0 + LINEAR_VOCAB_BLOCK].addmm_(dz.T, h)
                if d_bias is not None:
                    d_bias[v0 : v0 + LINEAR_VOCAB_BLOCK] += dz.sum(dim=0)
            d_hidden[index] = dh
        grad_hidden = d_hidden.to(hidden.dtype).reshape(hidden.shape) if ctx.needs_input_grad[0] else None
        grad_weight = d_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = d_bias.to(bias.dtype) if d_bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _linear_tile(h: Tensor, weight: Tensor, bias: Optional[Tensor], v0: int, cdt: torch.dtype, tau: float) -> Tensor:
    """Scaled logits ``(h @ W[v0:v1].T + b[v0:v1]) / tau`` of one vocabulary tile, accumulated in ``cdt``."""
    w_tile = weight[v0 : v0 + LINEAR_VOCAB_BLOCK].to(cdt)
    z = h @ w_tile.T
    if bias is not None:
        z += bias[v0 : v0 + LINEAR_VOCAB_BLOCK].to(cdt)
    return z / tau


def logits_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    inplace_backward: bool = False,
):
    """Per-token ``(logp [N], entropy [N] | None)`` in fp32 from ``logits [N, V]`` / ``[B, T, V]``."""
    logp, entropy = _LogitsLogprobs.apply(logits, labels, active, float(temperature), return_entropy, inplace_backward)
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
):
    """Per-token ``(logp [N], entropy [N] | None)`` in fp32 of ``hidden @ weight.T + bias``.

    Extra memory: ``O(N)`` plus one ``[1024, 4096]`` tile; the backward adds fp32 accumulators for
    ``dW`` (``V*H*4`` bytes), ``dH`` (``N*H*4``) and ``dbias`` (``V*4``).
    """
    logp, entropy = _LinearLogprobs.apply(hidden, weight, bias, labels, active, float(temperature), return_entropy)
    return logp, (entropy if return_entropy else None)


def make_backend() -> Backend:
    return Backend("torch", logits_logprobs, linear_logprobs)
