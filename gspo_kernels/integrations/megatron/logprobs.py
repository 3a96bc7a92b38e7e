"""Per-token log-probs and entropies from a Megatron-core output layer's input, without the logits."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

from torch import Tensor

import gspo_kernels as gk
from gspo_kernels.integrations.megatron import agree as ag
from gspo_kernels.integrations.megatron.head import MegatronHead, full_sequence, resolve_head, vocab_parallel


def head_problem(hidden: Tensor, head: MegatronHead, labels: Tensor, counted: Optional[Tensor],
                 sequence_first: bool = True) -> Optional[ag.Problem]:
    """This rank's first problem with ``hidden`` / ``head`` / ``labels`` (None when they fit), checked before any
    collective (the callers then :func:`~.agree.agree` on it). ``hidden``: the output layer's input as the caller
    passes it (``[S(/tp), B, H]``); ``labels``: ``[B, S]``; ``counted``: the positions whose labels must be valid
    (labels' shape, bool) or None for all of them."""
    rank, weight = head.rank, head.weight
    if head.vocab_size is not None and weight.shape[0] * head.tp != head.vocab_size:
        return ag.Problem(ag.code(ag._shard), (rank, weight.shape[0], head.vocab_size, head.tp))
    if hidden.dim() != 3 or labels.dim() != 2:
        seq, batch = (hidden.shape[0] if hidden.dim() else 0), (hidden.shape[1] if hidden.dim() > 1 else 0)
        return ag.Problem(ag.code(ag._hidden_len), (rank, seq, batch, head.tp, *(list(labels.shape) + [0, 0])[:2]))
    if hidden.shape[-1] != weight.shape[1]:
        return ag.Problem(ag.code(ag._hidden_width), (rank, hidden.shape[-1], *weight.shape))
    gathered = hidden.shape[0] * (head.tp if head.sequence_parallel else 1)
    if (gathered, hidden.shape[1]) != (labels.shape[1], labels.shape[0]):
        return ag.Problem(ag.code(ag._hidden_len), (rank, gathered, hidden.shape[1], head.tp if head.sequence_parallel
                                                    else 1, labels.shape[0], labels.shape[1]))
    vocab = head.vocab_size if head.vocab_size is not None else weight.shape[0] * head.tp
    kept = labels if counted is None else labels[counted]
    if kept.numel():
        low, high = int(kept.min()), int(kept.max())
        if low < 0 or high >= vocab:
            return ag.Problem(ag.code(ag._labels), (rank, low, high, vocab))
    return None


def checked_head(hidden: Tensor, head, labels: Tensor, counted: Optional[Tensor],
                 more_groups: Sequence = (), problem: Optional[ag.Problem] = None) -> MegatronHead:
    """``head`` resolved and checked with ``hidden`` and ``labels`` on every rank of its tensor-parallel group (and
    of ``more_groups``): a problem on any rank raises the same ``ValueError`` on all of them. ``problem``: one the
    caller found already (it travels in the same collective)."""
    if not isinstance(labels, Tensor) or labels.dtype.is_floating_point or labels.is_complex():
        raise TypeError(f"labels must be an integer tensor [B, S], got {type(labels).__name__}"
                        f"{'' if not isinstance(labels, Tensor) else ' of ' + str(labels.dtype)}")
    if not isinstance(hidden, Tensor) or not hidden.is_floating_point():
        raise TypeError("hidden must be a floating-point tensor [S, B, H] (the output layer's input)")
    resolved = resolve_head(head)
    problem = problem or head_problem(hidden, resolved, labels, counted)
    weight = resolved.weight
    ag.agree([resolved.group, *more_groups], problem,
             compare=[(ag._shards_differ, (weight.shape[0], weight.shape[1]))])
    return resolved


def linear_logprobs(
    hidden: Tensor,
    head,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    fp32_head: bool = False,
    memory_budget: Optional[int] = None,
    batch_invariant: bool = False,
    final_logit_softcapping: Optional[float] = None,
    check_finite: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Per-token log-probs (and entropies) of a Megatron-core model's output layer, without the logits.

    Args:
        hidden: the output layer's input in megatron's sequence-first layout, ``[S, B, H]``; ``[S / tp, B, H]``
            when the head is sequence-parallel (read from the head). Any float dtype.
        head: a megatron ``GPTModel`` (or a wrapper of one: its output layer, or the shared embedding weight when
            ``share_embeddings_and_output_weights``) or a ``ColumnParallelLinear`` (``gather_output=False``).
        labels: ``[B, S]`` integer global token ids in ``[0, V)`` (``V``: megatron's padded vocabulary), megatron's
            layout (position ``s`` of ``hidden`` predicts ``labels[:, s]``).
        temperature, return_entropy, backend, fp32_head, memory_budget, batch_invariant, final_logit_softcapping,
        check_finite: as in :func:`gspo_kernels.linear_logprobs`.
    Returns:
        ``[B, S]`` float32 log-probs (and entropies when ``return_entropy``), the same on every tensor-parallel
        rank. Gradients reach ``hidden`` (summed over the tensor-parallel group, or reduce-scattered for a
        sequence-parallel head, as megatron's output layer does) and this rank's weight shard (and bias).

    Every rank of the tensor-parallel group must call it together (it runs collectives). Bad input raises the same
    ``ValueError`` on every rank, naming the argument.
    """
    resolved = checked_head(hidden, head, labels, None)
    full = full_sequence(hidden, resolved)
    out = gk.linear_logprobs(full, resolved.weight, labels.t(), bias=resolved.bias, temperature=temperature,
                             return_entropy=return_entropy, backend=backend, vocab_parallel=vocab_parallel(resolved),
                             fp32_head=fp32_head, check_finite=check_finite, memory_budget=memory_budget,
                             batch_invariant=batch_invariant, final_logit_softcapping=final_logit_softcapping)
    if return_entropy:
        return out[0].t().contiguous(), out[1].t().contiguous()
    return out.t().contiguous()

