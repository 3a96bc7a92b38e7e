"""The GSPO / GRPO loss (every objective of the library) from a Megatron-core output layer's input."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from torch import Tensor

import gspo_kernels as gk
from gspo_kernels.config import GSPOConfig
from gspo_kernels.integrations.megatron import context_parallel as cpar
from gspo_kernels.integrations.megatron.head import full_sequence, vocab_parallel
from gspo_kernels.integrations.megatron.logprobs import checked_head
from gspo_kernels.objectives.stage import LossOutput

Scalar = Union[None, int, float, Tensor]


@dataclasses.dataclass(frozen=True)
class HeadOptions:
    """The per-token stage's options of a call (those of :func:`gspo_kernels.linear_logprobs`)."""

    backend: str = "auto"
    fp32_head: bool = False
    check_finite: bool = False
    memory_budget: Optional[int] = None
    batch_invariant: bool = False


def _flat(t: Optional[Tensor], token_shape) -> Optional[Tensor]:
    """A token-shaped tensor (``[1, T]`` in megatron's packed layout) as the library's packed ``[T]`` (a view when
    it can be); anything else (per-sequence ``[S]``) unchanged."""
    if t is None or tuple(t.shape) != tuple(token_shape):
        return t
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def fused_linear_gspo_loss(
    hidden: Tensor,
    head,
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
    fp32_head: bool = False,
    check_finite: bool = False,
    memory_budget: Optional[int] = None,
    batch_invariant: bool = False,
    logprobs_out: Optional[Tensor] = None,
    cp_group=None,
) -> LossOutput:
    """:func:`gspo_kernels.fused_linear_gspo_loss` on a Megatron-core output layer, in megatron's layouts.

    Args:
        hidden: the output layer's input, sequence first: ``[S, B, H]`` (padded layout, row ``b`` of ``labels`` is one
            response), or ``[T, 1, H]`` with ``cu_seqlens`` (packed ``thd``, as with megatron's ``PackedSeqParams``);
            the sequence dimension divided by ``tp`` for a sequence-parallel head (read from the head).
        head: a megatron ``GPTModel`` (or a wrapper of one) or ``ColumnParallelLinear``, as in :func:`linear_logprobs`.
        labels: ``[B, S]`` or ``[1, T]`` global token ids (garbage allowed where ``mask`` is 0).
        advantages: per response (``[B]`` / ``[S_seq]``) or per token (labels' shape).
        old_logprobs, mask, ref_logprobs, rollout_logprobs, logprobs_out: labels' shape; is_ratio: labels' shape or
            per response; cu_seqlens: ``[S_seq + 1]`` (packed). Their meaning, ``num_items_in_batch``, ``config`` (its
            temperature and soft cap included) and the head options are those of
            :func:`gspo_kernels.fused_linear_gspo_loss`.
        cp_group: the context-parallel process group (megatron's ``get_context_parallel_group()``) when each rank holds
            part of every sequence (its own tokens and ``cu_seqlens``; the same sequences in the same order on every
            rank). The sequence-level terms are those of the whole sequences; the ranks' losses add up to the loss of
            the whole batch (see :mod:`.context_parallel` for the scaling under megatron's gradient averaging).
    Returns:
        ``LossOutput(loss, metrics)`` as :func:`gspo_kernels.fused_linear_gspo_loss` returns it, the same on every
        tensor-parallel rank (with ``cp_group``: ``loss`` is this rank's share, the metrics those of the whole batch).

    Every rank of the tensor-parallel (and context-parallel) group calls it together. Bad input raises the same
    ``ValueError`` on every rank, naming the argument.
    """
    counted = None if mask is None or tuple(mask.shape) != tuple(labels.shape) else mask != 0
    cp = cp_group is not None and cpar.group_size(cp_group) > 1
    resolved = checked_head(hidden, head, labels, counted, more_groups=[cp_group] if cp else [])
    full = full_sequence(hidden, resolved)
    options = HeadOptions(backend=backend, fp32_head=fp32_head, check_finite=check_finite,
                          memory_budget=memory_budget, batch_invariant=batch_invariant)
    tensors = cpar.TokenTensors(labels=labels, advantages=advantages, old_logprobs=old_logprobs, mask=mask,
                                cu_seqlens=cu_seqlens, ref_logprobs=ref_logprobs, is_ratio=is_ratio,
                                rollout_logprobs=rollout_logprobs, logprobs_out=logprobs_out,
                                num_items_in_batch=num_items_in_batch)
    if cp:
        return cpar.context_parallel_loss(full, resolved, tensors, config, options, cp_group)
    packed = cu_seqlens is not None
    shape = labels.shape
    rows = full.reshape(-1, full.shape[-1]) if packed else full.transpose(0, 1)  # [T, H] (a view) or [B, S, H]
    flat = (lambda t: _flat(t, shape)) if packed else (lambda t: t)  # noqa: E731
    return gk.fused_linear_gspo_loss(
        rows, resolved.weight, flat(labels), flat(advantages), flat(old_logprobs), bias=resolved.bias,
        mask=flat(mask), cu_seqlens=cu_seqlens, ref_logprobs=flat(ref_logprobs), is_ratio=flat(is_ratio),
        num_items_in_batch=num_items_in_batch, rollout_logprobs=flat(rollout_logprobs), config=config,
        backend=backend, vocab_parallel=vocab_parallel(resolved), fp32_head=fp32_head, check_finite=check_finite,
        memory_budget=memory_budget, batch_invariant=batch_invariant, logprobs_out=flat(logprobs_out))
