"""SAPO: the soft gate ``l = -(4 / tau) sigmoid(tau (w - 1)) A`` (docs/math.md)."""

from __future__ import annotations

import torch
from torch import Tensor

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
