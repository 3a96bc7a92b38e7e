"""Megatron-core models: log-probs, entropies and the GSPO loss from the tensor-parallel output layer, without logits.

Public names: :func:`linear_logprobs` (per-token log-probs / entropies of a ``GPTModel``'s or a
``ColumnParallelLinear``'s output, megatron's ``[S, B, H]`` in, ``[B, S]`` out, sequence-parallel heads included),
:func:`fused_linear_gspo_loss` (every objective of the library, megatron's padded and packed ``thd`` layouts, context
parallelism), :func:`enable` / :func:`disable` (a ``GPTModel`` called with ``labels`` computes its per-token cross
entropy through the library) and :func:`capture` (the log-probs and entropies of that same forward). megatron-core is imported only when these run, never by ``import gspo_kernels``.
See ``docs/megatron.md``.
"""

from gspo_kernels.integrations.megatron.logprobs import linear_logprobs
from gspo_kernels.integrations.megatron.loss import fused_linear_gspo_loss
from gspo_kernels.integrations.megatron.model import Capture, capture, disable, enable

__all__ = ["linear_logprobs", "fused_linear_gspo_loss", "enable", "disable", "capture", "Capture"]
