"""A Megatron-core output layer as the library's vocabulary-parallel lm_head.

:func:`resolve_head` turns what the caller passes (a ``GPTModel``, possibly wrapped by megatron's DDP /
``Float16Module``, or its ``ColumnParallelLinear`` output layer) into a :class:`MegatronHead`: this rank's weight
shard ``[V / tp, H]`` (the word embedding's when the model ties them, as megatron's ``_postprocess`` passes it to
the output layer), the bias shard if the layer adds one, the tensor-parallel group, whether the layer is
sequence-parallel, and megatron's (padded) global vocabulary size. The rank's vocabulary range is megatron's:
``[rank * V / tp, (rank + 1) * V / tp)`` (equal shards; megatron pads the vocabulary so that ``tp`` divides it, and
the padded rows take part in the softmax as in megatron's own cross entropy).

:func:`full_sequence` is the output layer's input step: for a sequence-parallel layer, megatron's own
``gather_from_sequence_parallel_region`` (all-gather of ``[S / tp, B, H]`` along the sequence in the forward,
reduce-scatter of the gradient in the backward); the hidden states' gradient then leaves each rank's partial ``dH``
to that reduce-scatter, exactly as ``ColumnParallelLinear`` does. Without sequence parallelism the library's
:class:`~gspo_kernels.VocabParallel` sums ``dH`` over the group (megatron's copy-to-tensor-parallel-region), unless
the layer has ``disable_grad_reduce``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch.distributed as dist
from torch import Tensor

from gspo_kernels.parallel import VocabParallel


@dataclasses.dataclass(frozen=True)
class MegatronHead:
    """This rank's output-layer shard and where it sits (see the module docstring).

    ``weight``: ``[vocab_size / tp, H]``; ``bias``: ``[vocab_size / tp]`` or None; ``group``: the tensor-parallel
    process group (None when ``tp == 1``); ``vocab_size``: megatron's global (padded) vocabulary, or None when the
    layer does not say (a bare weight); ``sequence_parallel``: the layer's input is ``[S / tp, B, H]``;
    ``reduce_hidden_grad``: whether the library sums ``dH`` over the group (megatron's ``allreduce_dgrad``).
    """

    weight: Tensor
    bias: Optional[Tensor]
    group: Optional["dist.ProcessGroup"]
    tp: int
    rank: int
    vocab_size: Optional[int]
    sequence_parallel: bool
    reduce_hidden_grad: bool

    @property
    def start(self) -> int:
        return self.rank * self.weight.shape[0]

    @property
    def end(self) -> int:
        return self.start + self.weight.shape[0]


def unwrap(model):
    """megatron's wrappers (``DistributedDataParallel``, ``Float16Module``) keep the model in ``.module``."""
    seen = 0
    while not hasattr(model, "output_layer") and hasattr(model, "module") and seen < 8:
        model, seen = model.module, seen + 1
    return model


def _is_column_parallel(layer) -> bool:
    return hasattr(layer, "weight") and hasattr(layer, "output_size_per_partition")


def resolve_head(head) -> MegatronHead:
    """``head``: a megatron ``GPTModel`` (or a wrapper of one) on the pipeline's last stage, or a
    ``ColumnParallelLinear``. Raises ``TypeError`` naming ``head`` for anything else."""
    model = unwrap(head)
    weight = None
    vocab_size = None
    if hasattr(model, "output_layer"):
        if not getattr(model, "post_process", True) or model.output_layer is None:
            raise ValueError("head: this GPTModel stage has no output layer (post_process=False): pass the model "
                             "of the pipeline's last stage")
        layer = model.output_layer
        vocab_size = getattr(model, "vocab_size", None)
        if getattr(model, "share_embeddings_and_output_weights", False):
            weight = model.shared_embedding_or_output_weight()
    elif _is_column_parallel(model):
        layer = model
    else:
        raise TypeError(f"head must be a megatron GPTModel (or a wrapper of one) or a ColumnParallelLinear, "
                        f"got {type(head).__name__}")
    if not _is_column_parallel(layer):
        raise TypeError(f"head: the model's output_layer must be a megatron ColumnParallelLinear, "
                        f"got {type(layer).__name__}")
    if weight is None:
        weight = layer.weight
    if weight is None:
        raise ValueError("head: the output layer holds no weight (skip_weight_param_allocation) and the model does "
                         "not share the embedding's")
    bias = layer.bias if getattr(layer, "bias", None) is not None and not layer.skip_bias_add else None
    if vocab_size is None:
        vocab_size = getattr(layer, "output_size", None)
    group = getattr(layer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank(group) if tp > 1 else 0
    sequence_parallel = bool(getattr(layer, "sequence_parallel", False)) and tp > 1
    reduce = tp > 1 and not sequence_parallel and not getattr(layer, "disable_grad_reduce", False)
    return MegatronHead(weight=weight, bias=bias, group=group if tp > 1 else None, tp=tp, rank=rank,
                        vocab_size=vocab_size, sequence_parallel=sequence_parallel, reduce_hidden_grad=reduce)


_VOCAB_PARALLEL: Dict[Tuple, VocabParallel] = {}


def vocab_parallel(head: MegatronHead) -> Optional[VocabParallel]:
    """The :class:`~gspo_kernels.VocabParallel` of ``head`` (None when ``tp == 1``), built once per group, range and
    ``dH`` reduction: its construction is a collective, so every rank must reach this point with the same head
    (the callers check that first, in one small collective, see :mod:`.agree`)."""
    if head.tp == 1:
        return None
    key = (id(head.group), head.start, head.end, head.reduce_hidden_grad)
    vp = _VOCAB_PARALLEL.get(key)
    if vp is None or vp.group is not head.group:
        vp = VocabParallel(head.group, head.start, head.end, reduce_hidden_grad=head.reduce_hidden_grad)
        _VOCAB_PARALLEL[key] = vp
    return vp


def full_sequence(hidden: Tensor, head: MegatronHead) -> Tensor:
    """The output layer's input over the whole sequence: megatron's sequence-parallel all-gather (reduce-scatter
    backward) of ``[S / tp, B, H]`` when the layer is sequence-parallel; ``hidden`` itself otherwise."""
    if not head.sequence_parallel:
        return hidden
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=head.group)
