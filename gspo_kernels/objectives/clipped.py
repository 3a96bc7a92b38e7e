"""The clipped surrogate (PPO / GRPO / GSPO): ``l = -min(c1 A, c2 A)``, ``c1 = min(w, delta)``,
``c2 = clamp(w, 1 - epsilon_low, 1 + epsilon_high)``, with the optional dual clip (docs/math.md)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gspo_kernels.objectives.base import Options


def _live_log_weight(log_w: Tensor, A: Tensor, config: Options) -> Tensor:
    """``log_w`` where the token's surrogate ``-min(c1 A, c2 A)`` depends on the weight; a detached, finite
    stand-in giving the same clipped value elsewhere (its gradient is exactly 0 there, with no ``0 * inf``).

    ``c1 = min(w, delta)`` (or ``w``), ``c2 = clamp(w, 1 - eps_low, 1 + eps_high)``. The value is constant
    in ``w`` when ``A == 0``, or when the branch ``torch.minimum`` picks is a clamped constant (for a tie,
    when both are), or when the dual clip caps it (``A < 0`` and ``max(c1, c2) > clip_ratio_c``). Only those
    tokens get the stand-in: ``min(log_w, log(cap))`` with ``cap`` above every clip edge, which leaves the
    clipped values unchanged.
    """
    lo, hi, delta, dual = 1.0 - config.epsilon_low, 1.0 + config.epsilon_high, config.delta, config.clip_ratio_c
    with torch.no_grad():
        lw = log_w.detach()
        w = torch.exp(lw)  # may be inf: used for comparisons only
        c1 = w if delta is None else torch.clamp(w, max=delta)
        c2 = torch.clamp(w, lo, hi)
        c1_const = torch.zeros_like(w, dtype=torch.bool) if delta is None else w > delta
        c2_const = (w < lo) | (w > hi)
        a1, a2 = c1 * A, c2 * A
        frozen = (A == 0) | ((a1 < a2) & c1_const) | ((a2 < a1) & c2_const) | (c1_const & c2_const)
        if dual is not None:
            frozen = frozen | ((A < 0) & (torch.maximum(c1, c2) > dual))
        cap = math.log(2.0 * max(hi, delta or hi, dual or hi))
        stand_in = torch.clamp(lw, max=cap)
    return torch.where(frozen, stand_in, log_w)
