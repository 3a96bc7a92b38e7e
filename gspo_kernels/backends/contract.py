"""The backend contract: what a backend's stage functions take and return, written once as Protocols.

A backend (:class:`gspo_kernels.backends.Backend`) provides :class:`LogitsLogprobs` and :class:`LinearLogprobs`,
and optionally :class:`SequenceStage`, :class:`FusedLinearLoss` and :class:`FusedLogitsLoss`, as differentiable
functions (autograd Functions inside the backend) whose parameters are those of the Protocol's ``__call__``:
the same names, kinds and defaults (``tests/backends/test_backend_contract.py`` checks each registered backend against
them).

The call's options reach a backend as one frozen object, the :class:`~gspo_kernels.options.CallOptions` the
public function built and checked (a backend never validates them again). A stage reads the fields it uses:
``temperature``, ``return_entropy`` and ``softcap`` (every stage), ``inplace_backward`` (the logits path),
``memory_budget`` and ``batch_invariant`` (the hidden-state path), ``config`` (the fused losses); it ignores the others (the backend's name, the vocabulary split, the checks' switches).

``softcap``: ``None``, no cap, or a float ``c > 0``: every logit ``z`` (``hidden @ weight.T + bias`` on the
hidden-state path, the bias added first) becomes ``c * tanh(z / c)`` *before* the division by the temperature, so
the backward multiplies each logit's gradient by ``1 - tanh^2(z / c)``. The cap is not shift-invariant: a backend
must not shift the bias (or the logits) by a constant when it is set.

Labels outside ``[0, V)`` reach a backend only when the public checks are skipped (under ``torch.compile``): a
backend never reads out of bounds for them, and that row's log-prob is NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol, Tuple

import torch
from torch import Tensor

from gspo_kernels.options import DEFAULT_OPTIONS, CallOptions

if TYPE_CHECKING:
    from gspo_kernels.config import GSPOConfig
    from gspo_kernels.layout import LossInputs
    from gspo_kernels.objectives.stage import LossOutput


class LogitsLogprobs(Protocol):
    """``logits_logprobs``: per-token ``(logp, entropy)`` from the logits.

    ``logits``: ``[N, V]`` or ``[B, T, V]`` (any strides, fp16/bf16/fp32/fp64), ``labels``: ``[N]`` int64 already
    in ``[0, V)``; ``active``: ``[N]`` bool or None, rows that may be skipped in the forward (their outputs are 0)
    when False. Returns ``(logp [N] fp32, entropy [N] fp32 or None)``. The backward receives ``grad_logp`` /
    ``grad_entropy`` (``[N]`` each, possibly None) and does no work for rows where both are zero; their logits
    gradient is exactly 0. With ``options.inplace_backward`` the gradient is written into the logits' own storage.
    """

    def __call__(self, logits: Tensor, labels: Tensor, active: Optional[Tensor] = None,
                 options: CallOptions = DEFAULT_OPTIONS) -> Tuple[Tensor, Optional[Tensor]]: ...


class LinearLogprobs(Protocol):
    """``linear_logprobs``: per-token ``(logp, entropy)`` of ``hidden @ weight.T + bias`` (the hidden-state path).

    ``hidden``: ``[N, H]`` or ``[B, T, H]``, ``weight``: ``[V, H]``, ``bias``: ``[V]`` or None; the outputs and the
    skipping rule of :class:`LogitsLogprobs`, gradients for hidden, weight and bias. ``options.memory_budget``:
    bytes the backend may use for logits saved between forward and backward and for its chunk buffers (None:
    :data:`gspo_kernels.backends.DEFAULT_MEMORY_BUDGET`, the one default of every backend that uses it); it is
    validated by the public functions (:func:`gspo_kernels.checks.check_memory_budget`), never again in a
    backend, and never changes the results' meaning. ``options.batch_invariant``: a row's results are the same
    bits whatever the rest of the batch; a backend that cannot promise it raises. ``leaves``: the caller's
    ``(hidden, weight, bias)`` that the precision policy cast into the operands (None: the operands are the
    caller's tensors); a backend may return the gradients to them directly, in their dtypes (the Triton backend's
    vendor path does: no cast of an fp32 ``dW`` to the operand dtype and back), or leave them to reach them through
    the casts (the torch and cpu backends, and Triton's batch-invariant path); the results are the same.
    """

    def __call__(self, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                 active: Optional[Tensor] = None, options: CallOptions = DEFAULT_OPTIONS, *,
                 leaves: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]] = None
                 ) -> Tuple[Tensor, Optional[Tensor]]: ...


class SequenceStage(Protocol):
    """``sequence_stage`` (optional): a replacement for :func:`gspo_kernels.objectives.stage.gspo_objective` (the
    PyTorch sequence stage), with its signature.

    ``logp``, ``entropy``: ``[N]``; ``entropy`` may be None only when ``config.entropy_coef == 0``. Returns the
    ``LossOutput`` (the loss and its metrics).
    """

    def __call__(self, logp: Tensor, entropy: Optional[Tensor], inputs: LossInputs,
                 config: GSPOConfig) -> LossOutput: ...


class FusedLinearLoss(Protocol):
    """``fused_linear_loss`` (optional): the whole loss of the hidden-state path in one call.

    Its gradient is formed during the forward (the one-pass form of :func:`gspo_kernels.fused_linear_gspo_loss`);
    returns a ``LossOutput``, or None when it cannot run this input (the pipeline then runs ``linear_logprobs`` and
    the sequence stage). ``sequence_stage``: the backend's sequence stage; ``options.config``: the loss's config (never
    None here). ``leaves``: the caller's tensors that the precision policy cast into the operands (the gradients
    go to them, in their dtypes); ``inputs.logprobs_out`` (``[N]``, when the caller gave one) receives the
    detached per-token log-probs, 0 where the mask is 0.
    """

    def __call__(self, sequence_stage: Callable, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                 inputs: LossInputs, options: CallOptions, *,
                 leaves: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]] = None) -> Optional[LossOutput]: ...


class FusedLogitsLoss(Protocol):
    """``fused_logits_loss`` (optional): the whole loss of the logits path with the backend's own ``sequence_stage``.

    One differentiable call (the log-probs and the sequence stage in one autograd node, no per-token gradient
    tensors between them); returns a ``LossOutput`` equal to ``sequence_stage(*logits_logprobs(...), inputs, config)``
    with ``config = options.config`` (never None here).
    """

    def __call__(self, logits: Tensor, inputs: LossInputs, options: CallOptions) -> LossOutput: ...


DEFAULT_MEMORY_BUDGET = 1 << 30
"""Bytes a hidden-state stage may use for saved logits and chunk buffers when ``options.memory_budget`` is None."""


class Backend:
    """A named set of stage implementations, each of the contract's Protocol (:mod:`.contract`)."""

    def __init__(
        self,
        name: str,
        logits_logprobs: LogitsLogprobs,
        linear_logprobs: LinearLogprobs,
        sequence_stage: Optional[SequenceStage] = None,
        supports: Optional[Callable[[torch.device], bool]] = None,
        fused_linear_loss: Optional[FusedLinearLoss] = None,
        fused_logits_loss: Optional[FusedLogitsLoss] = None,
    ) -> None:
        self.name = name
        self.logits_logprobs: LogitsLogprobs = logits_logprobs
        self.linear_logprobs: LinearLogprobs = linear_logprobs
        self.sequence_stage: Optional[SequenceStage] = sequence_stage
        self.fused_linear_loss: Optional[FusedLinearLoss] = fused_linear_loss
        self.fused_logits_loss: Optional[FusedLogitsLoss] = fused_logits_loss
        self._supports = supports

    def supports(self, device: torch.device) -> bool:
        return True if self._supports is None else bool(self._supports(device))

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"



ENTRIES = {
    "logits_logprobs": LogitsLogprobs,
    "linear_logprobs": LinearLogprobs,
    "sequence_stage": SequenceStage,
    "fused_linear_loss": FusedLinearLoss,
    "fused_logits_loss": FusedLogitsLoss,
}
"""Each :class:`~gspo_kernels.backends.Backend` field that holds a stage function, and its Protocol."""
