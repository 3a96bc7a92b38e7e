"""Group-relative advantages."""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_kernels.precision import upcast


def group_advantages(rewards: Tensor, group_size: int, *, eps: float = 1e-4) -> Tensor:
    """``A_i = (r_i - mean_group(r)) / (std_group(r) + eps)`` with the unbiased std (TRL; verl uses eps=1e-6).

    Args:
        rewards: ``[S]`` float, responses grouped consecutively, ``group_size`` per prompt.
    Returns:
        ``[S]`` float32 (float64 for float64 rewards); a group with equal rewards gets exactly 0,
        and so does every response when ``group_size == 1``.
    """
    if not isinstance(rewards, Tensor) or not rewards.dtype.is_floating_point:
        raise TypeError("rewards must be a floating-point tensor")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [S], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}")
    grouped = upcast(rewards).reshape(-1, group_size)  # fp32, fp64 kept
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if group_size == 1:
        return centered.reshape(-1)
    std = grouped.std(dim=1, keepdim=True, unbiased=True)
    # equal rewards give exactly 0, even with eps = 0
    return torch.where(centered == 0, 0.0, centered / (std + eps)).reshape(-1)
