"""Autograd Function of the Triton hidden-state path: ``hidden @ weight.T (+ bias)`` -> log-probs, entropy.

Composes the forward op (:mod:`gspo_kernels.triton.linear_logprobs`) and the backward op
(:mod:`gspo_kernels.triton.linear_logprobs_backward`) into the backend contract of
:mod:`gspo_kernels.backends` (``linear_logprobs``). The ``[N, V]`` logits never exist.

Saved for backward: the inputs plus ``lse [N]`` and ``entropy [N]`` fp32 (``O(N)``). The backward
first compacts the rows whose ``grad_logp`` or ``grad_entropy`` is non-zero; the others get exactly
zero ``dH`` and cost nothing. fp64 inputs are computed in fp32 (log-probs are fp32 by contract).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.triton.linear_logprobs import linear_logprobs_forward
from gspo_kernels.triton.linear_logprobs_backward import linear_logprobs_backward


def _operand_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    return torch.float32 if dtype == torch.float64 else dtype


class LinearLogprobsFunction(torch.autograd.Function):
    """``(hidden, weight, bias, labels, active, temperature, deterministic, filter_eps) -> (logp, entropy)``."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        labels: Tensor,
        active: Optional[Tensor],
        temperature: float,
        deterministic: bool,
        filter_eps: Optional[float],
    ) -> Tuple[Tensor, Tensor]:
        dtype = _operand_dtype(hidden, weight)
        h = hidden if hidden.dtype == dtype else hidden.to(dtype)
        w = weight if weight.dtype == dtype else weight.to(dtype)
        b = None if bias is None else (bias if bias.dtype == dtype else bias.to(dtype))
        if w.stride(-1) != 1:
            w = w.contiguous()
        N = labels.numel()
        device = hidden.device
        labels = labels.reshape(-1).to(torch.int64)
        if active is None:
            rows = torch.arange(N, device=device, dtype=torch.int64)
        else:
            rows = torch.nonzero(active.reshape(-1)).reshape(-1)
        logp_c, ent_c, lse_c = linear_logprobs_forward(h, w, b, rows, labels[rows].contiguous(), temperature)
        logp = torch.zeros(N, device=device, dtype=torch.float32)
        entropy = torch.zeros(N, device=device, dtype=torch.float32)
        lse = torch.zeros(N, device=device, dtype=torch.float32)
        logp[rows] = logp_c
        entropy[rows] = ent_c
        lse[rows] = lse_c
        computed = torch.zeros(N, device=device, dtype=torch.bool)
        computed[rows] = True
        ctx.save_for_backward(h, w, b, labels, computed, lse, entropy)
        ctx.temperature = temperature
        ctx.deterministic = deterministic
        ctx.filter_eps = filter_eps
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.hidden_shape = hidden.shape
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor]):
        h, w, b, labels, computed, lse, entropy = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        nonzero = torch.zeros_like(computed)
        if grad_logp is not None:
            grad_logp = grad_logp.reshape(-1).to(torch.float32)
            nonzero |= grad_logp != 0
        if grad_entropy is not None:
            grad_entropy = grad_entropy.reshape(-1).to(torch.float32)
            if bool((grad_entropy != 0).any()):
                nonzero |= grad_entropy != 0
            else:
                grad_entropy = None
        rows = torch.nonzero(nonzero & computed).reshape(-1)
        g_logp = grad_logp[rows].contiguous() if grad_logp is not None else torch.zeros(rows.shape[0], device=h.device)
        g_ent = grad_entropy[rows].contiguous() if grad_entropy is not None else None
        dh_c, dw, db = linear_logprobs_backward(
            h, w, b, rows, labels[rows].contiguous(), lse[rows].contiguous(), entropy[rows].contiguous(),
            g_logp, g_ent, ctx.temperature,
            compute_dh=need_dh, compute_dw=need_dw, compute_db=need_db,
            deterministic=ctx.deterministic, filter_eps=ctx.filter_eps,
        )
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        dh = None
        if need_dh:
            dh = torch.zeros(ctx.hidden_shape, device=h.device, dtype=hidden_dtype)
            dh.view(-1, dh.shape[-1]).index_copy_(0, rows, dh_c.to(hidden_dtype))
        dw = dw.to(weight_dtype) if dw is not None else None
        db = db.to(bias_dtype) if db is not None else None
        return dh, dw, db, None, None, None, None, None


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    labels: Tensor,
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    deterministic: Optional[bool] = None,
    filter_eps: Optional[float] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-token log-probs (and entropy) of ``labels`` under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` (any strides), fp16/bf16/fp32 (fp64 is computed in fp32).
        weight: ``[V, H]``. bias: ``[V]`` or None.
        labels: ``[N]`` (or ``[B, T]``) int64 in ``[0, V)``.
        active: ``[N]`` bool or None; rows where False are not computed (their outputs are 0).
        temperature: logits are divided by it.
        return_entropy: also return the entropy of each row's distribution.
        deterministic: atomic-free backward with a fixed summation order (default:
            ``torch.are_deterministic_algorithms_enabled()``).
        filter_eps: backward gradient filtering threshold (None, the default: exact).

    Returns:
        ``(logp [N] fp32, entropy [N] fp32 or None)``, differentiable w.r.t. hidden, weight and bias.
    """
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    logp, entropy = LinearLogprobsFunction.apply(
        hidden, weight, bias, labels, active, float(temperature), bool(deterministic), filter_eps
    )
    return logp, (entropy if return_entropy else None)
