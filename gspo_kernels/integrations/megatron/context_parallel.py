"""Context parallelism: each rank holds part of every sequence; the sequence-level terms are the whole sequences'.

Each context-parallel rank passes its own tokens (any split: contiguous, or megatron's load-balanced two chunks per
sequence) and its own ``cu_seqlens``, the same sequences in the same order on every rank; in the padded layout
(``hidden [S_r, B, H]``, ``labels [B, S_r]``) each row is a sequence and each rank holds its positions of every row.
The route:

1. Each rank computes its tokens' log-probs and entropies from its hidden states (the vocabulary-parallel head, no
   logits): ``O(T_r * H)`` work, nothing of size ``H`` or ``V`` leaves the rank.
2. The per-token scalars are all-gathered over the group: the log-probs and entropies with an autograd all-gather
   whose backward sums the gradient over the group and keeps the rank's own slice (a reduce-scatter), and the
   per-token inputs (old / reference / rollout log-probs, mask, per-token advantages and ``is_ratio``) without
   gradient: ``O(T)`` floats in all, never ``O(T * H)`` or ``O(T * V)``. Every rank then holds every sequence whole
   (its tokens grouped by rank: no objective of the library depends on the order of a sequence's tokens).
3. Every rank runs the library's sequence stage (:func:`gspo_kernels.policy_loss`) on the whole sequences: the
   same loss ``L`` and metrics on every rank, GSPO's length-normalized log-ratio, the sequence-level clip and the
   aggregations' counts those of the whole sequences.
4. Each rank returns ``L / cp``. The ranks' losses add up to ``L``; the gradient reaching each rank's log-probs is
   ``cp * (dL/dlogp) / cp`` (the all-gather's backward sums the ``cp`` ranks' identical ``dL/dlogp / cp``), i.e.
   exactly the one-process gradient at the rank's tokens; so each rank's weight-shard gradient is its tokens' share
   and the shares summed over the group are the one-process weight gradient.

Megatron's gradient reduction: megatron's ``DistributedDataParallel`` *averages* the gradients over the data- and
context-parallel ranks (``dp * cp``). Megatron-LM's own GPT loss therefore multiplies each context-parallel rank's
loss by ``cp`` before the backward; do the same with this loss (``loss * cp``: its value is then ``L`` itself on
every rank). The averaged gradient is then the data-parallel mean of the one-process gradients, as without context
parallelism. (With megatron's ``calculate_per_token_loss``, where the gradients are summed and divided by the token
count instead, use ``L / cp`` as returned and count each token once.)
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

import gspo_kernels as gk
from gspo_kernels.integrations import adapter
from gspo_kernels.integrations.megatron import agree as ag
from gspo_kernels.integrations.megatron.head import MegatronHead, vocab_parallel
from gspo_kernels.objectives.stage import LossOutput


@dataclasses.dataclass(frozen=True)
class TokenTensors:
    """The loss tensors of one call, in megatron's layout (``labels`` ``[B, S]`` or ``[1, T]``)."""

    labels: Tensor
    advantages: Tensor
    old_logprobs: Optional[Tensor] = None
    mask: Optional[Tensor] = None
    cu_seqlens: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    is_ratio: Optional[Tensor] = None
    rollout_logprobs: Optional[Tensor] = None
    logprobs_out: Optional[Tensor] = None
    num_items_in_batch: object = None


# The per-token inputs gathered without gradient, in this order (advantages and is_ratio only when per token).
# Megatron's loss options are the library's own GSPOConfig, passed as it is: the declaration maps no option, and
# a call without a config gets the defaults
MEGATRON = adapter.Declaration("Megatron-core")
_TOKEN_INPUTS = ("old_logprobs", "mask", "ref_logprobs", "rollout_logprobs", "advantages", "is_ratio")


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _device(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _all_gather(group, t: Tensor) -> List[Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


class _GatherTokens(torch.autograd.Function):
    """``x [k, n_r]`` (this rank's tokens) -> ``[k, sum_r n_r]`` (every rank's, in rank order). Backward: the
    gradient summed over the group, this rank's columns kept (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: Tensor, group, counts: List[int]):
        rank = dist.get_rank(group)
        width = max(counts)
        padded = x.new_zeros(x.shape[0], width)
        padded[:, :x.shape[1]] = x
        parts = _all_gather(group, padded)
        ctx.group, ctx.counts, ctx.rank = group, counts, rank
        return torch.cat([p[:, :n] for p, n in zip(parts, counts)], dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start = sum(ctx.counts[:ctx.rank])
        return grad[:, start:start + ctx.counts[ctx.rank]], None, None


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Every rank's split of the batch: ``lengths[r][s]`` tokens of sequence ``s`` on rank ``r``."""

    lengths: List[List[int]]

    @property
    def counts(self) -> List[int]:
        return [sum(row) for row in self.lengths]

    def whole_order(self) -> Tensor:
        """Index into the rank-ordered gather that lists each sequence's tokens together (rank 0's part first)."""
        starts = [0]
        for n in self.counts[:-1]:
            starts.append(starts[-1] + n)
        index = []
        offsets = [list(_cumsum(row)) for row in self.lengths]
        for s in range(len(self.lengths[0])):
            for r, row in enumerate(self.lengths):
                lo = starts[r] + offsets[r][s]
                index.append(torch.arange(lo, lo + row[s]))
        return torch.cat(index) if index else torch.zeros(0, dtype=torch.int64)

    def whole_cu_seqlens(self) -> Tensor:
        per_seq = [sum(row[s] for row in self.lengths) for s in range(len(self.lengths[0]))]
        return torch.tensor([0, *_cumsum(per_seq)[1:]], dtype=torch.int64)


def _cumsum(values: List[int]) -> List[int]:
    out, total = [0], 0
    for v in values:
        total += v
        out.append(total)
    return out


def _rank_cu_seqlens(tensors: TokenTensors) -> Tensor:
    """This rank's ``cu_seqlens`` (the padded layout's rows as sequences of ``S_r`` tokens each)."""
    if tensors.cu_seqlens is not None:
        return tensors.cu_seqlens.detach().to("cpu", torch.int64).reshape(-1)
    rows, width = tensors.labels.shape
    return torch.arange(rows + 1, dtype=torch.int64) * width


def _agree_layout(group, tensors: TokenTensors, per_sequence: dict) -> _Layout:
    """The ranks' layouts, after checking on every rank that they hold the same sequences: the same count, and the
    same per-sequence inputs (``per_sequence``: name -> ``[n]`` tensor, e.g. the advantages)."""
    cu = _rank_cu_seqlens(tensors)
    n = cu.numel() - 1
    ag.agree([group], None, compare=[(ag._cp_count, (n,))])
    device = _device(group)
    rows = _all_gather(group, cu.to(device))
    lengths = [(r[1:] - r[:-1]).tolist() for r in (row.cpu() for row in rows)]
    for name, value in per_sequence.items():
        mine = value.detach().to(device, torch.float64).reshape(-1)
        for k, other in enumerate(_all_gather(group, mine)):
            if not torch.equal(other.nan_to_num(), mine.nan_to_num()):
                s = int(torch.nonzero(other.nan_to_num() != mine.nan_to_num())[0])
                raise ValueError(ag.sequence_input_differs(name, dist.get_rank(group), s, k))
    return _Layout(lengths)


def _rank_tokens(tensors: TokenTensors, name: str, shape) -> Optional[Tensor]:
    value = getattr(tensors, name)
    if value is None or tuple(value.shape) != tuple(shape):
        return None
    return value


def context_parallel_loss(full: Tensor, head: MegatronHead, tensors: TokenTensors, config, options,
                          group) -> LossOutput:
    """The loss of one context-parallel rank (see the module docstring). ``full``: ``[S_r, B, H]`` or ``[T_r, 1, H]``
    (after any sequence-parallel gather); ``options``: the call's :class:`~.loss.HeadOptions`."""
    config = adapter.build_config(MEGATRON, {}) if config is None else config
    labels = tensors.labels
    shape = tuple(labels.shape)
    counted = None if _rank_tokens(tensors, "mask", shape) is None else tensors.mask != 0
    per_sequence = {name: getattr(tensors, name) for name in ("advantages", "is_ratio")
                    if getattr(tensors, name) is not None and tuple(getattr(tensors, name).shape) != shape}
    layout = _agree_layout(group, tensors, per_sequence)
    safe = labels if counted is None else torch.where(counted, labels, torch.zeros_like(labels))
    logp, entropy = gk.linear_logprobs(
        full, head.weight, safe.t(), bias=head.bias, temperature=config.temperature,
        final_logit_softcapping=config.final_logit_softcapping, return_entropy=True, backend=options.backend,
        vocab_parallel=vocab_parallel(head), fp32_head=options.fp32_head, check_finite=options.check_finite,
        memory_budget=options.memory_budget, batch_invariant=options.batch_invariant)
    logp, entropy = logp.t().reshape(-1), entropy.t().reshape(-1)  # this rank's tokens, sequence by sequence
    if tensors.logprobs_out is not None:
        kept = logp.detach() if counted is None else torch.where(counted.reshape(-1), logp.detach(), 0)
        tensors.logprobs_out.copy_(kept.reshape(shape))
    order = layout.whole_order().to(logp.device)
    whole = _GatherTokens.apply(torch.stack([logp, entropy]), group, layout.counts).index_select(1, order)
    inputs = {}
    present = [name for name in _TOKEN_INPUTS if _rank_tokens(tensors, name, shape) is not None]
    if present:
        stacked = torch.stack([_rank_tokens(tensors, name, shape).detach().reshape(-1).to(torch.float64)
                               for name in present])
        gathered = _GatherTokens.apply(stacked, group, layout.counts).index_select(1, order)
        inputs = {name: gathered[i] for i, name in enumerate(present)}
    dtype = logp.dtype
    as_float = {name: inputs[name].to(dtype) for name in inputs if name != "mask"}
    out = gk.policy_loss(
        whole[0], as_float.get("advantages", per_sequence.get("advantages")), as_float.get("old_logprobs"),
        mask=inputs.get("mask"), cu_seqlens=layout.whole_cu_seqlens().to(logp.device),
        ref_logprobs=as_float.get("ref_logprobs"), is_ratio=as_float.get("is_ratio", per_sequence.get("is_ratio")),
        entropy=whole[1], num_items_in_batch=tensors.num_items_in_batch,
        rollout_logprobs=as_float.get("rollout_logprobs"), config=config, backend=options.backend,
        check_finite=options.check_finite)
    return LossOutput(out.loss / dist.get_world_size(group), out.metrics)
