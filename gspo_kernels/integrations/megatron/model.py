"""``enable(model)``: a Megatron-core ``GPTModel`` called with ``labels`` computes its loss through the library.

Megatron's ``GPTModel.forward`` ends in ``_postprocess``: ``logits, _ = self.output_layer(hidden, weight=...)`` then,
with labels, ``self.compute_language_model_loss(labels, logits)`` (the per-token cross entropy ``[B, S]``). The hook
sits at that seam, on the model *instance* (never megatron's classes), and re-implements nothing of the forward:

- ``forward``: when called with ``labels``, marks the call (and calls megatron's own forward);
- ``output_layer.forward``: during a marked call, returns a stand-in that holds the output layer's input instead of
  the logits (the ``[S, B, V / tp]`` logits are never formed);
- ``compute_language_model_loss``: given the stand-in, returns ``-log p(label)`` ``[B, S]`` (float32) from
  :func:`~gspo_kernels.integrations.megatron.linear_logprobs` on the model's own head (tied embeddings,
  sequence-parallel output layer and padded vocabulary as megatron has them); gradients as megatron's.

A call without labels takes megatron's path untouched (it returns the logits). :func:`capture` hands the log-probs
and entropies of the same forward to the caller (what RL losses consume). :func:`disable` removes the three
instance attributes, restoring megatron's methods.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Iterator, List, Optional, Tuple

from torch import Tensor

from gspo_kernels.integrations.megatron.head import unwrap
from gspo_kernels.integrations.megatron.logprobs import linear_logprobs

_STATE = "_gspo_kernels_megatron"


@dataclasses.dataclass(frozen=True)
class _Deferred:
    """The output layer's input, standing in for its logits until the loss reads it."""

    hidden: Tensor


@dataclasses.dataclass
class Capture:
    """The log-probs and entropies of the forwards with labels run inside :func:`capture` (one entry each, in order).

    ``logprobs`` / ``entropy``: the last forward's ``[B, S]`` float32 tensors (differentiable: a loss built on them
    backpropagates through the model).
    """

    records: List[Tuple[Tensor, Tensor]] = dataclasses.field(default_factory=list)

    @property
    def logprobs(self) -> Optional[Tensor]:
        return self.records[-1][0] if self.records else None

    @property
    def entropy(self) -> Optional[Tensor]:
        return self.records[-1][1] if self.records else None


@dataclasses.dataclass
class _State:
    options: dict
    saved: dict  # attribute name -> the instance attribute it replaced (None: there was none)
    labelled: int = 0
    capture: Optional[Capture] = None


def _gpt(model):
    gpt = unwrap(model)
    if not hasattr(gpt, "compute_language_model_loss") or not hasattr(gpt, "output_layer"):
        raise TypeError(f"model must be a megatron GPTModel (or a wrapper of one), got {type(model).__name__}")
    return gpt


def enable(model, *, temperature: float = 1.0, backend: str = "auto", fp32_head: bool = False,
           memory_budget: Optional[int] = None):
    """Route ``model``'s loss (a megatron ``GPTModel``, or a DDP / ``Float16Module`` wrapper of one) through the library.

    After it, ``model(input_ids, position_ids, attention_mask, labels=labels)`` returns megatron's per-token cross
    entropy ``[B, S]`` (float32; of ``logits / temperature``), computed without the logits, with megatron's
    gradients; without ``labels`` the model is untouched. The options are those of
    :func:`~gspo_kernels.integrations.megatron.linear_logprobs`. Calling it again replaces the options. Returns
    ``model``.
    """
    gpt = _gpt(model)
    options = dict(temperature=temperature, backend=backend, fp32_head=fp32_head, memory_budget=memory_budget)
    state = getattr(gpt, _STATE, None)
    if state is not None:
        state.options = options
        return model
    state = _State(options=options, saved={})
    layer = gpt.output_layer
    for owner, name in ((gpt, "forward"), (gpt, "compute_language_model_loss"), (layer, "forward")):
        state.saved[(id(owner), name)] = owner.__dict__.get(name)
    forward, loss, layer_forward = gpt.forward, gpt.compute_language_model_loss, layer.forward
    signature = inspect.signature(forward)

    def labelled_forward(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        if bound.arguments.get("labels") is None:
            return forward(*args, **kwargs)
        state.labelled += 1
        try:
            return forward(*args, **kwargs)
        finally:
            state.labelled -= 1

    def deferred_output(hidden, *args, **kwargs):
        if state.labelled:
            return _Deferred(hidden), None
        return layer_forward(hidden, *args, **kwargs)

    def library_loss(labels, logits):
        if not isinstance(logits, _Deferred):
            return loss(labels, logits)
        capture = state.capture
        out = linear_logprobs(logits.hidden, gpt, labels, return_entropy=capture is not None, **state.options)
        if capture is None:
            return -out
        capture.records.append(out)
        return -out[0]

    gpt.forward = labelled_forward
    gpt.compute_language_model_loss = library_loss
    layer.forward = deferred_output
    setattr(gpt, _STATE, state)
    return model


def disable(model):
    """Undo :func:`enable` (a no-op on a model it was not applied to). Returns ``model``."""
    gpt = _gpt(model)
    state = getattr(gpt, _STATE, None)
    if state is None:
        return model
    for owner, name in ((gpt, "forward"), (gpt, "compute_language_model_loss"), (gpt.output_layer, "forward")):
        previous = state.saved.get((id(owner), name))
        if previous is None:
            owner.__dict__.pop(name, None)
        else:
            owner.__dict__[name] = previous
    delattr(gpt, _STATE)
    return model


@contextlib.contextmanager
def capture(model) -> Iterator[Capture]:
    """Inside the block, each forward with labels of an :func:`enable`\\ d model also records its log-probs and
    entropies (one pass over the head gives both)::

        with megatron.capture(model) as got:
            loss = model(input_ids, position_ids, attention_mask, labels=labels)   # [B, S], = -got.logprobs
        logprobs, entropy = got.logprobs, got.entropy                               # [B, S] float32, differentiable
    """
    gpt = _gpt(model)
    state = getattr(gpt, _STATE, None)
    if state is None:
        raise ValueError("model: capture needs a model prepared with gspo_kernels.integrations.megatron.enable(model)")
    previous, state.capture = state.capture, Capture()
    try:
        yield state.capture
    finally:
        state.capture = previous
