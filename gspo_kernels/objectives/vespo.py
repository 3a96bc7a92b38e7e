"""VESPO: ``l_t = -phi(w_i) A_t logp_t``, ``phi`` the gamma weight of the response's weight (docs/math.md)."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.checks import is_finite_number
from gspo_kernels.layout import LossInputs
from gspo_kernels.objectives.base import Options, segment_sum
from gspo_kernels.objectives.registry import LossType, Objective

# log(1e-8): VESPO's lower clamp of the log sequence weight (TRL's, from the paper's implementation).
VESPO_LOG_MIN = math.log(1e-8)
VESPO_LOG_MAX = 20.0


def _vespo_surrogate(*, log_ratio: Tensor, fold: Optional[Tensor], A: Tensor, A_live: Tensor, adv: Tensor,
                     logp_m: Tensor, lengths: Tensor, inputs: LossInputs, config: Options,
                     metrics: Dict[str, Tensor], **_: Any) -> Tuple[Tensor, Tensor]:
    """VESPO: ``l_t = -phi(w_i) A_t logp_t`` with the response's weight ``w_i`` (its correction ``fold`` folded
    in); ``(per-token loss [N], w_i [S])``, and ``vespo/phi_seq_mean`` into ``metrics``."""
    batch = inputs.batch
    valid, seq, S = batch.mask > 0, batch.seq_index, batch.num_seqs
    zero = logp_m.new_zeros(())
    log_w_seq = vespo_log_weight(log_ratio.detach(), fold, valid, seq, S)
    phi = vespo_phi(log_w_seq[seq], A, config)
    with torch.no_grad():
        if inputs.advantages_per_token:
            tokens = batch.mask.to(logp_m.dtype).sum().clamp(min=1)
            metrics["vespo/phi_seq_mean"] = (torch.where(valid, phi, zero).sum() / tokens).float()
        else:
            counted = lengths > 0
            phi_seq = vespo_phi(log_w_seq, adv, config)
            metrics["vespo/phi_seq_mean"] = (torch.where(counted, phi_seq, zero).sum()
                                             / counted.sum().clamp(min=1)).float()
    return -phi * A_live * logp_m, torch.exp(log_w_seq)


def vespo_log_weight(log_ratio: Tensor, fold: Optional[Tensor], valid: Tensor, seq: Tensor, S: int) -> Tensor:
    """``[S]`` VESPO's log sequence weight: ``clamp(sum_t clamp(log r_t, -20, 20) + sum_t clamp(log c_t,
    log 1e-8, 20), log 1e-8, 20)`` with ``c_t`` the folded correction factor (detached)."""
    zero = log_ratio.new_zeros(())
    total = torch.where(valid, torch.clamp(log_ratio, -VESPO_LOG_MAX, VESPO_LOG_MAX), zero)
    if fold is not None:
        total = total + torch.where(valid, torch.clamp(torch.log(fold), VESPO_LOG_MIN, VESPO_LOG_MAX), zero)
    return torch.clamp(segment_sum(total, seq, S), VESPO_LOG_MIN, VESPO_LOG_MAX)


def vespo_phi(log_w: Tensor, A: Tensor, config: Options) -> Tensor:
    """``phi = exp(lambda + k log w - lambda w)``, ``(k, lambda)`` by ``A >= 0`` (detached; non-finite -> 0)."""
    pos = A >= 0
    k = torch.where(pos, A.new_tensor(config.vespo_k_pos), A.new_tensor(config.vespo_k_neg))
    lam = torch.where(pos, A.new_tensor(config.vespo_lambda_pos), A.new_tensor(config.vespo_lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.where(torch.isfinite(phi), phi, torch.zeros_like(phi)).detach()


# The rollout corrections VESPO folds into its weight token by token (TRL).
FOLDED_ROLLOUT_CORRECTIONS = ("token_truncate", "token_mask", "icepop")


def check(config: Options, active: bool) -> None:
    """The gamma weight's ``k >= 0`` and ``lambda >= 1e-4``; VESPO takes the token-level rollout corrections
    only."""
    for name in ("vespo_k_pos", "vespo_k_neg"):
        value = getattr(config, name)
        if not is_finite_number(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
        value = getattr(config, name)
        if not is_finite_number(value) or value < 1e-4:
            raise ValueError(f"{name} must be a finite number >= 1e-4 (TRL's floor), got {value!r}")
    mode = config.rollout_correction
    if active and mode is not None and mode not in FOLDED_ROLLOUT_CORRECTIONS:
        raise ValueError(
            f"loss_type='vespo' folds the rollout correction into its sequence weight token by token (TRL): "
            f"rollout_correction must be 'token_truncate', 'token_mask' or 'icepop', got {mode!r}"
        )


NAME = "vespo"
ORDER = 40  # its place in the registry (gspo_kernels.objectives)
OBJECTIVE = Objective(
    name=NAME,
    loss_types=(LossType(NAME, NAME, "dapo"),),
    surrogate=_vespo_surrogate,
    check=check,
    folds_correction=True,
    one_weight_per_response=True,
    metrics=(("vespo/phi_seq_mean", "O_AUX_MEAN"),),
    triton_floats=lambda config: (config.vespo_k_pos, config.vespo_lambda_pos, config.vespo_k_neg,
                                  config.vespo_lambda_neg),
    h100=(dict(level="token", SEQ_UNITS=True, HAS_KL=True, HAS_ROLLOUT=True, ROLLOUT="token_mask"),),
)
