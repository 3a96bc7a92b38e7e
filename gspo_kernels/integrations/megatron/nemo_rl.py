"""NeMo-RL's Megatron log-prob functions with NeMo-RL's own signatures, computed by the library.

NeMo-RL (``nemo_rl.distributed.model_utils``) turns a Megatron policy's output into next-token log-probs with

* ``from_parallel_hidden_states_to_logprobs`` - its fused path (``policy.megatron_cfg.use_fused_linear_logprobs``):
  the decoder's sequence-parallel hidden states and the output layer's ``[V/tp, H]`` weight shard, logits formed
  chunk by chunk; no entropy, and context parallelism refused;
* ``from_parallel_logits_to_logprobs`` - its default path: the ``[B, S/cp, V/tp]`` logits, whose backward keeps a
  full fp32 softmax of them.

The two functions here take the same arguments, in the same order, and return the same ``[B, S - 1]`` float32
log-probs of ``target[:, 1:]``, equal on every tensor-parallel rank, with the same gradients (the hidden states'
gradient reduce-scattered over the sequence-parallel group, this rank's weight or logits shard's gradient), from
:func:`gspo_kernels.linear_logprobs` / :func:`gspo_kernels.token_logprobs` on the rank's vocabulary shard
(:class:`gspo_kernels.VocabParallel`): no ``[*, V/tp]`` logits or softmax is ever formed or saved. In addition,
both take ``cp_group`` (NeMo-RL's load-balanced context-parallel layout, as its logits path) and
``return_entropy=True`` (the entropy of each position's distribution, shaped like the log-probs).

:func:`route_nemo_rl` puts them in place of NeMo-RL's, in every module that calls them, inside the process that
runs NeMo-RL's Megatron policy worker; see ``docs/megatron.md``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from gspo_kernels.loss import linear_logprobs, token_logprobs
from gspo_kernels.parallel import VocabParallel

LogProbs = Union[Tensor, Tuple[Tensor, Tensor]]

# NeMo-RL's modules that call (or bind at import time) the two functions replaced by route_nemo_rl
_NEMO_RL_TARGETS = (
    ("nemo_rl.distributed.model_utils", "from_parallel_hidden_states_to_logprobs"),
    ("nemo_rl.distributed.model_utils", "from_parallel_logits_to_logprobs"),
    ("nemo_rl.models.megatron.train", "from_parallel_logits_to_logprobs"),
)

_vocab_parallel_cache: Dict[Tuple[int, int, int, bool], VocabParallel] = {}


def from_parallel_hidden_states_to_logprobs(
    tensor_parallel_hidden_states: Tensor,
    output_weight_layer: Tensor,
    runtime_gather_output: Any,
    target: Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Optional[dist.ProcessGroup],
    inference_only: bool = False,
    cp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    *,
    return_entropy: bool = False,
) -> LogProbs:
    """NeMo-RL's ``from_parallel_hidden_states_to_logprobs``, without logits.

    Args:
        tensor_parallel_hidden_states: the decoder's output, sequence-first ``[S_local / tp, B, H]``: with more
            than one tensor-parallel rank the model is sequence-parallel (as NeMo-RL assumes: its function
            gathers them over ``tp_group``; here too, with megatron's gather, whose backward reduce-scatters the
            gradient as megatron's output layer does). ``S_local = S`` (or ``S`` padded) without context
            parallelism.
        output_weight_layer: this rank's ``[vocab_end_index - vocab_start_index, H]`` rows of the output layer (or
            of the tied embedding); its gradient is this shard's.
        runtime_gather_output: accepted for NeMo-RL's signature and not used (as in NeMo-RL).
        target: ``[B, S]`` global token ids, unshifted (the log-prob at ``t`` is of ``target[:, t + 1]``); with a
            context-parallel group, the whole sequence (NeMo-RL's logits-path convention).
        vocab_start_index, vocab_end_index: this rank's vocabulary rows.
        tp_group: the tensor-parallel group.
        inference_only: no autograd graph is kept.
        cp_group: the context-parallel group: each rank holds ``S_local = S_pad / cp`` positions in NeMo-RL's
            load-balanced order (chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``); the log-probs are all-gathered
            into sequence order and, as in NeMo-RL, their gradient is summed over the group before each rank
            takes its own positions.
        chunk_size: accepted for NeMo-RL's signature; the library picks its own tiling.
        return_entropy: also return the entropy of each position's distribution (not in NeMo-RL).
    Returns:
        ``[B, S - 1]`` float32 log-probs (and entropy), the same on every rank of ``tp_group`` and ``cp_group``.
    """
    del runtime_gather_output, chunk_size
    hidden = tensor_parallel_hidden_states
    if hidden.dim() != 3:
        raise ValueError(f"tensor_parallel_hidden_states must be [S, B, H] (sequence-first), got {tuple(hidden.shape)}")
    _check_target(target, hidden.shape[1], "tensor_parallel_hidden_states")
    tp = _size(tp_group)
    sequence_parallel = tp > 1  # NeMo-RL gathers the hidden states over the group whenever it has several ranks
    local_len = hidden.shape[0] * tp
    labels = _local_targets(target, local_len, cp_group, "tensor_parallel_hidden_states")  # checked before any
    with _grad_mode(inference_only):  # collective, so that a bad shape raises on every rank alike
        if sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
        vp = _vocab_parallel(tp_group, vocab_start_index, vocab_end_index, reduce_hidden_grad=not sequence_parallel)
        out = linear_logprobs(hidden.transpose(0, 1), output_weight_layer, labels, return_entropy=return_entropy,
                              vocab_parallel=vp)
        return _global_positions(out, target.shape[1], cp_group)


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: Tensor,
    target: Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Optional[dist.ProcessGroup],
    inference_only: bool = False,
    cp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    sampling_params: Any = None,
    *,
    return_entropy: bool = False,
) -> LogProbs:
    """NeMo-RL's ``from_parallel_logits_to_logprobs``: no fp32 softmax of the logits is kept for the backward.

    Args:
        vocab_parallel_logits: ``[B, S_local, vocab_end_index - vocab_start_index]`` (any float dtype); its
            gradient is this shard's.
        target: ``[B, S]`` global token ids, unshifted; the whole sequence with a context-parallel group.
        vocab_start_index, vocab_end_index, tp_group, inference_only, cp_group: as in
            :func:`from_parallel_hidden_states_to_logprobs`.
        chunk_size: accepted for NeMo-RL's signature; the library picks its own tiling.
        sampling_params: NeMo-RL's ``TrainingSamplingParams`` or None; top-k / top-p filtering is not supported
            (a ``ValueError`` names it). Its temperature is applied by NeMo-RL before this call, as there.
        return_entropy: also return the entropy (not in NeMo-RL).
    Returns:
        ``[B, S - 1]`` float32 log-probs (and entropy), the same on every rank.
    """
    del chunk_size
    if sampling_params is not None and _filters(sampling_params):
        raise ValueError("sampling_params: top-k / top-p filtering is not supported by the gspo_kernels "
                         f"from_parallel_logits_to_logprobs (top_k={getattr(sampling_params, 'top_k', None)}, "
                         f"top_p={getattr(sampling_params, 'top_p', None)})")
    if vocab_parallel_logits.dim() != 3:
        raise ValueError(f"vocab_parallel_logits must be [B, S, V / tp], got {tuple(vocab_parallel_logits.shape)}")
    _check_target(target, vocab_parallel_logits.shape[0], "vocab_parallel_logits")
    labels = _local_targets(target, vocab_parallel_logits.shape[1], cp_group, "vocab_parallel_logits")
    with _grad_mode(inference_only):
        vp = _vocab_parallel(tp_group, vocab_start_index, vocab_end_index, reduce_hidden_grad=True)
        out = token_logprobs(vocab_parallel_logits, labels, return_entropy=return_entropy, vocab_parallel=vp)
        return _global_positions(out, target.shape[1], cp_group)


def route_nemo_rl() -> Callable[[], None]:
    """Replace NeMo-RL's ``from_parallel_hidden_states_to_logprobs`` and ``from_parallel_logits_to_logprobs`` by
    this module's, in ``nemo_rl.distributed.model_utils`` (where NeMo-RL's patched ``GPTModel.forward`` and its
    loss utilities call them) and in ``nemo_rl.models.megatron.train`` (which binds the logits function at import).

    Call it in the process of NeMo-RL's Megatron policy worker, before its first forward. Returns a function that
    restores NeMo-RL's originals. Raises ``ImportError`` when ``nemo_rl.distributed.model_utils`` does not import.
    """
    replacements = {"from_parallel_hidden_states_to_logprobs": from_parallel_hidden_states_to_logprobs,
                    "from_parallel_logits_to_logprobs": from_parallel_logits_to_logprobs}
    saved = []
    for module_name, attr in _NEMO_RL_TARGETS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            if module_name == _NEMO_RL_TARGETS[0][0]:
                raise
            continue  # the training module needs megatron-bridge; model_utils alone is enough for the fused path
        if hasattr(module, attr):
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, replacements[attr])

    def restore() -> None:
        for module, attr, original in saved:
            setattr(module, attr, original)

    return restore


# ----------------------------------------------------------------------------------------------- layout helpers

def _size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _grad_mode(inference_only: bool):
    return torch.no_grad() if inference_only else torch.enable_grad()


def _filters(sampling_params: Any) -> bool:
    """NeMo-RL's rule for when the sampling parameters filter the vocabulary (top-k set and not -1, top-p < 1)."""
    top_k = getattr(sampling_params, "top_k", None)
    top_p = getattr(sampling_params, "top_p", None)
    return (top_k is not None and top_k != -1) or (top_p is not None and top_p < 1.0)


def _check_target(target: Tensor, batch: int, source: str) -> None:
    if target.dim() != 2 or target.dtype.is_floating_point:
        raise ValueError(f"target must be [B, S] integer token ids, got {tuple(target.shape)} {target.dtype}")
    if target.shape[0] != batch:
        raise ValueError(f"target has batch size {target.shape[0]} but {source} has {batch}")


def _vocab_parallel(group: Optional[dist.ProcessGroup], start: int, end: int, *,
                    reduce_hidden_grad: bool) -> Optional[VocabParallel]:
    """The group's :class:`VocabParallel` for ``[start, end)`` (built once: its construction is a collective)."""
    if _size(group) == 1 and start == 0:
        return None
    key = (id(group), int(start), int(end), reduce_hidden_grad)
    vp = _vocab_parallel_cache.get(key)
    if vp is None:
        vp = VocabParallel(group, int(start), int(end), reduce_hidden_grad=reduce_hidden_grad)
        _vocab_parallel_cache[key] = vp
    return vp


def _local_targets(target: Tensor, local_len: int, cp_group: Optional[dist.ProcessGroup], source: str) -> Tensor:
    """``target`` shifted left by one (the next token; the last position gets token 0 and is dropped later), padded
    to ``local_len * cp`` and cut to this rank's load-balanced chunks (NeMo-RL's context-parallel layout)."""
    cp = _size(cp_group)
    seq = target.shape[1]
    total = local_len * cp
    if total < seq or (cp > 1 and total % (2 * cp)):
        expected = f"at least {seq}" + (f" and a multiple of {2 * cp}" if cp > 1 else "")
        raise ValueError(f"{source} holds {local_len} positions per rank ({total} over the tensor- and "
                         f"context-parallel gather), but target has {seq} positions: expected {expected}")
    shifted = torch.nn.functional.pad(target[:, 1:], (0, total - seq + 1))
    if cp == 1:
        return shifted
    rank = dist.get_rank(cp_group)
    chunk = total // (2 * cp)
    return torch.cat([shifted[:, rank * chunk:(rank + 1) * chunk],
                      shifted[:, (2 * cp - 1 - rank) * chunk:(2 * cp - rank) * chunk]], dim=1)


def _global_positions(out: LogProbs, seq: int, cp_group: Optional[dist.ProcessGroup]) -> LogProbs:
    """The local ``[B, S_local]`` results in sequence order (gathered over ``cp_group``), cut to ``[B, S - 1]``."""
    if isinstance(out, tuple):
        return tuple(_global_positions(t, seq, cp_group) for t in out)
    if _size(cp_group) > 1:
        out = _GatherLoadBalanced.apply(out, cp_group)
    return out[:, :seq - 1]


class _GatherLoadBalanced(torch.autograd.Function):
    """All-gather ``[B, 2c]`` load-balanced pieces (rank ``r``: chunks ``r`` and ``2 cp - 1 - r``) into ``[B, 2c cp]``
    in sequence order. Backward, as NeMo-RL's: the gradient summed over the group, this rank's chunks taken."""

    @staticmethod
    def forward(ctx, local: Tensor, group: dist.ProcessGroup) -> Tensor:
        cp = dist.get_world_size(group)
        pieces = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        order = [None] * (2 * cp)
        for r, piece in enumerate(pieces):
            first, second = piece.chunk(2, dim=1)
            order[r], order[2 * cp - 1 - r] = first, second
        ctx.group = group
        return torch.cat(order, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        chunks = grad.chunk(2 * cp, dim=1)
        return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1), None
