"""Autograd Functions of the Triton logits path: the per-token stage and the fused sequence stage.

* :class:`TritonLogitsLogprobs`: ``logits -> (logp, entropy)``. Saves only ``[N]`` tensors (labels, active,
  logsumexp, entropy) plus a reference to the logits; the backward streams the logits once and skips
  the rows with zero incoming gradient. ``inplace_backward=True`` writes the gradient into the logits'
  storage (the caller's logits are consumed): no ``[N, V]`` buffer is allocated.
* :class:`TritonSequenceObjective`: ``(logp, entropy) -> loss`` via the two kernels of ``sequence.py``;
  saves the per-token coefficients ``[N]``, so its backward is two ``[N]`` multiplications.

Peak extra memory of ``gspo_loss`` beyond the logits (and their gradient when not in place): ``O(N)``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.config import GSPOConfig
from gspo_kernels.layout import LossInputs
from gspo_kernels.objective import LossOutput
from gspo_kernels.triton import sequence
from gspo_kernels.triton.logprobs import logprobs_forward
from gspo_kernels.triton.logprobs_backward import logprobs_backward

METRIC_NAMES = (
    ("clip_ratio/low_mean", sequence.O_LOW),
    ("clip_ratio/high_mean", sequence.O_HIGH),
    ("clip_ratio/region_mean", sequence.O_REGION),
    ("importance_weight/mean", sequence.O_W_MEAN),
    ("importance_weight/min", sequence.O_W_MIN),
    ("importance_weight/max", sequence.O_W_MAX),
)


class TritonLogitsLogprobs(torch.autograd.Function):
    """``(logits [N, V] | [B, T, V], labels [N]) -> (logp [N], entropy [N])``, fp32 (fp64 for fp64 logits)."""

    @staticmethod
    def forward(ctx, logits, labels, active, temperature, return_entropy, inplace_backward):
        labels = labels.reshape(-1)
        if labels.dtype != torch.int64:
            labels = labels.to(torch.int64)
        active = None if active is None else active.reshape(-1).to(torch.bool).contiguous()
        logp, entropy, lse = logprobs_forward(
            logits.detach(), labels, active=active, temperature=temperature, return_entropy=return_entropy
        )
        if entropy is None:
            entropy = torch.zeros_like(logp)
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, labels, lse, entropy, active if active is not None else torch.empty(0))
        ctx.has_active = active is not None
        ctx.has_entropy = return_entropy
        ctx.temperature = temperature
        ctx.inplace = inplace_backward
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, lse, entropy, active = ctx.saved_tensors
        if not ctx.has_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        dlogits = logprobs_backward(
            logits.detach(),
            labels,
            lse,
            entropy if grad_entropy is not None else None,
            None if grad_logp is None else grad_logp.to(lse.dtype).contiguous(),
            None if grad_entropy is None else grad_entropy.to(lse.dtype).contiguous(),
            active=active if ctx.has_active else None,
            temperature=ctx.temperature,
            inplace=ctx.inplace,
        )
        return dlogits, None, None, None, None, None


def logits_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    inplace_backward: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The backend contract's ``logits_logprobs`` (see ``gspo_kernels/backends.py``).

    Args:
        logits: ``[N, V]`` or ``[B, T, V]`` fp16/bf16/fp32/fp64, any strides.
        labels: ``[N]`` int64 in ``[0, V)``; active: ``[N]`` bool or None (False rows are not read, output 0).
    Returns:
        ``(logp [N], entropy [N] or None)`` in fp32 (fp64 for fp64 logits, like the torch backend),
        differentiable with respect to ``logits``.
    """
    logp, entropy = TritonLogitsLogprobs.apply(
        logits, labels, active, float(temperature), bool(return_entropy), bool(inplace_backward)
    )
    return logp, (entropy if return_entropy else None)


class TritonSequenceObjective(torch.autograd.Function):
    """``(logp [N], entropy [N] | None) -> (loss 0-dim, out [NUM_OUTPUTS])``; ``out`` holds the metrics."""

    @staticmethod
    def forward(ctx, logp, entropy, inputs: LossInputs, config: GSPOConfig):
        batch = inputs.batch
        coef, out = sequence.sequence_stage(
            logp.detach(),
            None if entropy is None else entropy.detach(),
            batch.mask,
            batch.cu_seqlens,
            inputs.advantages,
            advantages_per_token=inputs.advantages_per_token,
            old_logprobs=inputs.old_logprobs,
            ref_logprobs=inputs.ref_logprobs,
            is_ratio=inputs.is_ratio,
            num_items_in_batch=inputs.num_items_in_batch,
            importance_sampling_level=config.importance_sampling_level,
            loss_type=config.loss_type,
            epsilon_low=config.epsilon_low,
            epsilon_high=config.epsilon_high,
            delta=config.delta,
            beta=config.beta,
            use_bias_correction_kl=config.use_bias_correction_kl,
            max_completion_length=config.max_completion_length,
            entropy_coef=config.entropy_coef,
        )
        ctx.save_for_backward(coef, out, batch.mask)
        ctx.logp_dtype = logp.dtype
        ctx.entropy_dtype = None if entropy is None else entropy.dtype
        ctx.entropy_coef = config.entropy_coef
        ctx.mark_non_differentiable(out)
        ctx.set_materialize_grads(False)
        return out[sequence.O_LOSS].clone(), out

    @staticmethod
    def backward(ctx, grad_loss, _grad_out):
        coef, out, mask = ctx.saved_tensors
        if grad_loss is None:
            return None, None, None, None
        grad_loss = grad_loss.to(torch.float32)
        grad_logp = None
        grad_entropy = None
        if ctx.needs_input_grad[0]:
            grad_logp = (coef * (grad_loss * out[sequence.O_SCALE_LOGP])).to(ctx.logp_dtype)
        if ctx.needs_input_grad[1] and ctx.entropy_coef != 0:
            grad_entropy = (mask * (grad_loss * out[sequence.O_SCALE_ENTROPY])).to(ctx.entropy_dtype)
        return grad_logp, grad_entropy, None, None


def gspo_objective(logp: Tensor, entropy: Optional[Tensor], inputs: LossInputs, config: GSPOConfig) -> LossOutput:
    """Drop-in for :func:`gspo_kernels.objective.gspo_objective`, computed by the fused Triton kernels.

    ``logp``, ``entropy``: ``[N]`` (fp32). ``entropy`` may be None only when ``config.entropy_coef == 0``
    (the ``entropy`` metric is then omitted). Metrics are detached 0-dim fp32 tensors.
    """
    if entropy is None and config.entropy_coef != 0:
        raise ValueError("entropy is required when config.entropy_coef != 0")
    loss, out = TritonSequenceObjective.apply(logp, entropy, inputs, config)
    metrics = {name: out[index] for name, index in METRIC_NAMES}
    if entropy is not None:
        metrics["entropy"] = out[sequence.O_ENTROPY]
    if config.beta > 0:
        metrics["kl"] = out[sequence.O_KL]
    return LossOutput(loss.to(logp.dtype), metrics)
