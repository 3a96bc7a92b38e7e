"""What the objectives share: the per-response segment sum."""

from __future__ import annotations

from typing import Any

from torch import Tensor

# The loss options (a gspo_kernels.config.GSPOConfig): not imported here, config.py imports the objectives.
Options = Any


def segment_sum(values: Tensor, seq_index: Tensor, num_seqs: int) -> Tensor:
    """``out[i] = sum of values[t] over tokens t of response i`` (differentiable)."""
    return values.new_zeros(num_seqs).index_add(0, seq_index, values)
