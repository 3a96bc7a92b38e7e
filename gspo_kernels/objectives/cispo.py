"""CISPO: ``l = -sg(w_hat) A logp`` with the clipped, detached weight ``w_hat`` (docs/math.md)."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import Tensor

from gspo_kernels.objectives.base import Options
from gspo_kernels.objectives.registry import LossType, Objective

CISPO_CLIPS = ("upper", "band")


def cispo_weight(log_w: Tensor, config: Options) -> Tensor:
    """CISPO's detached weight: ``min(w, epsilon_high)`` (``cispo_clip="upper"``) or
    ``clamp(w, 1 - epsilon_low, 1 + epsilon_high)`` (``"band"``)."""
    w = torch.exp(log_w.detach())
    if config.cispo_clip == "upper":
        return torch.clamp(w, max=config.epsilon_high)
    return torch.clamp(w, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)


def surrogate(*, log_w: Tensor, A_live: Tensor, logp_m: Tensor, config: Options, **_: Any) -> Tuple[Tensor, None]:
    """``l = -sg(w_hat) A logp``."""
    w_hat = cispo_weight(log_w.detach(), config)
    return -w_hat * A_live * logp_m, None


def clip_metrics(w: Tensor, A: Tensor, valid: Tensor, config: Options) -> Dict[str, Tensor]:
    """``cispo_clip_ratio`` (upper: ``w > epsilon_high`` with ``A > 0``, TRL; band: ``w`` outside the band,
    verl) over the counted items."""
    n = valid.sum().clamp(min=1).to(torch.float32)
    if config.cispo_clip == "upper":
        clipped = (w > config.epsilon_high) & (A > 0)
    else:
        clipped = (w < 1.0 - config.epsilon_low) | (w > 1.0 + config.epsilon_high)
    return {"cispo_clip_ratio": (valid & clipped).sum() / n}


def check(config: Options, active: bool) -> None:
    """``cispo_clip`` is one of :data:`CISPO_CLIPS`; with ``"upper"``, ``epsilon_high`` is an absolute cap >= 1."""
    if config.cispo_clip not in CISPO_CLIPS:
        raise ValueError(f"cispo_clip must be one of {CISPO_CLIPS}, got {config.cispo_clip!r}")
    if active and config.cispo_clip == "upper" and config.epsilon_high < 1:
        raise ValueError(
            f"epsilon_high is CISPO's absolute cap on the importance weight when loss_type='cispo' and "
            f"cispo_clip='upper' (TRL's convention, e.g. 5.0): it must be >= 1, got {config.epsilon_high!r} "
            f"(for the band [1 - epsilon_low, 1 + epsilon_high] set cispo_clip='band')"
        )


NAME = "cispo"
ORDER = 10  # its place in the registry (gspo_kernels.objectives)
OBJECTIVE = Objective(
    name=NAME,
    loss_types=(LossType(NAME, NAME, "dapo"),),
    surrogate=surrogate,
    check=check,
    clip_metrics=clip_metrics,
    metrics=(("cispo_clip_ratio", "O_HIGH"),),  # its clipped items in the high column
    triton_option=lambda config: config.cispo_clip == "band",
    h100=(dict(level="token", OBJ_OPTION=True, HAS_ROLLOUT=True, ROLLOUT="sequence_masked_tis"),),
)
