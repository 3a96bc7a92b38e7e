"""The logits path's whole loss in one autograd node (the backend's ``fused_logits_loss``): ``logits ->
LossOutput(loss, metrics)``, the forward kernel of :mod:`.logits`, the sequence stage of :mod:`.sequence`, and
one backward kernel for both (:class:`TritonLogitsLoss`). No kernel of its own."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from gspo_kernels.backends.tiling import next_token_base
from gspo_kernels.backends.triton.logits import gradient_rows, logits_logprobs, logprobs_backward, logprobs_forward
from gspo_kernels.backends.triton.sequence import (
    O_SCALE_ENTROPY,
    O_SCALE_LOGP,
    _sequence_stage,
    fused_objective,
    has_kernels,
    metric_slots,
)
from gspo_kernels.objectives.stage import LossOutput
from gspo_kernels.options import CallOptions


class TritonLogitsLoss(torch.autograd.Function):
    """``logits [N, V] | [B, T, V] -> (loss 0-dim, out [NUM_OUTPUTS])``: :class:`.logits.TritonLogitsLogprobs` and the
    sequence stage (:class:`~gspo_kernels.backends.triton.sequence.TritonSequenceObjective`) as one autograd node.

    The same launches and the same bits as the two nodes: the forward kernel, then the sequence stage's two; the
    backward is the one backward kernel, which forms ``dL/dlogp = coef * (grad_loss * out[O_SCALE_LOGP])`` and
    ``dL/dH = mask * (grad_loss * out[O_SCALE_ENTROPY])`` per row itself (``grad_scale``). What it saves per
    call: a node of the graph (a Python backward the engine calls), the two elementwise products and the
    ``[N]`` gradients between the nodes. ``extra_position`` as in :class:`.logits.TritonLogitsLogprobs`.
    """

    @staticmethod
    def forward(ctx, logits, inputs, options: CallOptions, extra_position):
        # the call's options (checked as they were built), kept whole for the backward: config, temperature,
        # inplace_backward and softcap read (the temperature is the options', the one copy: see CallOptions)
        config = options.config
        # The rows that count: the layout's bool flags (the forward kernel the two-node path launches), else the
        # 0/1 fp32 mask (the kernels test ``!= 0`` either way).
        active = _flat_bool(inputs.batch.counted)
        active = inputs.batch.mask if active is None else active
        rows = logits[:, :-1] if extra_position else logits
        logp, entropy, row_stats = logprobs_forward(rows, inputs.labels, active=active,
                                                    temperature=options.temperature, softcap=options.softcap)
        coef, out, loss = _sequence_stage(logp, entropy, inputs, config)
        ctx.save_for_backward(logits, inputs.labels, row_stats, entropy, active, inputs.batch.mask, coef, out)
        ctx.options = options
        ctx.extra_position = extra_position
        ctx.mark_non_differentiable(out)
        ctx.set_materialize_grads(False)
        return loss.to(logp.dtype), out

    @staticmethod
    def backward(ctx, grad_loss, _grad_out):
        if grad_loss is None:
            return None, None, None, None
        logits, labels, row_stats, entropy, active, mask, coef, out = ctx.saved_tensors
        options = ctx.options
        rows, dst = gradient_rows(logits, options.inplace_backward, ctx.extra_position)
        with_entropy = options.config.entropy_coef != 0
        dlogits = logprobs_backward(
            rows,
            labels,
            row_stats,
            entropy if with_entropy else None,
            coef,
            mask if with_entropy else None,
            active=active,
            temperature=options.temperature,
            out=dst,
            softcap=options.softcap,
            grad_scale=(grad_loss.to(torch.float32), out[O_SCALE_LOGP.value], out[O_SCALE_ENTROPY.value]),
        )
        return dlogits, None, None, None


def _flat_bool(flags: Optional[Tensor]) -> Optional[Tensor]:
    """``flags`` when it is a flat, contiguous bool tensor (what a kernel may index as ``[N]``), else None."""
    if flags is not None and flags.dtype == torch.bool and flags.dim() == 1 and flags.is_contiguous():
        return flags
    return None


def fused_logits_loss(logits: Tensor, inputs, options: CallOptions):
    """The backend contract's ``fused_logits_loss``: :func:`.logits.logits_logprobs` then the backend's objective
    (:func:`gspo_kernels.backends.triton.sequence.fused_objective`) in one autograd node (:class:`TritonLogitsLoss`).

    Args:
        logits: ``[N, V]`` or ``[B, T, V]``, any float dtype and strides (a ``model_output[:, :-1]`` view is
            routed to its base, as in :func:`.logits.logits_logprobs`).
        inputs: the validated :class:`~gspo_kernels.layout.LossInputs` (labels in ``[0, V)``, the token mask).
        options: the call's :class:`~gspo_kernels.options.CallOptions`; read: ``config`` (the loss's options),
            ``temperature`` (divides the logits: the config's, copied into the options), ``inplace_backward`` and
            ``softcap``: None or ``c > 0`` (the config's ``final_logit_softcapping``, copied likewise).
    Returns:
        ``LossOutput(loss, metrics)``, what the two stages return one after the other (and, for an objective the
        sequence kernels do not compute, :func:`~gspo_kernels.backends.triton.sequence.has_kernels`, the two stages
        themselves: the log-probs, then PyTorch's sequence stage).
    """
    config = options.config
    if not has_kernels(config):
        active = _flat_bool(inputs.batch.counted)
        logp, entropy = logits_logprobs(logits, inputs.labels, inputs.batch.mask != 0 if active is None else active,
                                        options)
        return fused_objective(logp, entropy, inputs, config)
    base = next_token_base(logits) if torch.is_grad_enabled() else None
    loss, out = TritonLogitsLoss.apply(logits if base is None else base, inputs, options, base is not None)
    # fused_objective's metrics, read from the same ``out`` slots
    slots = metric_slots(config, inputs.rollout_logprobs is not None, True)
    return LossOutput(loss, {name: out[index] for name, index in slots})
