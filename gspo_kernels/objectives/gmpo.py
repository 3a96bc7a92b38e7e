"""GMPO (verl's geo_mean): ``l = -mean_t(A) rho_i``, ``rho_i`` the geometric mean of the sign-aware clipped
token ratios (docs/math.md)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.layout import LossInputs
from gspo_kernels.objectives.base import Options, segment_sum
from gspo_kernels.objectives.registry import LossType, Objective


def _gmpo_surrogate(*, log_ratio: Tensor, A: Tensor, factor: Optional[Tensor], denom: Tensor, inputs: LossInputs,
                    config: Options, metrics: Dict[str, Tensor], **_: Any) -> Tuple[Tensor, Tensor]:
    """GMPO: ``l = -mean_t(A) rho_i`` on every token, ``rho_i`` the geometric mean of the sign-aware clipped
    token ratios; ``(per-token loss [N], rho_i [S] detached)``, and its clip shares into ``metrics``."""
    batch = inputs.batch
    valid, seq, S = batch.mask > 0, batch.seq_index, batch.num_seqs
    zero = log_ratio.new_zeros(())
    clipped = torch.clamp(log_ratio, -config.epsilon_low, config.epsilon_high)
    sign = torch.sign(A)
    m = sign * torch.minimum(sign * log_ratio, sign * clipped)  # sign-aware clip of the token log-ratio
    rho_seq = torch.exp(segment_sum(m, seq, S) / denom)
    adv_seq = segment_sum(A, seq, S) / denom
    per_token = torch.where(valid, -(adv_seq * rho_seq)[seq], zero)
    if factor is not None:
        per_token = torch.where(factor == 0, zero, per_token)
    with torch.no_grad():
        moved = valid & (log_ratio != clipped)
        n_tok = batch.mask.to(log_ratio.dtype).sum().clamp(min=1)
        low, high = moved & (A < 0), moved & (A > 0)
        metrics["clip_ratio/low_mean"] = (low.sum() / n_tok).float()
        metrics["clip_ratio/high_mean"] = (high.sum() / n_tok).float()
        metrics["clip_ratio/region_mean"] = ((low | high).sum() / n_tok).float()
    return per_token, rho_seq.detach()


NAME = "gmpo"
ORDER = 50  # its place in the registry (gspo_kernels.objectives)
OBJECTIVE = Objective(
    name=NAME,
    loss_types=(LossType(NAME, NAME, "grpo"),),
    surrogate=_gmpo_surrogate,
    one_weight_per_response=True,
    metrics=(("clip_ratio/low_mean", "O_LOW"), ("clip_ratio/high_mean", "O_HIGH"),
             ("clip_ratio/region_mean", "O_REGION")),  # the tokens whose log-ratio its clip moved
    h100=(dict(level="sequence", SEQ_UNITS=True, ADV_PER_TOKEN=True, HAS_IS_RATIO=True),),
)
