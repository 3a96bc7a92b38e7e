"""SAPO: the soft gate ``l = -(4 / tau) sigmoid(tau (w - 1)) A`` (docs/math.md)."""

from __future__ import annotations

from typing import Any, Tuple

import torch
from torch import Tensor

from gspo_kernels.checks import is_finite_number
from gspo_kernels.objectives.base import Options
from gspo_kernels.objectives.registry import LossType, Objective

# SAPO's gate sigma(tau (w - 1)) is 1 to within e^-60 once tau (w - 1) >= 60: past that the weight is frozen.
SAPO_SATURATION = 60.0


def _sapo_live_log_weight(log_w: Tensor, A: Tensor, tau: Tensor) -> Tensor:
    """``log_w``, except where the gate is saturated (``tau (w - 1) >= 60``) or ``A == 0``: there a detached,
    finite stand-in (the loss changes by less than ``e^-60`` relative, its gradient ``4 s (1 - s) w A`` is below
    ``e^-59``), so an overflowing weight gives a zero gradient instead of ``0 * inf``."""
    with torch.no_grad():
        cap = torch.log1p(SAPO_SATURATION / tau)
        frozen = (A == 0) | (log_w.detach() > cap)
        stand_in = torch.minimum(log_w.detach(), cap)
    return torch.where(frozen, stand_in, log_w)


def surrogate(*, log_w: Tensor, A: Tensor, A_live: Tensor, config: Options, **_: Any) -> Tuple[Tensor, None]:
    """``l = -(4 / tau) sigmoid(tau (w - 1)) A``, ``tau`` by the sign of ``A``."""
    tau = torch.where(A > 0, A.new_tensor(config.sapo_temperature_pos),
                      A.new_tensor(config.sapo_temperature_neg))
    w = torch.exp(_sapo_live_log_weight(log_w, A_live, tau))
    return -torch.sigmoid(tau * (w - 1.0)) * (4.0 / tau) * A_live, None


def check(config: Options, active: bool) -> None:
    """The gate temperatures: finite and > 0."""
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        value = getattr(config, name)
        if not is_finite_number(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


NAME = "sapo"
ORDER = 20  # its place in the registry (gspo_kernels.objectives)
OBJECTIVE = Objective(
    name=NAME,
    loss_types=(LossType(NAME, NAME, "grpo"),),
    surrogate=surrogate,
    check=check,
    loss_through_weight=True,
    triton_floats=lambda config: (config.sapo_temperature_pos, config.sapo_temperature_neg),
    h100=(dict(level="sequence", HAS_ROLLOUT=True, ROLLOUT="sequence_mask"),),
)
