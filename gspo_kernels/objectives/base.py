"""What the objectives share: the per-response segment sum."""

from __future__ import annotations

from torch import Tensor

from gspo_kernels.config import GSPOConfig

# The loss options an objective reads (the objectives sit above the config: they import it, it imports none of them)
Options = GSPOConfig


def segment_sum(values: Tensor, seq_index: Tensor, num_seqs: int) -> Tensor:
    """``out[i] = sum of values[t] over tokens t of response i`` (differentiable)."""
    return values.new_zeros(num_seqs).index_add(0, seq_index, values)
