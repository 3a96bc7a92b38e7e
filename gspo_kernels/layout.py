"""The canonical flat token layout every backend works on, and the validated loss inputs.

Both layouts end up as ``N`` tokens in response order:

* padded: labels ``[B, T]`` with an optional ``mask [B, T]``; token ``b * T + t``; ``S = B``;
* packed: labels ``[N]`` with ``cu_seqlens [S + 1]`` (int32/int64) and an optional token ``mask [N]``.

:func:`prepare_loss_inputs` checks every loss input against the layout (through
:mod:`gspo_kernels.checks`) and flattens it into a :class:`LossInputs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from gspo_kernels.checks import (
    ValueChecks,
    check_finite_values,
    check_float,
    check_integer,
    check_labels,
    check_num_items,
    check_same_device,
    check_tensor,
    first_true,
    host_reads_allowed,
)
from gspo_kernels.precision import upcast


@dataclass(frozen=True)
class TokenBatch:
    """Where the ``N`` tokens of a batch belong.

    Attributes:
        mask: ``[N]`` float32, 1 for tokens that count, 0 otherwise.
        seq_index: ``[N]`` int64, the response each token belongs to (always in ``[0, S)``).
        cu_seqlens: ``[S + 1]`` int32, response boundaries (``arange(0, B*T+1, T)`` when padded).
        num_seqs: ``S``.
        token_shape: ``(B, T)`` for the padded layout, ``(N,)`` for the packed one.
        counted: ``[N]`` bool, ``mask > 0`` (a view of the caller's mask when it is bool: no op); None when
            the batch was built without it.
    """

    mask: Tensor
    seq_index: Tensor
    cu_seqlens: Tensor
    num_seqs: int
    token_shape: tuple
    counted: Optional[Tensor] = None


@dataclass(frozen=True)
class HostLayout:
    """The responses' boundaries and what each one holds, read to the host once per call (with the value
    checks' sync), so that a backend can plan its work without reading the device again.

    Attributes:
        cu_seqlens: ``S + 1`` ints, the response boundaries in tokens.
        counted: ``S`` ints, the unmasked tokens of each response.
        advantaged: ``S`` ints, the unmasked tokens of each response whose advantage is not zero (a response
            with none gets no policy-gradient term: only a KL or entropy term can give its tokens a gradient).
        on_device: the same two rows, ``[2, S]`` int64, on the tensors' device.
    """

    cu_seqlens: List[int]
    counted: List[int]
    advantaged: List[int]
    on_device: Tensor  # [2, S] int64: ``counted`` and ``advantaged`` where they were computed


@dataclass(frozen=True)
class LossTensors:
    """The loss tensors of one call as the caller gave them (before any check), built once by the public
    function and passed down to :func:`prepare_loss_inputs` (the token-layout tensor, labels or given log-probs,
    travels beside it)."""

    advantages: Tensor
    old_logprobs: Optional[Tensor] = None
    mask: Optional[Tensor] = None
    cu_seqlens: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    is_ratio: Optional[Tensor] = None
    num_items_in_batch: Union[None, int, float, Tensor] = None
    rollout_logprobs: Optional[Tensor] = None
    logprobs_out: Optional[Tensor] = None  # an output: receives the detached per-token log-probs (checked by the caller)


@dataclass(frozen=True)
class LossInputs:
    """Validated, flattened loss inputs: per-token tensors ``[N]``, fp16/bf16 upcast to fp32, fp64 kept."""

    labels: Optional[Tensor]  # [N] int64, in [0, V) everywhere (masked positions set to 0); None: log-probs given
    batch: TokenBatch
    advantages: Tensor  # [S] (per response) or [N] (per token); fp32, or fp64 when given fp64
    advantages_per_token: bool
    old_logprobs: Optional[Tensor]
    ref_logprobs: Optional[Tensor]
    is_ratio: Optional[Tensor]  # [N], per-sequence ratios already broadcast to tokens
    num_items_in_batch: Optional[Tensor]  # 0-dim float32, finite and > 0
    rollout_logprobs: Optional[Tensor] = None  # [N], the inference engine's log-probs of the sampled tokens
    host: Optional[HostLayout] = None  # read with the checks when asked (``host_layout=True``) and allowed
    logprobs_out: Optional[Tensor] = None  # [N] view of the caller's output tensor: the detached log-probs, 0 where
    #                                        not counted (written by the pipeline, or by a backend's fused loss)


# ---------------------------------------------------------------------------------------------
# The token layout, labels, mask, num_items_in_batch.
# ---------------------------------------------------------------------------------------------


def flatten_token_layout(
    labels: Tensor,
    *,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    checks: Optional[ValueChecks] = None,
    name: str = "labels",
) -> TokenBatch:
    """Validate the token layout and build the :class:`TokenBatch`.

    Value rules (``mask`` only 0/1, ``cu_seqlens`` from 0 to ``N`` non-decreasing) are added to ``checks``;
    without ``checks`` they run before returning.
    """
    own = checks is None
    checks = ValueChecks() if own else checks
    if name == "labels":
        labels = check_integer("labels", labels)
    device = check_same_device(**{name: labels}, mask=mask, cu_seqlens=cu_seqlens)
    if cu_seqlens is None:
        if labels.dim() != 2:
            raise ValueError(
                f"{name} must be [B, T] for the padded layout (or [N] with cu_seqlens for the packed one), "
                f"got shape {tuple(labels.shape)}"
            )
        B, T = labels.shape
        token_mask, counted = _token_mask(mask, (B, T), device, checks)
        cu, seq_index = _padded_layout(B, T, device)
        batch = TokenBatch(token_mask.reshape(-1), seq_index, cu, B, (B, T), counted.reshape(-1))
    else:
        batch = _packed_layout(labels, mask, check_tensor("cu_seqlens", cu_seqlens), checks, name)
    if own:
        checks.run()
    return batch


def _packed_layout(labels: Tensor, mask: Optional[Tensor], cu_seqlens: Tensor, checks: ValueChecks,
                   name: str) -> TokenBatch:
    device = labels.device
    if labels.dim() != 1:
        raise ValueError(f"{name} must be [N] when cu_seqlens is given (packed layout), got shape {tuple(labels.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [S + 1], got shape {tuple(cu_seqlens.shape)}")
    N = labels.shape[0]
    S = cu_seqlens.numel() - 1
    if S == 0 and N > 0:
        raise ValueError(f"cu_seqlens = [0] describes no response but {name} holds N = {N} tokens")
    token_mask, counted = _token_mask(mask, (N,), device, checks)
    cu = cu_seqlens.detach().to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    checks.add(cu[0] != 0, "cu_seqlens must start at 0",
               lambda: f"cu_seqlens must start at 0, got cu_seqlens[0] = {int(cu[0])}")
    checks.add((lengths < 0).any(), "cu_seqlens must be non-decreasing",
               lambda: (lambda i: f"cu_seqlens must be non-decreasing, but cu_seqlens[{i + 1}] < cu_seqlens[{i}]")(
                   first_true(lengths < 0)))
    checks.add(cu[-1] != N, f"cu_seqlens must end at N (the number of {name})",
               lambda: f"cu_seqlens must end at N = {N} (the number of {name}), got cu_seqlens[-1] = {int(cu[-1])}")
    # Token t belongs to the response i with cu[i] <= t < cu[i + 1]. searchsorted + clamp keeps every index
    # in [0, S) whatever cu_seqlens holds, so nothing downstream can index out of bounds even when the
    # value checks above are device asserts that have not fired yet.
    positions = torch.arange(N, device=device, dtype=torch.int64)
    seq_index = torch.searchsorted(cu[1:].contiguous(), positions, right=True).clamp_(max=max(S - 1, 0))
    return TokenBatch(token_mask, seq_index, cu.to(torch.int32), S, (N,), counted)


# The padded layout's ``(cu_seqlens, seq_index)`` depend only on ``(B, T, device)``: kept per shape (bounded,
# cleared when full) so that a call with a shape seen before dispatches no op for them. Nothing writes into
# these tensors. Built afresh (never kept) where their values may not exist yet or may not outlive the call:
# under torch.compile tracing or CUDA-graph capture (a captured kernel runs only at replay) and in inference mode
# (an inference tensor cannot be saved for a later backward).
_PADDED_LAYOUTS: dict = {}
_PADDED_LAYOUTS_MAX = 32


def _padded_layout(B: int, T: int, device: torch.device) -> Tuple[Tensor, Tensor]:
    """``(cu_seqlens [B + 1] int32, seq_index [B * T] int64)`` of the padded layout ``[B, T]``."""
    key = (B, T, device)
    # (no lookup while tracing: a dict keyed by the sizes would make torch.compile specialize on them)
    cached = _PADDED_LAYOUTS.get(key) if host_reads_allowed() else None
    if cached is not None:
        return cached
    cu = torch.arange(0, B * T + 1, max(T, 1), device=device, dtype=torch.int32)[: B + 1]
    if T == 0:
        cu = torch.zeros(B + 1, device=device, dtype=torch.int32)
    seq_index = torch.arange(B, device=device).repeat_interleave(T)
    if host_reads_allowed() and not torch.is_inference_mode_enabled():
        if len(_PADDED_LAYOUTS) >= _PADDED_LAYOUTS_MAX:
            _PADDED_LAYOUTS.clear()
        _PADDED_LAYOUTS[key] = (cu, seq_index)
    return cu, seq_index


def _token_mask(mask: Optional[Tensor], shape: tuple, device: torch.device,
                checks: ValueChecks) -> Tuple[Tensor, Tensor]:
    """``(the 0/1 float32 token mask, mask > 0 as bool)``, both ``shape``; ``mask`` may be bool, integer or float,
    holding only 0 and 1 (a bool mask is itself the second: no op)."""
    if mask is None:
        ones = torch.ones(shape, device=device, dtype=torch.float32)
        return ones, ones > 0
    mask = check_tensor("mask", mask)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask must have shape {tuple(shape)} (like labels), got {tuple(mask.shape)}")
    if mask.dtype.is_complex:
        raise TypeError(f"mask must be bool, integer or float (0/1), got {mask.dtype}")
    mask = mask.detach()
    if mask.dtype == torch.bool:  # True / False are exactly 1.0 / 0.0: one cast, no compare
        return mask.to(torch.float32), mask
    not_binary = (mask != 0) & (mask != 1)  # NaN included
    checks.add(
        not_binary.any(),
        "mask must hold only 0 and 1 (bool, integer or float)",
        lambda: f"mask must hold only 0 and 1 (bool, integer or float); flat position "
        f"{first_true(not_binary)} holds {mask.reshape(-1)[first_true(not_binary)].item()}",
    )
    counted = (mask != 0).reshape(shape)
    return counted.to(torch.float32), counted



def _per_token(name: str, value: Optional[Tensor], batch: TokenBatch) -> Optional[Tensor]:
    if value is None:
        return None
    value = check_float(name, value)
    if tuple(value.shape) != tuple(batch.token_shape):
        raise ValueError(f"{name} must have the token shape {tuple(batch.token_shape)}, got {tuple(value.shape)}")
    return upcast(value.detach().reshape(-1))


def prepare_loss_inputs(
    labels: Tensor,
    vocab_size: Optional[int],
    tensors: LossTensors,
    *,
    beta: float = 0.0,
    rollout_correction: Optional[str] = None,
    check_finite: bool = False,
    checks: Optional[ValueChecks] = None,
    host_layout: bool = False,
) -> LossInputs:
    """Validate every loss input against the layout and flatten it to ``[N]`` / ``[S]``.

    ``tensors``: the caller's loss tensors as given (:class:`LossTensors`).
    ``labels``: the sampled token ids (``[B, T]`` / ``[N]``, in ``[0, vocab_size)`` where unmasked); with
    ``vocab_size=None`` it is instead the caller's per-token log-probs (:func:`gspo_kernels.policy_loss`),
    which carry the layout only, and ``LossInputs.labels`` is None.
    ``beta`` (the KL weight of the config) says whether ``ref_logprobs`` is required; ``rollout_correction``
    (the config's) whether ``rollout_logprobs`` is (and that ``is_ratio`` is refused).
    ``rollout_logprobs`` is never checked for finiteness: a NaN there means "not scored by the engine" (no
    correction for that token, as in TRL; docs/policies.md).
    ``check_finite``: also require the float inputs to be finite at unmasked positions. The value checks
    run before returning, with those already in ``checks`` (one host sync for all of them).
    ``host_layout``: also read the :class:`HostLayout` in that sync (``LossInputs.host``; None where no host read
    is allowed: under ``torch.compile`` or CUDA-graph capture).
    """
    advantages, old_logprobs, mask, cu_seqlens = tensors.advantages, tensors.old_logprobs, tensors.mask, tensors.cu_seqlens
    ref_logprobs, is_ratio, rollout_logprobs = tensors.ref_logprobs, tensors.is_ratio, tensors.rollout_logprobs
    name = "labels" if vocab_size is not None else "logprobs"
    check_same_device(**{name: labels}, advantages=advantages, old_logprobs=old_logprobs, mask=mask,
                      cu_seqlens=cu_seqlens, ref_logprobs=ref_logprobs, is_ratio=is_ratio,
                      rollout_logprobs=rollout_logprobs)
    checks = ValueChecks() if checks is None else checks
    batch = flatten_token_layout(labels, mask=mask, cu_seqlens=cu_seqlens, checks=checks, name=name)
    device = labels.device
    counted = batch.counted
    flat_labels = None if vocab_size is None else check_labels(labels, vocab_size, checks, counted)

    advantages = check_float("advantages", advantages)
    S = batch.num_seqs
    if tuple(advantages.shape) == (S,):
        per_token = False
    elif tuple(advantages.shape) == tuple(batch.token_shape):
        per_token = True
    else:
        raise ValueError(
            f"advantages must be [S] = ({S},) (one per response) or the token shape "
            f"{tuple(batch.token_shape)} (one per token), got {tuple(advantages.shape)}"
        )
    adv = upcast(advantages.detach().reshape(-1))

    old = _per_token("old_logprobs", old_logprobs, batch)
    ref = _per_token("ref_logprobs", ref_logprobs, batch)
    if beta > 0 and ref is None:
        raise ValueError("ref_logprobs is required when beta > 0 (the KL term needs the reference log-probs)")

    rollout = _per_token("rollout_logprobs", rollout_logprobs, batch)
    if rollout_correction is not None and rollout is None:
        raise ValueError(f"rollout_logprobs is required when config.rollout_correction = {rollout_correction!r} "
                         "(the correction weights are computed from the inference engine's log-probs)")
    if rollout_correction is not None and is_ratio is not None:
        raise ValueError("is_ratio and config.rollout_correction are exclusive: pass rollout_logprobs and let the "
                         "library compute the correction, or pass a ready-made is_ratio without rollout_correction")

    ratio = None
    if is_ratio is not None:
        is_ratio = check_float("is_ratio", is_ratio)
        if tuple(is_ratio.shape) == tuple(batch.token_shape):
            ratio = upcast(is_ratio.detach().reshape(-1))
        elif tuple(is_ratio.shape) in ((S,), (S, 1)):
            ratio = upcast(is_ratio.detach().reshape(-1))[batch.seq_index]
        else:
            raise ValueError(
                f"is_ratio must be per token {tuple(batch.token_shape)} or per response ({S},), "
                f"got {tuple(is_ratio.shape)}"
            )

    items = check_num_items(tensors.num_items_in_batch, device, checks)

    if check_finite:
        if per_token:
            check_finite_values("advantages", adv, checks, counted)
        else:  # the advantage of a response with at least one unmasked token
            has_tokens = torch.zeros(S, device=device).index_add_(0, batch.seq_index, batch.mask) > 0
            check_finite_values("advantages", adv, checks, has_tokens)
        for name, value in (("old_logprobs", old), ("ref_logprobs", ref if beta > 0 else None), ("is_ratio", ratio)):
            if value is not None:
                check_finite_values(name, value, checks, counted)
    if host_layout:
        has_adv = (adv != 0) & counted if per_token else (adv != 0)[batch.seq_index] & counted
        per_response = torch.zeros((2, S), device=device, dtype=torch.int64)
        per_response[0].index_add_(0, batch.seq_index, counted.to(torch.int64))
        per_response[1].index_add_(0, batch.seq_index, has_adv.to(torch.int64))
        if len(batch.token_shape) != 2:  # packed: the boundaries are read too (padded ones are known)
            checks.fetch("cu_seqlens", batch.cu_seqlens)
        checks.fetch("per_response", per_response)
    checks.run()
    host = None
    if host_layout and "per_response" in checks.fetched:
        per = checks.fetched["per_response"]
        if len(batch.token_shape) == 2:
            T = batch.token_shape[1]
            cu = [i * T for i in range(S + 1)]
        else:
            cu = checks.fetched["cu_seqlens"]
        host = HostLayout(cu, per[:S], per[S:], per_response)
    return LossInputs(labels=flat_labels, batch=batch, advantages=adv, advantages_per_token=per_token, old_logprobs=old,
                      ref_logprobs=ref, is_ratio=ratio, num_items_in_batch=items, rollout_logprobs=rollout, host=host,
                      logprobs_out=None if tensors.logprobs_out is None else tensors.logprobs_out.view(-1))
