"""The public functions and modules: thin front-ends over one pipeline, :func:`_run`.

Every loss runs the same steps in the same order: check the arguments, lay the tokens out flat
(:mod:`gspo_kernels.layout`), cast the lm_head operands once (:mod:`gspo_kernels.precision`), resolve the
backend, compute the per-token log-probs and entropies (a *head*: from logits, from hidden states, or given
by the caller), apply the backend's sequence stage (the objective's loss), and refuse double backward. The
per-token functions share the same heads and checks without the objective.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from gspo_kernels import backends, parallel
from gspo_kernels.backends import Backend
from gspo_kernels.checks import (
    ValueChecks,
    check_bool,
    check_finite_linear,
    check_finite_logits,
    check_finite_values,
    check_float,
    check_labels,
    check_linear,
    check_logits,
    check_logprobs_out,
    check_memory_budget,
    check_same_device,
)
from gspo_kernels.config import GSPOConfig, check_config
from gspo_kernels.distributed import zero3
from gspo_kernels.layout import LossTensors, prepare_loss_inputs
from gspo_kernels.objectives.stage import LossOutput, gspo_objective
from gspo_kernels.options import CallOptions
from gspo_kernels.parallel import VocabParallel, check_vocab_parallel
from gspo_kernels.precision import apply_precision, backend_context, upcast

Scalar = Union[None, int, float, Tensor]


def _loss_options(config: Optional[GSPOConfig], backend: str, check_finite: bool, **head) -> CallOptions:
    """A loss's :class:`CallOptions`: the config checked (the defaults for None); the options' temperature and soft
    cap are the config's (the one copy the stages read), the other options checked as :class:`CallOptions` is
    built."""
    config = check_config(config)
    return CallOptions(config=config, backend=backend, check_finite=check_finite, temperature=config.temperature,
                       softcap=config.final_logit_softcapping, return_entropy=True, **head)


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    vocab_parallel: Optional[VocabParallel] = None,
    check_finite: bool = False,
    final_logit_softcapping: Optional[float] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Differentiable per-token log-probs ``log softmax(logits / temperature)[labels]`` in fp32.

    Args:
        logits: ``[..., V]`` fp16/bf16/fp32/fp64, any strides (never copied to fp32 in full).
        labels: ``[...]`` integer, in ``[0, V)``.
        vocab_parallel: this rank holds the logits columns ``[start, end)`` of a vocabulary split over a
            process group (``logits [..., end - start]``, global labels; see ``docs/tensor_parallel.md``).
        check_finite: raise ``ValueError`` naming ``logits`` when a row holds NaN or +inf or a non-finite
            logit at its label (default: NaN in, NaN out; see ``docs/policies.md``).
        final_logit_softcapping: the soft cap ``c`` of Gemma 2/3: ``log softmax(c tanh(logits / c) / temperature)``
            (the cap before the temperature), in the forward and the backward. None: no cap.
    Returns:
        ``logp`` shaped like ``labels`` (fp32; fp64 for fp64 logits), and the entropy ``H`` of each
        row's distribution when ``return_entropy``. First-order differentiable only.
    """
    check_logits(logits, labels, None)
    vp = check_vocab_parallel(vocab_parallel)
    options = CallOptions(backend=backend, vocab_parallel=vp, **_logprobs_options(
        temperature, final_logit_softcapping, return_entropy, check_finite))  # each option checked as it is built
    return _run_logprobs(_LogitsHead(logits, options), labels, options)


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    vocab_parallel: Optional[VocabParallel] = None,
    fp32_head: bool = False,
    check_finite: bool = False,
    memory_budget: Optional[int] = None,
    batch_invariant: bool = False,
    final_logit_softcapping: Optional[float] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Per-token log-probs (and entropy) of ``hidden @ weight.T + bias``; the logits never exist.

    Args:
        hidden: ``[..., H]``; weight: ``[V, H]`` (the lm_head); bias: ``[V]`` or None;
        labels: ``[...]`` integer in ``[0, V)``.
        vocab_parallel: this rank holds the lm_head rows ``[start, end)`` of a vocabulary split over a
            process group (``weight [end - start, H]``, global labels; ``dH`` summed over the group).
        fp32_head: fp32 operands whatever the inputs' dtypes and autocast say; otherwise the operand
            dtype follows :mod:`gspo_kernels.precision` (the autocast dtype under ``torch.autocast``,
            the lower-precision dtype of a mixed pair outside it).
        check_finite: raise ``ValueError`` naming ``hidden``, ``weight`` or ``bias`` when they hold NaN or
            inf (``-inf`` bias entries off the labels are allowed; see ``docs/policies.md``).
        memory_budget: bytes the backend may use for logits saved between forward and backward and
            for its chunk buffers (None: the backend's default; ``backend="cpu"``: 1 GiB of saved
            logits, 0 recomputes them; ``backend="torch"``: ignored on CPU tensors; on CUDA its chunk buffers,
            and the probabilities it keeps when they fit in the fp32 ``dW`` accumulator's bytes, see
            ``backends/torch/linear.py``'s ``linear_logprobs``). Results do not depend on it.
        batch_invariant: a row's log-prob, entropy and ``dH`` row are the same bits whatever the other rows
            of the batch, the row's position and ``memory_budget`` (``backend="triton"`` and ``"cpu"``; the
            price in speed is in ``docs/gpu.md`` and ``docs/cpu_backends.md``). ``backend="torch"`` refuses it.
        final_logit_softcapping: the soft cap ``c``, applied to ``hidden @ weight.T + bias`` before the
            temperature, as in :func:`token_logprobs`.
    Returns:
        fp32 tensors shaped like ``labels`` (fp64 for fp64 inputs); first-order differentiable for hidden,
        weight and bias.
    """
    with zero3.gathered(weight=weight, bias=bias) as gather:  # a DeepSpeed ZeRO-3 head: gathered for the call
        check_linear(hidden, weight, bias, labels)
        head = _linear_head_options(vocab_parallel, fp32_head, memory_budget, batch_invariant)
        options = CallOptions(backend=backend, **head, **_logprobs_options(
            temperature, final_logit_softcapping, return_entropy, check_finite))  # each option checked as it is built
        return _run_logprobs(_LinearHead(hidden, weight, bias, options, gather), labels, options)


def gspo_loss(
    logits: Tensor,
    labels: Tensor,
    advantages: Tensor,
    old_logprobs: Optional[Tensor] = None,
    *,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    is_ratio: Optional[Tensor] = None,
    num_items_in_batch: Scalar = None,
    rollout_logprobs: Optional[Tensor] = None,
    config: Optional[GSPOConfig] = None,
    backend: str = "auto",
    inplace_backward: bool = False,
    vocab_parallel: Optional[VocabParallel] = None,
    check_finite: bool = False,
) -> LossOutput:
    """The GSPO / GRPO loss from logits (see ``docs/math.md``).

    Args:
        logits: ``[B, T, V]`` (padded layout) or ``[N, V]`` (packed), any float dtype, any strides;
            aligned so that position ``t`` predicts ``labels[t]``.
        labels: ``[B, T]`` or ``[N]`` integer; unmasked entries in ``[0, V)``.
        advantages: per response ``[S]`` or per token (labels' shape).
        old_logprobs: log-probs of the sampling policy (labels' shape); None means on-policy.
        mask: token mask (labels' shape), bool, integer or float holding only 0 and 1;
            cu_seqlens: ``[S + 1]`` int32/int64 (packed layout).
        ref_logprobs: reference-model log-probs, required when ``config.beta > 0``.
        is_ratio: inference-engine importance correction, per token or per response.
        num_items_in_batch: global token count for ``loss_type="dapo"``: a finite number > 0 (int, float or
            one-element tensor), used as given.
        rollout_logprobs: the inference engine's log-probs of the sampled tokens (labels' shape): the library
            computes ``config.rollout_correction`` from them, and the ``rollout/*`` mismatch metrics.
        inplace_backward: write the logits gradient into ``logits``' storage (the logits are consumed).
        vocab_parallel: ``logits [..., end - start]`` is this rank's vocabulary shard (see :func:`token_logprobs`);
            the loss and metrics are the same on every rank.
        check_finite: raise ``ValueError`` naming the argument when a float input holds NaN / inf at an
            unmasked position (``-inf`` logits off the label are allowed). Default: NaN in, NaN out.
    Returns:
        ``LossOutput(loss, metrics)``: 0-dim loss (first-order differentiable), detached 0-dim metrics.
    """
    check_logits(logits, labels, cu_seqlens)
    vp = check_vocab_parallel(vocab_parallel)
    options = _loss_options(config, backend, check_finite, vocab_parallel=vp, inplace_backward=inplace_backward)
    tensors = LossTensors(advantages, old_logprobs, mask, cu_seqlens, ref_logprobs, is_ratio, num_items_in_batch,
                          rollout_logprobs)
    return _run(_LogitsHead(logits, options), labels, tensors, options)


def fused_linear_gspo_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    advantages: Tensor,
    old_logprobs: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    is_ratio: Optional[Tensor] = None,
    num_items_in_batch: Scalar = None,
    rollout_logprobs: Optional[Tensor] = None,
    config: Optional[GSPOConfig] = None,
    backend: str = "auto",
    inplace_backward: bool = False,
    vocab_parallel: Optional[VocabParallel] = None,
    fp32_head: bool = False,
    check_finite: bool = False,
    memory_budget: Optional[int] = None,
    batch_invariant: bool = False,
    logprobs_out: Optional[Tensor] = None,
) -> LossOutput:
    """:func:`gspo_loss` of ``hidden @ weight.T + bias`` without ever forming the logits.

    Args:
        hidden: ``[B, T, H]`` or ``[N, H]``; weight: ``[V, H]`` (the lm_head); bias: ``[V]`` or None.
        fp32_head: fp32 operands; otherwise the operand dtype follows :mod:`gspo_kernels.precision`
            (products accumulate in fp32 and the log-probs, entropies and loss are fp32 either way).
        The other arguments are those of :func:`gspo_loss` (``inplace_backward`` has no effect here).
        vocab_parallel: ``weight [end - start, H]`` (and ``bias``) is this rank's lm_head shard (see
            :func:`linear_logprobs`).
        memory_budget: bytes for saved logits / chunk buffers, as in :func:`linear_logprobs`.
        batch_invariant: bitwise batch invariance of the per-token results, as in :func:`linear_logprobs`.
        logprobs_out: a floating tensor shaped like ``labels`` on their device that receives the per-token
            log-probs the loss was computed from (detached; 0 where ``mask`` is 0), for a caller's metrics: the
            one-pass loss forms them in its forward, and nothing else gives them without a second pass over
            the lm_head. None (default): not kept.
    """
    with zero3.gathered(weight=weight, bias=bias) as gather:  # a DeepSpeed ZeRO-3 head: gathered for the call
        check_linear(hidden, weight, bias, labels)
        check_logprobs_out(logprobs_out, labels)
        head = _linear_head_options(vocab_parallel, fp32_head, memory_budget, batch_invariant)
        options = _loss_options(config, backend, check_finite, **head)
        tensors = LossTensors(advantages, old_logprobs, mask, cu_seqlens, ref_logprobs, is_ratio, num_items_in_batch,
                              rollout_logprobs, logprobs_out)
        return _run(_LinearHead(hidden, weight, bias, options, gather), labels, tensors, options)


def policy_loss(
    logprobs: Tensor,
    advantages: Tensor,
    old_logprobs: Optional[Tensor] = None,
    *,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    is_ratio: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None,
    num_items_in_batch: Scalar = None,
    rollout_logprobs: Optional[Tensor] = None,
    config: Optional[GSPOConfig] = None,
    backend: str = "auto",
    check_finite: bool = False,
) -> LossOutput:
    """The sequence stage alone: the GSPO / GRPO loss from per-token log-probs the caller already has.

    For trainers that compute log-probs themselves (verl's policy losses receive them, never logits).

    Args:
        logprobs: ``[B, T]`` (padded layout) or ``[N]`` (packed, with ``cu_seqlens``) float tensor, the
            current policy's log-probs of the sampled tokens; differentiable. fp16/bf16 are upcast to fp32.
        advantages, old_logprobs, mask, cu_seqlens, ref_logprobs, is_ratio, num_items_in_batch: as in
            :func:`gspo_loss` (token-shaped tensors have ``logprobs``' shape).
        entropy: per-token entropies (``logprobs``' shape), differentiable; required when
            ``config.entropy_coef != 0``, optional otherwise (it then only feeds the ``entropy`` metric).
        config: ``config.temperature`` and ``config.final_logit_softcapping`` have no effect here (the
            log-probs are given: apply both where they are computed).
        backend: ``"triton"`` runs the fused Triton sequence stage; the others run the PyTorch one.
        check_finite: raise ``ValueError`` naming the argument when ``logprobs``, ``entropy`` or another
            float input holds NaN / inf at an unmasked position. Default: NaN in, NaN out.
    Returns:
        ``LossOutput(loss, metrics)``: 0-dim loss (fp32, fp64 for fp64 log-probs; first-order differentiable),
        detached 0-dim metrics.
    """
    head = _GivenLogprobs(logprobs, entropy, packed=cu_seqlens is not None)
    options = _loss_options(config, backend, check_finite)
    tensors = LossTensors(advantages, old_logprobs, mask, cu_seqlens, ref_logprobs, is_ratio, num_items_in_batch,
                          rollout_logprobs)
    return _run(head, logprobs, tensors, options)


def _logprobs_options(temperature: float, softcap: Optional[float], return_entropy: bool, check_finite: bool) -> dict:
    """The per-token functions' own options as :class:`CallOptions` fields (checked there, once, as it is built)."""
    return {"temperature": temperature, "softcap": softcap, "return_entropy": return_entropy,
            "check_finite": check_finite}


def _linear_head_options(vocab_parallel, fp32_head: bool, memory_budget: Optional[int], batch_invariant: bool) -> dict:
    """The lm_head options of the hidden-state functions as :class:`CallOptions` fields (``vocab_parallel`` checked
    here, the others as the options are built)."""
    return {"vocab_parallel": check_vocab_parallel(vocab_parallel), "fp32_head": fp32_head,
            "memory_budget": memory_budget, "batch_invariant": batch_invariant}


# ---------------------------------------------------------------------------------------------
# The one pipeline behind the public functions.
# ---------------------------------------------------------------------------------------------


class _Head:
    """What the pipeline asks of a head; :meth:`fused_loss` returns None unless the head has a one-pass form.
    ``gather``: the call's DeepSpeed ZeRO-3 parameters (:mod:`gspo_kernels.distributed.zero3`), None without."""

    gather: Optional[zero3.HeadGather] = None

    def fused_loss(self, impl: Backend, sequence_stage, inputs, options: CallOptions) -> Optional[LossOutput]:
        return None

    def plans_rows(self, impl: Backend) -> bool:
        """Whether :meth:`fused_loss` will want the :class:`~gspo_kernels.layout.HostLayout` (read with the checks)."""
        return False


class _LogitsHead(_Head):
    """Per-token log-probs from materialized logits (``[B, T, V]``, ``[N, V]`` or ``[..., V]``)."""

    def __init__(self, logits: Tensor, options: CallOptions) -> None:
        self.logits, self.vp = logits, options.vocab_parallel
        self.device = logits.device
        vp = self.vp
        self.vocab_size = logits.shape[-1] if vp is None else vp.vocab_size

    def check_finite(self, labels: Tensor, checks: ValueChecks, counted: Optional[Tensor]) -> None:
        check_finite_logits(self.logits, labels if self.vp is None else None, checks, counted)

    def fused_loss(self, impl: Backend, sequence_stage, inputs, options: CallOptions) -> Optional[LossOutput]:
        """The backend's logits loss in one call when it has one, the sequence stage is the backend's own and there
        is no vocabulary split (the same loss and gradient as the log-probs and the sequence stage one after the
        other, with less host work: see ``docs/gpu.md``); not when the log-probs are asked for (``logprobs_out``)."""
        if (impl.fused_logits_loss is None or self.vp is not None or sequence_stage is not impl.sequence_stage
                or inputs.logprobs_out is not None):
            return None
        return impl.fused_logits_loss(self.logits, inputs, options)

    def logprobs(self, impl: Backend, labels: Tensor, active: Optional[Tensor],
                 options: CallOptions) -> Tuple[Tensor, Optional[Tensor]]:
        logits = self.logits
        rows = logits if logits.dim() in (2, 3) else logits.reshape(-1, logits.shape[-1])
        stage = impl.logits_logprobs if self.vp is None else functools.partial(parallel.logits_logprobs, impl, self.vp)
        return stage(rows, labels, active, options)


class _LinearHead(_Head):
    """Per-token log-probs of ``hidden @ weight.T + bias`` (operands cast once by the precision policy)."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], options: CallOptions,
                 gather: Optional[zero3.HeadGather] = None) -> None:
        vp = options.vocab_parallel
        self.batch_invariant = options.batch_invariant
        self.hidden, self.weight, self.bias = apply_precision(hidden, weight, bias, fp32_head=options.fp32_head)
        self.gather = gather
        if gather is not None:  # a cast of a ZeRO-3 head is made again in the backward, not kept
            gather.register_cast(weight, self.weight)
            gather.register_cast(bias, self.bias)
        self.raw = (hidden, weight, bias)  # the caller's tensors: the finite checks read these
        self.vp = vp
        self.device = hidden.device
        self.vocab_size = weight.shape[0] if vp is None else vp.vocab_size

    def check_finite(self, labels: Tensor, checks: ValueChecks, counted: Optional[Tensor]) -> None:
        check_finite_linear(*self.raw, labels if self.vp is None else None, checks, counted)

    def plans_rows(self, impl: Backend) -> bool:
        return impl.fused_linear_loss is not None and self.vp is None and not self.batch_invariant

    def fused_loss(self, impl: Backend, sequence_stage, inputs, options: CallOptions) -> Optional[LossOutput]:
        """The backend's one-pass loss (gradient formed in the forward) when it has one and the call allows it
        (no vocabulary split, no batch invariance asked). It gets the operands as the precision policy cast them
        and the caller's tensors (``inputs=``), to whose dtypes it returns the gradients directly."""
        if not self.plans_rows(impl):
            return None
        hidden = self.hidden.reshape(-1, self.hidden.shape[-1])
        return impl.fused_linear_loss(sequence_stage, hidden, self.weight, self.bias, inputs, options, leaves=self.raw)

    def logprobs(self, impl: Backend, labels: Tensor, active: Optional[Tensor],
                 options: CallOptions) -> Tuple[Tensor, Optional[Tensor]]:
        hidden = self.hidden
        rows = hidden if hidden.dim() in (2, 3) else hidden.reshape(-1, hidden.shape[-1])
        stage = impl.linear_logprobs if self.vp is None else functools.partial(parallel.linear_logprobs, impl, self.vp)
        leaves = {}
        if self.vp is None and self.raw[0].shape == rows.shape:
            leaves["leaves"] = self.raw  # a backend may hand the gradients to the caller's tensors directly
        return stage(rows, self.weight, self.bias, labels, active, options, **leaves)


class _GivenLogprobs(_Head):
    """Log-probs (and entropies) the caller computed: the sequence stage alone (:func:`policy_loss`)."""

    vocab_size = None  # no labels: the log-probs tensor carries the token layout

    def __init__(self, logprobs: Tensor, entropy: Optional[Tensor], *, packed: bool) -> None:
        logprobs = check_float("logprobs", logprobs)
        shape = tuple(logprobs.shape)
        if not packed and logprobs.dim() != 2:
            raise ValueError(f"logprobs must be [B, T] (padded layout) or [N] with cu_seqlens (packed layout), "
                             f"got shape {shape}")
        if packed and logprobs.dim() != 1:
            raise ValueError(f"logprobs must be [N] when cu_seqlens is given (packed layout), got shape {shape}")
        if entropy is not None:
            entropy = check_float("entropy", entropy)
            if tuple(entropy.shape) != shape:
                raise ValueError(f"entropy must have logprobs' shape {shape}, got {tuple(entropy.shape)}")
        self.device = check_same_device(logprobs=logprobs, entropy=entropy)
        self.logp = upcast(logprobs.reshape(-1))
        self.entropy = None if entropy is None else upcast(entropy.reshape(-1))

    def check_finite(self, labels: Optional[Tensor], checks: ValueChecks, counted: Optional[Tensor]) -> None:
        check_finite_values("logprobs", self.logp, checks, counted)
        if self.entropy is not None:
            check_finite_values("entropy", self.entropy, checks, counted)

    def logprobs(self, impl: Backend, labels: Optional[Tensor], active: Optional[Tensor],
                 options: CallOptions) -> Tuple[Tensor, Optional[Tensor]]:
        return self.logp, self.entropy  # given: the temperature and the soft cap were applied by the caller


def _run(head, tokens: Tensor, tensors: LossTensors, options: CallOptions) -> LossOutput:
    """Validate, lay out, dispatch, apply the objective: the one order every loss follows.

    ``head`` computes the per-token log-probs and entropies (from logits, from hidden states, or given);
    ``tokens`` is the tensor that carries the token layout (the labels, or the given log-probs); ``tensors`` the
    caller's other loss tensors (their ``logprobs_out`` receives the detached per-token log-probs, 0 where not
    counted); ``options`` the call's checked options (the config among them).
    """
    config = options.config
    impl = backends.resolve(options.backend, head.device)
    inputs = prepare_loss_inputs(
        tokens, head.vocab_size, tensors, beta=config.beta, rollout_correction=config.rollout_correction,
        check_finite=options.check_finite, host_layout=head.plans_rows(impl),
    )
    counted = inputs.batch.counted if inputs.batch.counted is not None else inputs.batch.mask > 0  # no op: kept
    if options.check_finite:
        checks = ValueChecks()
        head.check_finite(inputs.labels, checks, counted)
        checks.run()
    sequence_stage = impl.sequence_stage or gspo_objective
    with backend_context(head.device):
        output = head.fused_loss(impl, sequence_stage, inputs, options)
        if output is None:
            logp, entropy = head.logprobs(impl, inputs.labels, counted, options)
            if inputs.logprobs_out is not None:
                inputs.logprobs_out.copy_(torch.where(counted, logp.detach(), 0))
            if entropy is None and config.entropy_coef != 0:  # given log-probs only: the other heads give it
                raise ValueError("entropy is required when config.entropy_coef != 0")
            output = sequence_stage(logp, entropy, inputs, config)
    (loss,) = first_order_only(output.loss)
    if head.gather is not None:  # its backward gathers the ZeRO-3 head again, first
        (loss,) = head.gather.arm(loss)
    return LossOutput(loss, output.metrics)


def _run_logprobs(head, labels: Tensor, options: CallOptions) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """The per-token functions: the same checks and dispatch as :func:`_run`, without the objective."""
    checks = ValueChecks()
    flat = check_labels(labels, head.vocab_size, checks)
    checks.run()
    if options.check_finite:
        head.check_finite(flat, checks, None)
        checks.run()
    impl = backends.resolve(options.backend, head.device)
    with backend_context(head.device):
        logp, entropy = head.logprobs(impl, flat, None, options)
    logp, entropy = first_order_only(logp, entropy)
    if head.gather is not None:  # their backward gathers the ZeRO-3 head again, first
        logp, entropy = head.gather.arm(logp, entropy)
    logp = logp.reshape(labels.shape)
    return (logp, entropy.reshape(labels.shape)) if options.return_entropy else logp


class GSPOLoss(nn.Module):
    """Module form of :func:`gspo_loss`: ``GSPOLoss(config)(logits, labels, advantages, old, **kw)``."""

    def __init__(self, config: Optional[GSPOConfig] = None, *, backend: str = "auto", inplace_backward: bool = False,
                 check_finite: bool = False):
        super().__init__()
        self.config = check_config(config)
        self.backend = backend
        self.inplace_backward = inplace_backward
        self.check_finite = check_finite

    def forward(self, logits: Tensor, labels: Tensor, advantages: Tensor, old_logprobs: Optional[Tensor] = None,
                **kwargs) -> LossOutput:
        kwargs.setdefault("check_finite", self.check_finite)
        return gspo_loss(logits, labels, advantages, old_logprobs, config=self.config, backend=self.backend,
                         inplace_backward=self.inplace_backward, **kwargs)


class FusedLinearGSPOLoss(nn.Module):
    """Module form of :func:`fused_linear_gspo_loss`: ``(hidden, weight, labels, advantages, old, **kw)``.

    ``memory_budget``: bytes for saved logits / chunk buffers; ``batch_invariant``: bitwise batch invariance
    (see :func:`linear_logprobs`).
    """

    def __init__(self, config: Optional[GSPOConfig] = None, *, backend: str = "auto", check_finite: bool = False,
                 memory_budget: Optional[int] = None, batch_invariant: bool = False):
        super().__init__()
        self.config = check_config(config)
        self.backend = backend
        self.check_finite = check_finite
        check_memory_budget(memory_budget)
        self.memory_budget = memory_budget
        self.batch_invariant = check_bool("batch_invariant", batch_invariant)

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor, advantages: Tensor,
                old_logprobs: Optional[Tensor] = None, **kwargs) -> LossOutput:
        kwargs.setdefault("check_finite", self.check_finite)
        kwargs.setdefault("memory_budget", self.memory_budget)
        kwargs.setdefault("batch_invariant", self.batch_invariant)
        return fused_linear_gspo_loss(hidden, weight, labels, advantages, old_logprobs, config=self.config,
                                      backend=self.backend, **kwargs)


DOUBLE_BACKWARD_ERROR = (
    "gspo_kernels does not support double backward: its losses and log-probs are differentiable once "
    "(torch.autograd.grad(..., create_graph=True) and higher-order gradients are refused on every backend)"
)


class _FirstOrderOnly(torch.autograd.Function):
    """Identity whose backward refuses to build a graph (``create_graph=True``): the one place where every
    backend's double backward is refused with :data:`DOUBLE_BACKWARD_ERROR`. First-order gradients pass
    through untouched (``None`` stays ``None``, so the backward stages still skip zero-gradient rows)."""

    @staticmethod
    def forward(ctx, *tensors: Tensor):
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        if torch.is_grad_enabled():  # the autograd engine enables grad mode exactly when create_graph=True
            raise RuntimeError(DOUBLE_BACKWARD_ERROR)
        return grads


def first_order_only(*tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """``tensors`` unchanged in value; a backward with ``create_graph=True`` through them raises
    ``RuntimeError`` (:data:`DOUBLE_BACKWARD_ERROR`). Tensors that need no gradient are returned as is."""
    index = [i for i, t in enumerate(tensors) if t is not None and t.requires_grad]
    if not index:
        return tensors
    wrapped = _FirstOrderOnly.apply(*(tensors[i] for i in index))
    out = list(tensors)
    for i, t in zip(index, wrapped):
        out[i] = t
    return tuple(out)
