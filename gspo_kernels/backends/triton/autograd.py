"""Every autograd Function of ``backend="triton"``: the logits path, the hidden-state path, the sequence stage.

* :class:`TritonLogitsLogprobs`: ``logits -> (logp, entropy)``. Saves only ``[N]`` tensors (labels, active,
  the row max and log-sum ``stats [2, N]``, entropy) plus a reference to the logits; the backward streams
  the logits once and skips the rows with zero incoming gradient. ``inplace_backward=True`` writes the
  gradient into the logits' storage (the caller's logits are consumed): no ``[N, V]`` buffer is allocated,
  also for a model's ``[B, T + 1, V]`` output passed as ``logits[:, :-1]`` (:func:`shifted_base`).
* :class:`LinearLogprobsFunction`: ``hidden @ weight.T (+ bias) -> (logp, entropy)`` without the ``[N, V]``
  logits; saves the inputs plus the row max, log-sum and entropy ``[N]``; the backward (no atomics,
  deterministic, batch-invariant) visits only the rows whose incoming gradient is non-zero, compacted on
  the device, in chunks bounded by ``memory_budget``.
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
from gspo_kernels.backends.triton.linear_forward import compact_rows, linear_logprobs_forward, shifted_bias
from gspo_kernels.backends.triton.logits_backward import logprobs_backward
from gspo_kernels.backends.triton.logits_forward import logprobs_forward
from gspo_kernels.config import GSPOConfig
from gspo_kernels.layout import LossInputs
from gspo_kernels.objective import LossOutput

METRIC_NAMES = (
    ("clip_ratio/low_mean", sequence.O_LOW),
    ("clip_ratio/high_mean", sequence.O_HIGH),
    ("clip_ratio/region_mean", sequence.O_REGION),
    ("importance_weight/mean", sequence.O_W_MEAN),
    ("importance_weight/min", sequence.O_W_MIN),
    ("importance_weight/max", sequence.O_W_MAX),
)


def shifted_base(logits: Tensor) -> Optional[Tensor]:
    """The ``[B, T + 1, V]`` tensor ``base`` when ``logits`` is exactly ``base[:, :-1]`` in autograd's eyes.

    True when ``logits`` requires grad, is a 3-D view of a 3-D ``base`` with the same strides and start, and
    was produced from ``base`` by one slice (its ``grad_fn`` is a ``SliceBackward0`` whose input is
    ``base``'s own node). The logits Function then takes ``base`` as its input and writes the gradient for all
    ``T + 1`` positions (zeros at the last), so autograd's ``slice_backward`` does not allocate a second
    ``[B, T + 1, V]`` buffer. Returns None in every other case (the view is then used as it is).
    """
    base = getattr(logits, "_base", None)
    if base is None or not logits.requires_grad or logits.dim() != 3 or base.dim() != 3:
        return None
    if tuple(base.shape) != (logits.shape[0], logits.shape[1] + 1, logits.shape[2]):
        return None
    if base.stride() != logits.stride() or base.storage_offset() != logits.storage_offset():
        return None
    node = logits.grad_fn
    if node is None or type(node).__name__ != "SliceBackward0" or not node.next_functions:
        return None
    parent = node.next_functions[0][0]
    if base.grad_fn is not None:
        return base if parent is base.grad_fn else None
    return base if getattr(parent, "variable", None) is base else None


class TritonLogitsLogprobs(torch.autograd.Function):
    """``(logits [N, V] | [B, T, V], labels [N]) -> (logp [N], entropy [N])``, fp32 (fp64 for fp64 logits).

    With ``shifted=True`` the first input is the ``[B, T + 1, V]`` base of ``logits[:, :-1]`` (see
    :func:`shifted_base`): the kernels read its first ``T`` positions and the gradient covers all ``T + 1``.
    """

    @staticmethod
    def forward(ctx, logits, labels, active, temperature, return_entropy, inplace_backward, shifted=False):
        labels = labels.reshape(-1)
        if labels.dtype != torch.int64:
            labels = labels.to(torch.int64)
        active = None if active is None else active.reshape(-1).to(torch.bool).contiguous()
        rows = logits.detach()[:, :-1] if shifted else logits.detach()
        logp, entropy, stats = logprobs_forward(
            rows, labels, active=active, temperature=temperature, return_entropy=return_entropy
        )
        if entropy is None:
            entropy = torch.zeros_like(logp)
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, labels, stats, entropy, active if active is not None else torch.empty(0))
        ctx.has_active = active is not None
        ctx.has_entropy = return_entropy
        ctx.temperature = temperature
        ctx.inplace = inplace_backward
        ctx.shifted = shifted
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, stats, entropy, active = ctx.saved_tensors
        if not ctx.has_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        full = logits.detach()
        rows = full[:, :-1] if ctx.shifted else full
        if ctx.inplace:
            out = full
        elif ctx.shifted:
            out = torch.empty(full.shape, device=full.device, dtype=full.dtype)
        else:
            out = None
        dlogits = logprobs_backward(
            rows,
            labels,
            stats,
            entropy if grad_entropy is not None else None,
            None if grad_logp is None else grad_logp.to(stats.dtype).contiguous(),
            None if grad_entropy is None else grad_entropy.to(stats.dtype).contiguous(),
            active=active if ctx.has_active else None,
            temperature=ctx.temperature,
            out=out,
        )
        return dlogits, None, None, None, None, None, None


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
        logits: ``[N, V]`` or ``[B, T, V]`` fp16/bf16/fp32/fp64, any strides. A ``model_output[:, :-1]`` view
            is recognised (:func:`shifted_base`): its gradient goes straight to ``model_output``, with zeros at
            the last position, and no second logits-sized buffer is allocated (none at all with
            ``inplace_backward``).
        labels: ``[N]`` int64 in ``[0, V)`` (out of range: never read, NaN log-prob); active: ``[N]`` bool or
            None (False rows are not read, output 0).
    Returns:
        ``(logp [N], entropy [N] or None)`` in fp32 (fp64 for fp64 logits, like the torch backend),
        differentiable with respect to ``logits``.
    """
    base = shifted_base(logits) if torch.is_grad_enabled() else None
    logp, entropy = TritonLogitsLogprobs.apply(
        logits if base is None else base, labels, active, float(temperature), bool(return_entropy),
        bool(inplace_backward), base is not None,
    )
    return logp, (entropy if return_entropy else None)


class TritonSequenceObjective(torch.autograd.Function):
    """``(logp [N], entropy [N] | None) -> (loss 0-dim, out [NUM_OUTPUTS])``; ``out`` holds the metrics."""

    @staticmethod
    def forward(ctx, logp, entropy, inputs: LossInputs, config: GSPOConfig):
        batch = inputs.batch
        coef, out = sequence.sequence_stage(
            logp.detach(), None if entropy is None else entropy.detach(), inputs, config
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
    """The dtype both ``tl.dot`` operands take: the lower-precision one of ``hidden`` / ``weight``.

    Equal dtypes: that dtype (fp64 runs in fp32). Different dtypes: the half-precision one (bf16 when both
    are half but differ), never an fp32 promotion of a bf16 operand (which would lose the tensor cores).
    """
    halves = [t.dtype for t in (hidden, weight) if t.dtype in (torch.float16, torch.bfloat16)]
    if halves:
        return halves[0] if all(d == halves[0] for d in halves) else torch.bfloat16
    return torch.float32


def _as_operands(hidden: Tensor, weight: Tensor) -> Tuple[Tensor, Tensor]:
    dtype = _operand_dtype(hidden, weight)
    h = hidden if hidden.dtype == dtype else hidden.to(dtype)
    w = weight if weight.dtype == dtype else weight.to(dtype)
    return h, (w if w.stride(-1) == 1 else w.contiguous())


class LinearLogprobsFunction(torch.autograd.Function):
    """``(hidden, weight, bias, labels, active, temperature, memory_budget) -> (logp, entropy)``.

    Saves the caller's ``hidden``, ``weight``, ``bias`` (no copies: operands of another dtype are cast
    again in the backward) and five ``[N]`` tensors. No host synchronisation in either direction (the
    active rows are compacted on the device), so the Function can be captured in a CUDA graph.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        labels: Tensor,
        active: Optional[Tensor],
        temperature: float,
        memory_budget: Optional[int],
    ) -> Tuple[Tensor, Tensor]:
        h, w = _as_operands(hidden.detach(), weight.detach())
        b = shifted_bias(None if bias is None else bias.detach())
        labels = labels.reshape(-1).to(torch.int64)
        if active is None:
            order = count = None
            computed = torch.ones(labels.shape[0], device=hidden.device, dtype=torch.bool)
        else:
            computed = active.reshape(-1).to(torch.bool)
            order, count = compact_rows(computed)
        logp, entropy, row_max, log_sum = linear_logprobs_forward(
            h, w, b, labels, temperature, order=order, count=count
        )
        ctx.save_for_backward(hidden, weight, bias, labels, computed, row_max, log_sum, entropy)
        ctx.temperature = temperature
        ctx.memory_budget = memory_budget
        ctx.set_materialize_grads(False)
        out_dtype = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
        return logp.to(out_dtype), entropy.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor]):
        hidden, weight, bias, labels, computed, row_max, log_sum, entropy = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        carries = torch.zeros_like(computed)
        if grad_logp is not None:
            grad_logp = grad_logp.reshape(-1).to(torch.float32).contiguous()
            carries |= grad_logp != 0
        if grad_entropy is not None:
            grad_entropy = grad_entropy.reshape(-1).to(torch.float32).contiguous()
            carries |= grad_entropy != 0
        order, count = compact_rows(carries & computed)
        h, w = _as_operands(hidden.detach(), weight.detach())
        dh, dw, db = linear_logprobs_backward(
            h, w, shifted_bias(None if bias is None else bias.detach()), labels, row_max, log_sum, entropy,
            grad_logp, grad_entropy, order, count, ctx.temperature,
            compute_dh=need_dh, compute_dw=need_dw, compute_db=need_db, memory_budget=ctx.memory_budget,
        )
        dh = dh.reshape(hidden.shape).to(hidden.dtype) if dh is not None else None
        dw = dw.to(weight.dtype) if dw is not None else None
        db = db.to(bias.dtype) if db is not None else None
        return dh, dw, db, None, None, None, None


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
) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-token log-probs (and entropy) of ``labels`` under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` (any strides), fp16/bf16/fp32/fp64.
        weight: ``[V, H]``. When the dtypes of ``hidden`` and ``weight`` differ, the half-precision one is
            the operand dtype of both; fp64 operands are computed in fp32. bias: ``[V]`` (any stride) or None.
        labels: ``[N]`` (or ``[B, T]``) int64. Values outside ``[0, V)`` are never used as addresses:
            such a row's log-prob (and gradient) is NaN.
        active: ``[N]`` bool or None; rows where False are not computed (their outputs are 0).
        temperature: logits are divided by it.
        return_entropy: also return the entropy of each row's distribution.
        memory_budget: bytes for the backward's chunk buffers (None: 1 GiB; at least one row tile is
            always used). It changes the speed and the memory, never the bits of any output.

    Returns:
        ``(logp [N], entropy [N] or None)``: fp32 (fp64, computed in fp32, for fp64 inputs),
        differentiable w.r.t. hidden, weight and bias. The backward is deterministic (no atomics) and
        batch-invariant (a row's results do not depend on the other rows); see ``linear_backward.py``.
    """
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
                                      or memory_budget < 0):
        raise ValueError(f"memory_budget must be None or a number of bytes >= 0, got {memory_budget!r}")
    logp, entropy = LinearLogprobsFunction.apply(
        hidden, weight, bias, labels, active, float(temperature), memory_budget
    )
    return logp, (entropy if return_entropy else None)
