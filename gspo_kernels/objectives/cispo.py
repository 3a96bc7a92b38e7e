"""CISPO: ``l = -sg(w_hat) A logp`` with the clipped, detached weight ``w_hat`` (docs/math.md)."""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_kernels.objectives.base import Options


def cispo_weight(log_w: Tensor, config: Options) -> Tensor:
    """CISPO's detached weight: ``min(w, epsilon_high)`` (``cispo_clip="upper"``) or
    ``clamp(w, 1 - epsilon_low, 1 + epsilon_high)`` (``"band"``)."""
    w = torch.exp(log_w.detach())
    if config.cispo_clip == "upper":
        return torch.clamp(w, max=config.epsilon_high)
    return torch.clamp(w, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
