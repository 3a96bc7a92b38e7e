"""The Triton backend's operations as ``torch.library`` operators: what ``torch.compile`` traces in their place.

Dynamo cannot run a Triton launch on fake tensors, nor the launchers' host-side Python (tile sizes from strides,
chunk loops, row plans). Under tracing (``torch.compiler.is_compiling()``) each public function of the backend
therefore calls its operator: an opaque node of the graph whose fake (meta) implementation gives the outputs'
shapes and dtypes, and whose backward is registered (``torch.library.register_autograd``) as another operator.
The operators call the same launchers as the eager autograd Functions: the same kernels, the same bits. Eager
calls keep the autograd Functions (no dispatcher hop per call, and their in-place / ``model_output[:, :-1]``
gradient routes, which an operator's functional schema cannot express).

Operators (namespace ``gspo_triton``), each with its fake implementation and autograd formula below:

* ``logits_fwd(logits, labels, active, temperature, return_entropy, softcap) -> (logp, entropy, row_stats)``
  and ``logits_bwd``: :mod:`.logits` (the logits path);
* ``linear_fwd(hidden [N, H], weight, bias, labels, active, temperature, memory_budget, softcap, grad)
  -> (logp, entropy, row_stats)`` and ``linear_bwd``: :mod:`.linear` (the hidden-state path on vendor GEMMs);
* ``invariant_linear_fwd(hidden [N, H] | [B, T, H], weight, bias, labels, active, temperature, memory_budget,
  softcap) -> (logp, entropy, row_stats)`` and ``invariant_linear_bwd``: :mod:`.linear_invariant` (the hidden-state
  path on the batch-invariant Triton GEMMs, ``batch_invariant=True``; each builds its launch's plan, the row
  compaction and :class:`.linear_invariant.BackwardInputs`, from its arguments).

The composite losses (:mod:`.logits_loss`, :mod:`.linear_loss`) take their two-stage form under tracing (these
operators, then the sequence stage); the sequence stage is PyTorch's there (:func:`traced_sequence_stage`).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.backends.triton import configs, linear, linear_invariant, linear_loss, logits_loss, sequence
from gspo_kernels.backends.triton import logits as logits_path
from gspo_kernels.backends.triton.kernel_math import kernel_bias
from gspo_kernels.backends.triton.linear import SavedForward, vendor_backward, vendor_forward
from gspo_kernels.backends.triton.linear_invariant import (
    BackwardInputs,
    compact_rows,
    kernel_operands,
    linear_logprobs_backward,
    linear_logprobs_forward,
)
from gspo_kernels.backends.triton.logits import logprobs_backward, logprobs_forward
from gspo_kernels.checks import tracing
from gspo_kernels.config import GSPOConfig
from gspo_kernels.layout import LossInputs
from gspo_kernels.objectives.stage import LossOutput, gspo_objective
from gspo_kernels.options import DEFAULT_OPTIONS, CallOptions
from gspo_kernels.precision import compute_dtype

# ---------------------------------------------------------------------------------------------
# The logits path.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("gspo_triton::logits_fwd", mutates_args=())
def logits_fwd(logits: Tensor, labels: Tensor, active: Optional[Tensor], temperature: float, return_entropy: bool,
               softcap: Optional[float]) -> Tuple[Tensor, Tensor, Tensor]:
    """``logits [N, V] | [B, T, V]`` (any strides), ``labels [N]`` int64, ``active [N]`` bool or None ->
    ``(logp [N], entropy [N] (zeros without return_entropy), row_stats [2, N])``, fp32 (fp64 for fp64 logits)."""
    logp, entropy, row_stats = logprobs_forward(logits, labels, active=active, temperature=temperature,
                                                return_entropy=return_entropy, softcap=softcap)
    return logp, (torch.zeros_like(logp) if entropy is None else entropy), row_stats


@logits_fwd.register_fake
def _(logits, labels, active, temperature, return_entropy, softcap):
    n = labels.shape[0]
    acc = compute_dtype(logits.dtype)
    return logits.new_empty((n,), dtype=acc), logits.new_empty((n,), dtype=acc), logits.new_empty((2, n), dtype=acc)


@torch.library.custom_op("gspo_triton::logits_bwd", mutates_args=())
def logits_bwd(logits: Tensor, labels: Tensor, row_stats: Tensor, entropy: Optional[Tensor],
               grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], active: Optional[Tensor],
               temperature: float, softcap: Optional[float]) -> Tensor:
    """``dlogits`` (a new tensor shaped like ``logits``, in its dtype); ``entropy`` only with ``grad_entropy``."""
    return logprobs_backward(logits, labels, row_stats, entropy, grad_logp, grad_entropy, active=active,
                             temperature=temperature, softcap=softcap)


@logits_bwd.register_fake
def _(logits, labels, row_stats, entropy, grad_logp, grad_entropy, active, temperature, softcap):
    return logits.new_empty(logits.shape)


def _logits_setup(ctx, inputs, output):
    logits, labels, active, temperature, return_entropy, softcap = inputs
    _logp, entropy, row_stats = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(logits, labels, row_stats, entropy, active)
    ctx.temperature, ctx.return_entropy, ctx.softcap = temperature, return_entropy, softcap


def _logits_backward(ctx, grad_logp, grad_entropy, _grad_stats):
    logits, labels, row_stats, entropy, active = ctx.saved_tensors
    if not ctx.return_entropy:
        grad_entropy = None
    if grad_logp is None and grad_entropy is None:
        return None, None, None, None, None, None
    acc = row_stats.dtype
    dlogits = torch.ops.gspo_triton.logits_bwd(
        logits, labels, row_stats, entropy if grad_entropy is not None else None,
        None if grad_logp is None else grad_logp.to(acc).contiguous(),
        None if grad_entropy is None else grad_entropy.to(acc).contiguous(),
        active, ctx.temperature, ctx.softcap)
    return dlogits, None, None, None, None, None


torch.library.register_autograd("gspo_triton::logits_fwd", _logits_backward, setup_context=_logits_setup)


def traced_logits_logprobs(logits: Tensor, labels: Tensor, active: Optional[Tensor],
                           options: CallOptions) -> Tuple[Tensor, Optional[Tensor]]:
    """``(logp [N], entropy [N] | None)`` through ``logits_fwd``: the traced form of :func:`.logits.logits_logprobs`
    (``options``: ``temperature``, ``return_entropy``, ``softcap`` read; the gradient is never written in place)."""
    if logits.dim() not in (2, 3):
        logits = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1).to(torch.int64)
    if active is not None:
        active = active.reshape(-1).to(torch.bool).contiguous()
    logp, entropy, _ = torch.ops.gspo_triton.logits_fwd(logits, labels, active, float(options.temperature),
                                                        bool(options.return_entropy), options.softcap)
    return logp, (entropy if options.return_entropy else None)


# ---------------------------------------------------------------------------------------------
# The hidden-state path (vendor GEMMs and the logits path's epilogues).
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("gspo_triton::linear_fwd", mutates_args=())
def linear_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, active: Optional[Tensor],
               temperature: float, memory_budget: Optional[int], softcap: Optional[float],
               grad: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``hidden [N, H]``, ``weight [V, H]`` and ``bias [V]`` in one dtype (the precision policy's operands) ->
    ``(logp [N], entropy [N], row_stats [2, N])`` in the compute dtype; ``grad``: a backward will follow."""
    return vendor_forward(hidden, weight, bias, labels, active, temperature=temperature,
                          memory_budget=memory_budget, softcap=softcap, grad=grad)


@linear_fwd.register_fake
def _(hidden, weight, bias, labels, active, temperature, memory_budget, softcap, grad):
    n = hidden.shape[0]
    acc = compute_dtype(weight.dtype)
    return hidden.new_empty((n,), dtype=acc), hidden.new_empty((n,), dtype=acc), hidden.new_empty((2, n), dtype=acc)


@torch.library.custom_op("gspo_triton::linear_bwd", mutates_args=())
def linear_bwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, active: Optional[Tensor],
               row_stats: Tensor, entropy: Tensor, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor],
               temperature: float, memory_budget: Optional[int], softcap: Optional[float], need_dh: bool,
               need_dw: bool, need_db: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dH [N, H], dW [V, H], dB [V])`` in the operands' dtypes; a gradient not asked for (``need_*``) or without
    a bias is an empty ``[0]`` tensor."""
    n = hidden.shape[0]
    computed = torch.ones(n, device=hidden.device, dtype=torch.bool) if active is None else active
    saved = SavedForward(hidden=hidden, weight=weight, bias=bias, labels=labels, computed=computed,
                         row_stats=row_stats, entropy=entropy, operand=weight.dtype,
                         sliced=configs.vocab_sliced(n, weight.shape[0]), temperature=temperature, softcap=softcap,
                         memory_budget=memory_budget)
    grads = vendor_backward(saved, grad_logp, grad_entropy, (need_dh, need_dw, need_db and bias is not None))
    like = (hidden, weight, bias if bias is not None else hidden)
    return tuple(t.new_empty((0,)) if g is None else g.to(t.dtype) for g, t in zip(grads, like))


def _gradient_shapes(hidden, weight, bias, need_dh, need_dw, need_db):
    """The fake outputs of both hidden-state backward operators: ``dH, dW, db`` shaped as their operands, ``[0]``
    where not asked for (or no bias)."""
    dh = hidden.new_empty(hidden.shape if need_dh else (0,))
    dw = weight.new_empty(weight.shape if need_dw else (0,))
    db = bias.new_empty(bias.shape) if bias is not None and need_db else hidden.new_empty((0,))
    return dh, dw, db


@linear_bwd.register_fake
def _(hidden, weight, bias, labels, active, row_stats, entropy, grad_logp, grad_entropy, temperature, memory_budget,
      softcap, need_dh, need_dw, need_db):
    return _gradient_shapes(hidden, weight, bias, need_dh, need_dw, need_db)


def _linear_setup(ctx, inputs, output):
    """Both hidden-state forward operators: their first eight inputs are the same (the vendor one adds ``grad``)."""
    hidden, weight, bias, labels, active, temperature, memory_budget, softcap = inputs[:8]
    _logp, entropy, row_stats = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, weight, bias, labels, active, row_stats, entropy)
    ctx.options = (temperature, memory_budget, softcap)


def _hidden_state_backward(backward_op, n_inputs: int):
    """The autograd formula of a hidden-state forward operator of ``n_inputs`` inputs whose gradients its
    ``backward_op`` computes (same arguments for both: the saved tensors, the incoming gradients in the statistics'
    fp32, the options, which of dH / dW / db to compute)."""

    def backward(ctx, grad_logp, grad_entropy, _grad_stats):
        hidden, weight, bias, labels, active, row_stats, entropy = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        if grad_logp is None and grad_entropy is None or not (need_dh or need_dw or need_db):
            return (None,) * n_inputs
        acc = row_stats.dtype
        dh, dw, db = backward_op(
            hidden, weight, bias, labels, active, row_stats, entropy,
            None if grad_logp is None else grad_logp.to(acc).contiguous(),
            None if grad_entropy is None else grad_entropy.to(acc).contiguous(),
            *ctx.options, bool(need_dh), bool(need_dw), bool(need_db and bias is not None))
        return (dh if need_dh else None, dw if need_dw else None, db if need_db and bias is not None else None,
                *(None,) * (n_inputs - 3))

    return backward


torch.library.register_autograd("gspo_triton::linear_fwd", _hidden_state_backward(linear_bwd, 9),
                                setup_context=_linear_setup)


def traced_linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                           active: Optional[Tensor], options: CallOptions) -> Tuple[Tensor, Optional[Tensor]]:
    """``(logp [N], entropy [N] | None)`` through ``linear_fwd``: the traced form of :func:`.linear.linear_logprobs`
    (``options``: ``temperature``, ``return_entropy``, ``memory_budget``, ``softcap`` read). The gradients reach the
    caller's tensors through the precision policy's casts, which are in the graph."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    labels = labels.reshape(-1).to(torch.int64)
    if active is not None:
        active = active.reshape(-1).to(torch.bool).contiguous()
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    logp, entropy, _ = torch.ops.gspo_triton.linear_fwd(rows, weight, bias, labels, active,
                                                        float(options.temperature), options.memory_budget,
                                                        options.softcap, grad)
    return logp, (entropy if options.return_entropy else None)


# ---------------------------------------------------------------------------------------------
# The hidden-state path on the batch-invariant Triton GEMMs (``batch_invariant=True``).
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("gspo_triton::invariant_linear_fwd", mutates_args=())
def invariant_linear_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                         active: Optional[Tensor], temperature: float, memory_budget: Optional[int],
                         softcap: Optional[float]) -> Tuple[Tensor, Tensor, Tensor]:
    """``hidden [N, H] | [B, T, H]`` (any strides) and ``weight [V, H]`` in one dtype (fp64 computed in fp32), ``bias
    [V]`` or None, as the caller gives them; ``labels [N]`` int64, ``active [N]`` bool or None -> ``(logp [N],
    entropy [N], row_stats [2, N] = (row_max, log_sum))``, fp32, 0 at the rows not active. ``memory_budget`` is the
    backward's (kept by the autograd formula), read by nothing here."""
    h, w = kernel_operands(hidden, weight)
    order, count = (None, None) if active is None else compact_rows(active)
    logp, entropy, row_max, log_sum = linear_logprobs_forward(h, w, kernel_bias(bias, softcap), labels, temperature,
                                                              order=order, count=count, softcap=softcap)
    # views of one buffer: an operator's outputs may alias nothing, so each leaves as a tensor of its own
    return logp.clone(), entropy.clone(), torch.stack((row_max, log_sum))


@invariant_linear_fwd.register_fake
def _(hidden, weight, bias, labels, active, temperature, memory_budget, softcap):
    n = labels.shape[0]
    f32 = torch.float32
    return hidden.new_empty((n,), dtype=f32), hidden.new_empty((n,), dtype=f32), hidden.new_empty((2, n), dtype=f32)


@torch.library.custom_op("gspo_triton::invariant_linear_bwd", mutates_args=())
def invariant_linear_bwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                         active: Optional[Tensor], row_stats: Tensor, entropy: Tensor, grad_logp: Optional[Tensor],
                         grad_entropy: Optional[Tensor], temperature: float, memory_budget: Optional[int],
                         softcap: Optional[float], need_dh: bool, need_dw: bool,
                         need_db: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dH shaped like hidden, dW [V, H], dB [V])`` in the caller's dtypes (``hidden``, ``weight``, ``bias``: the
    forward's arguments); ``grad_logp`` / ``grad_entropy`` ``[N]`` fp32 or None. Only the active rows with a
    non-zero incoming gradient are visited (compacted on the device, as the eager Function does); a gradient not
    asked for (``need_*``) or without a bias is an empty ``[0]`` tensor."""
    computed = torch.ones(labels.shape[0], device=hidden.device, dtype=torch.bool) if active is None else active
    carries = torch.zeros_like(computed)
    for grad in (grad_logp, grad_entropy):
        if grad is not None:
            carries |= grad != 0
    order, count = compact_rows(carries & computed)
    h, w = kernel_operands(hidden, weight)
    inputs = BackwardInputs(hidden=h, weight=w, bias=kernel_bias(bias, softcap), labels=labels, row_max=row_stats[0],
                            log_sum=row_stats[1], entropy=entropy, grad_logp=grad_logp, grad_entropy=grad_entropy,
                            order=order, count=count)
    options = CallOptions(temperature=temperature, softcap=softcap, memory_budget=memory_budget)
    grads = linear_logprobs_backward(inputs, options, compute_dh=need_dh, compute_dw=need_dw,
                                     compute_db=need_db and bias is not None)
    like = (hidden, weight, bias if bias is not None else hidden)
    return tuple(t.new_empty((0,)) if g is None else g.reshape(t.shape).to(t.dtype) for g, t in zip(grads, like))


@invariant_linear_bwd.register_fake
def _(hidden, weight, bias, labels, active, row_stats, entropy, grad_logp, grad_entropy, temperature, memory_budget,
      softcap, need_dh, need_dw, need_db):
    return _gradient_shapes(hidden, weight, bias, need_dh, need_dw, need_db)


torch.library.register_autograd("gspo_triton::invariant_linear_fwd", _hidden_state_backward(invariant_linear_bwd, 8),
                                setup_context=_linear_setup)


def traced_invariant_linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                                     active: Optional[Tensor], options: CallOptions) -> Tuple[Tensor, Optional[Tensor]]:
    """``(logp [N], entropy [N] | None)`` through ``invariant_linear_fwd``: the traced form of
    :func:`.linear_invariant.linear_logprobs` (``options``: ``temperature``, ``return_entropy``, ``memory_budget``,
    ``softcap`` read), the same kernels on the same rows: the same bits, and the same rows' invariance. fp32 (fp64,
    computed in fp32, when ``hidden`` or ``weight`` is fp64)."""
    labels = labels.reshape(-1).to(torch.int64)
    if active is not None:
        active = active.reshape(-1).to(torch.bool).contiguous()
    logp, entropy, _ = torch.ops.gspo_triton.invariant_linear_fwd(hidden, weight, bias, labels, active,
                                                                  float(options.temperature), options.memory_budget,
                                                                  options.softcap)
    out_dtype = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    return logp.to(out_dtype), (entropy.to(out_dtype) if options.return_entropy else None)


# ---------------------------------------------------------------------------------------------
# The backend's entries: the eager autograd Functions, or under tracing the operators above.
# ---------------------------------------------------------------------------------------------


def logits_logprobs(logits: Tensor, labels: Tensor, active: Optional[Tensor] = None,
                    options: CallOptions = DEFAULT_OPTIONS) -> Tuple[Tensor, Optional[Tensor]]:
    """The contract's ``logits_logprobs``: :func:`.logits.logits_logprobs`, or its operator under tracing."""
    if tracing():
        return traced_logits_logprobs(logits, labels, active, options)
    return logits_path.logits_logprobs(logits, labels, active, options)


def linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                    active: Optional[Tensor] = None, options: CallOptions = DEFAULT_OPTIONS, *,
                    leaves: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """The contract's ``linear_logprobs``: the vendor GEMMs (:func:`.linear.linear_logprobs`) by default, or their
    operator under tracing; the batch-invariant Triton GEMMs (:func:`.linear_invariant.linear_logprobs`) with
    ``options.batch_invariant``, which return the gradients to the operands they are given (``leaves``, the
    caller's tensors before the precision policy's cast, is the vendor path's); under tracing their operator."""
    if options.batch_invariant:
        if tracing():
            return traced_invariant_linear_logprobs(hidden, weight, bias, labels, active, options)
        return linear_invariant.linear_logprobs(hidden, weight, bias, labels, active, options)
    if tracing():
        return traced_linear_logprobs(hidden, weight, bias, labels, active, options)
    return linear.linear_logprobs(hidden, weight, bias, labels, active, options, leaves=leaves)


def sequence_stage(logp: Tensor, entropy: Optional[Tensor], inputs: LossInputs, config: GSPOConfig) -> LossOutput:
    """The contract's ``sequence_stage``: the fused kernels (:func:`.sequence.fused_objective`); under tracing
    PyTorch's sequence stage (:func:`gspo_kernels.objectives.stage.gspo_objective`: the same loss to fp32 rounding,
    traceable, fused by inductor), until the sequence kernels have an operator of their own."""
    if tracing():
        return gspo_objective(logp, entropy, inputs, config)
    return sequence.fused_objective(logp, entropy, inputs, config)


def fused_logits_loss(logits: Tensor, inputs: LossInputs, options: CallOptions) -> LossOutput:
    """The contract's ``fused_logits_loss`` (:func:`.logits_loss.fused_logits_loss`); under tracing its two stages,
    ``logits_fwd`` then :func:`sequence_stage`."""
    if tracing():
        active = inputs.batch.counted if inputs.batch.counted is not None else inputs.batch.mask != 0
        logp, entropy = traced_logits_logprobs(logits, inputs.labels, active, options)
        return sequence_stage(logp, entropy, inputs, options.config)
    return logits_loss.fused_logits_loss(logits, inputs, options)


def fused_linear_loss(sequence_stage: Callable, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], inputs,
                      options: CallOptions, *, leaves=None) -> Optional[LossOutput]:
    """The contract's ``fused_linear_loss`` (:func:`.linear_loss.fused_linear_loss`, the one-pass loss); None under
    tracing, where the pipeline then runs ``linear_fwd`` and the sequence stage (the one-pass loss plans its
    chunks on the host and holds gradients between forward and backward: neither is a graph)."""
    if tracing():
        return None
    return linear_loss.fused_linear_loss(sequence_stage, hidden, weight, bias, inputs, options, leaves=leaves)
