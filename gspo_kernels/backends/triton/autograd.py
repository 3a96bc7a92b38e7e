"""Every autograd Function of ``backend="triton"``: the logits path, the hidden-state path, the sequence stage.

* :class:`TritonLogitsLogprobs`: ``logits -> (logp, entropy)``. Saves only ``[N]`` tensors (labels, active,
  logsumexp, entropy) plus a reference to the logits; the backward streams the logits once and skips
  the rows with zero incoming gradient. ``inplace_backward=True`` writes the gradient into the logits'
  storage (the caller's logits are consumed): no ``[N, V]`` buffer is allocated.
* :class:`LinearLogprobsFunction`: ``hidden @ weight.T (+ bias) -> (logp, entropy)`` without the ``[N, V]``
  logits; saves the inputs plus ``lse [N]`` and ``entropy [N]``; the backward visits only the rows whose
  incoming gradient is non-zero.
* :class:`TritonSequenceObjective`: ``(logp, entropy) -> loss`` via the two kernels of ``sequence.py``;
  saves the per-token coefficients ``[N]``, so its backward is two ``[N]`` multiplications.

Peak extra memory of ``gspo_loss`` beyond the logits (and their gradient when not in place): ``O(N)``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.backends.triton import sequence
from gspo_kernels.backends.triton.linear_backward import linear_logprobs_backward
from gspo_kernels.backends.triton.linear_forward import linear_logprobs_forward
from gspo_kernels.backends.triton.logits_backward import logprobs_backward
from gspo_kernels.backends.triton.logits_forward import logprobs_forward
from gspo_kernels.config import GSPOConfig
from gspo_kernels.objective import LossOutput
from gspo_kernels.validation import LossInputs

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
    """The backend contract's ``logits_logprobs`` (see ``gspo_kernels/backends/__init__.py``).

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
    memory_budget: Optional[int] = None,  # backend contract; not used by this backend yet
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
