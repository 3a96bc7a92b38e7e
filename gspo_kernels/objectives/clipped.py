"""The clipped surrogate (PPO / GRPO / GSPO): ``l = -min(c1 A, c2 A)``, ``c1 = min(w, delta)``,
``c2 = clamp(w, 1 - epsilon_low, 1 + epsilon_high)``, with the optional dual clip (docs/math.md)."""

from __future__ import annotations

import math
from typing import Any, Dict, Tuple

import torch
from torch import Tensor

from gspo_kernels.checks import is_finite_number
from gspo_kernels.objectives.base import Options
from gspo_kernels.objectives.registry import LossType, Objective, loss_types


def live_log_weight(log_w: Tensor, A: Tensor, config: Options) -> Tensor:
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


def clip_flags(w: Tensor, A: Tensor, config: Options) -> Tuple[Tensor, Tensor]:
    """``(low, high)`` bool: the weight left the band on the side where clipping removes the gradient
    (``w < 1 - epsilon_low`` with ``A < 0``; ``w > 1 + epsilon_high`` with ``A > 0``). The one definition
    of the ``clip_ratio/*`` metrics (the TRL drop-in weights them across processes itself)."""
    low = (w < 1.0 - config.epsilon_low) & (A < 0)
    high = (w > 1.0 + config.epsilon_high) & (A > 0)
    return low, high


def surrogate(*, log_w: Tensor, A_live: Tensor, config: Options, **_: Any) -> Tuple[Tensor, None]:
    """``l = -min(c1 A, c2 A)`` (``c1 = min(w, delta)`` or ``w``, ``c2 = clamp(w, 1 - eps_low, 1 + eps_high)``),
    for ``A < 0`` at most ``clip_ratio_c * |A|`` (the dual clip)."""
    w = torch.exp(live_log_weight(log_w, A_live, config))
    c1 = w if config.delta is None else torch.clamp(w, max=config.delta)
    c2 = torch.clamp(w, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
    per_token = -torch.minimum(c1 * A_live, c2 * A_live)
    if config.clip_ratio_c is not None:  # dual clip: for A < 0 the loss is at most clip_ratio_c * |A|
        per_token = torch.where(A_live < 0, torch.minimum(per_token, -config.clip_ratio_c * A_live), per_token)
    return per_token, None


def clip_metrics(w: Tensor, A: Tensor, valid: Tensor, config: Options) -> Dict[str, Tensor]:
    """``clip_ratio/{low,high,region}_mean`` over the counted items (TRL's names)."""
    n = valid.sum().clamp(min=1).to(torch.float32)
    low, high = clip_flags(w, A, config)
    low, high = valid & low, valid & high
    return {"clip_ratio/low_mean": low.sum() / n, "clip_ratio/high_mean": high.sum() / n,
            "clip_ratio/region_mean": (low | high).sum() / n}


def check(config: Options, active: bool) -> None:
    """``delta`` and the dual clip ``clip_ratio_c``: finite and > 1, and only for the clipped surrogate."""
    if config.delta is not None and (not is_finite_number(config.delta) or config.delta <= 1):
        raise ValueError(f"delta must be None or a finite number > 1, got {config.delta!r}")
    clipped = tuple(t.name for t in loss_types() if t.objective == NAME)
    if config.clip_ratio_c is not None:
        if not is_finite_number(config.clip_ratio_c) or config.clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be None or a finite number > 1, got {config.clip_ratio_c!r}")
        if not active:
            raise ValueError(f"clip_ratio_c (the dual clip) applies to the clipped surrogate only "
                             f"(loss_type in {clipped}), not loss_type={config.loss_type!r}")
    if config.delta is not None and not active:
        raise ValueError(f"delta (two-sided clipping) applies to the clipped surrogate only "
                         f"(loss_type in {clipped}), not loss_type={config.loss_type!r}")


NAME = "clip"
ORDER = 0  # its place in the registry (gspo_kernels.objectives)
# The four aggregations' names (TRL's): the clipped surrogate with that aggregation.
OBJECTIVE = Objective(
    name=NAME,
    loss_types=tuple(LossType(name, NAME, name) for name in ("grpo", "bnpo", "dr_grpo", "dapo")),
    surrogate=surrogate,
    check=check,
    clip_metrics=clip_metrics,
    metrics=(("clip_ratio/low_mean", "O_LOW"), ("clip_ratio/high_mean", "O_HIGH"),
             ("clip_ratio/region_mean", "O_REGION")),
    loss_through_weight=True,
)
