"""The float64 oracle's per-response formulas (used by :mod:`gspo_kernels.reference` only; no code shared with
the backends): the importance weight, each objective's surrogate, the rollout correction, the k3 KL, the
aggregation, and the tally of what the metrics need with the metrics computed from it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.config import GSPOConfig

# The loss types whose objective is the clipped surrogate (they differ in their aggregation).
_CLIPPED_SURROGATE = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")

# exp(x) overflows float64 above this: a weight that large is infinite in float64.
_LOG_FLOAT64_MAX = math.log(torch.finfo(torch.float64).max)


@dataclass
class _Tally:
    """What the metrics need, gathered response by response."""

    num_tokens: int = 0  # sum over responses of |y_i|
    weights: List[Tensor] = field(default_factory=list)  # the weights the metrics count, and their advantages
    advs: List[Tensor] = field(default_factory=list)
    kls: List[Tensor] = field(default_factory=list)
    entropies: List[Tensor] = field(default_factory=list)
    cispo: List[Tensor] = field(default_factory=list)  # CISPO's clipped items
    phi: List[Tensor] = field(default_factory=list)  # VESPO's phi
    gmpo_low: List[Tensor] = field(default_factory=list)  # GMPO's moved tokens by the sign of A
    gmpo_high: List[Tensor] = field(default_factory=list)
    rollout_diff: List[Tensor] = field(default_factory=list)  # trainer - rollout log-probs
    rollout_weights: List[Tensor] = field(default_factory=list)
    rollout_zeros: int = 0
    rollout_filtered: int = 0  # the correction's units (tokens, or responses) whose statistic left the band
    rollout_units: int = 0


def _importance_weight(r: Tensor, logp: Tensor, config: GSPOConfig) -> Tensor:
    """The importance weight ``w`` of each token from the log-ratios ``r_t = logp_t - old_t``, at the level."""
    level = config.importance_sampling_level
    n = r.numel()
    if level == "token":  # GRPO / PPO: w_t = exp(r_t)
        log_w = r
    elif level == "sequence":  # GSPO: w_i = exp(mean_t r_t), one weight for the response
        log_w = r.mean().expand(n)
    else:  # GSPO-token: value w_i, gradient of the token's own log-prob
        log_w = r.mean().detach() + logp - logp.detach()
    if config.log_ratio_clamp is not None:
        log_w = torch.clamp(log_w, max=config.log_ratio_clamp)
    return _exp(log_w)


def _rollout_correction(trainer: Tensor, rollout: Tensor, config: GSPOConfig, tally: _Tally) -> Tensor:
    """:func:`_rollout_weight` of one response's tokens, its mismatch statistics recorded in ``tally``."""
    mode = config.rollout_correction
    rho, outside = _rollout_weight(trainer, rollout, config)
    d = trainer - rollout
    tally.rollout_diff.append(torch.where(torch.isnan(d), 0.0, d))
    tally.rollout_weights.append(rho[:1] if mode in ("sequence_truncate", "sequence_mask") else rho)
    tally.rollout_zeros += int((rho == 0).sum()) if mode is not None else 0
    if mode is not None:
        tally.rollout_filtered += int(outside.sum())
        tally.rollout_units += outside.numel()
    return rho


def _off_policy_keep(logp: Tensor, A: Tensor, sampling: Tensor, config: GSPOConfig) -> Optional[Tensor]:
    """DeepSeek-V3.2's off-policy mask: 0 on the tokens of a response with ``A < 0`` whose mean gap
    ``sampling - logp`` exceeds the threshold, else 1; None without a threshold."""
    if config.off_policy_mask_threshold is None:
        return None
    gap = sampling - logp.detach()
    seq_kl = torch.where(torch.isnan(gap), 0.0, gap).mean()
    return ((A >= 0) | (seq_kl <= config.off_policy_mask_threshold)).double()


def _sapo_surrogate(w: Tensor, A: Tensor, config: GSPOConfig) -> Tensor:
    """SAPO's soft gate ``l_t = -(4 / tau) sigmoid(tau (w - 1)) A``, ``tau`` by the sign of A."""
    tau = torch.where(A > 0, A.new_tensor(config.sapo_temperature_pos), A.new_tensor(config.sapo_temperature_neg))
    loss_t = -(4.0 / tau) * torch.sigmoid(tau * (w - 1.0)) * A
    return torch.where(A == 0, 0.0, loss_t)


def _cispo_surrogate(w: Tensor, A: Tensor, logp: Tensor, config: GSPOConfig, adv_per_token: bool,
                     tally: _Tally) -> Tensor:
    """CISPO: REINFORCE with a clipped, detached weight, ``l_t = -sg(w_hat) A logp``; its clipped items counted
    per response when the response has one weight and one advantage, else per token."""
    wd = w.detach()
    eps_low, eps_high = config.epsilon_low, config.epsilon_high
    if config.cispo_clip == "upper":
        w_hat = torch.clamp(wd, max=eps_high)
        flags = (wd > eps_high) & (A > 0)
    else:
        w_hat = torch.clamp(wd, 1 - eps_low, 1 + eps_high)
        flags = (wd < 1 - eps_low) | (wd > 1 + eps_high)
    tally.cispo.append(flags[:1] if config.importance_sampling_level == "sequence" and not adv_per_token else flags)
    return -w_hat * A * logp


def _vespo_surrogate(r: Tensor, A: Tensor, logp: Tensor, c: Optional[Tensor], config: GSPOConfig,
                     adv_per_token: bool, tally: _Tally) -> Tuple[Tensor, Tensor]:
    """VESPO: gamma-weighted REINFORCE on the sequence weight, ``l_t = -phi(w_i) A logp`` with
    ``phi(w) = exp(lambda + k log w - lambda w)``; the correction ``c`` folded into ``w_i`` in log space (TRL).
    Returns ``(l, w_i)``."""
    log_seq = torch.clamp(r.detach(), -20.0, 20.0).sum()
    if c is not None:
        log_seq = log_seq + torch.clamp(torch.log(c), math.log(1e-8), 20.0).sum()
    log_seq = torch.clamp(log_seq, math.log(1e-8), 20.0)
    k = torch.where(A >= 0, A.new_tensor(config.vespo_k_pos), A.new_tensor(config.vespo_k_neg))
    lam = torch.where(A >= 0, A.new_tensor(config.vespo_lambda_pos), A.new_tensor(config.vespo_lambda_neg))
    phi = torch.exp(lam + k * log_seq - lam * torch.exp(log_seq))
    phi = torch.where(torch.isfinite(phi), phi, 0.0).detach()
    tally.phi.append(phi if adv_per_token else phi[:1])
    return -phi * A * logp, torch.exp(log_seq)


def _gmpo_surrogate(r: Tensor, A: Tensor, config: GSPOConfig, tally: _Tally) -> Tuple[Tensor, Tensor]:
    """GMPO: ``l = -mean(A) rho_i`` on every token, ``rho_i`` the geometric mean of the sign-aware clipped token
    ratios ``exp(m_t)``, ``m_t = s min(s r_t, s clip(r_t, -eps_low, eps_high))``, ``s = sign(A_t)``.
    Returns ``(l, rho_i)``."""
    r_clip = torch.clamp(r, -config.epsilon_low, config.epsilon_high)
    s = torch.sign(A)
    m = s * torch.minimum(s * r, s * r_clip)
    rho_i = torch.exp(m.mean())
    moved = r.detach() != r_clip.detach()
    tally.gmpo_low.append(moved & (A < 0))
    tally.gmpo_high.append(moved & (A > 0))
    return (-A.mean() * rho_i).expand(r.numel()), rho_i.detach()


def _k3_kl(ref: Tensor, logp: Tensor) -> Tensor:
    """The k3 estimator of ``KL(pi || pi_ref)`` per token: ``e^d - d - 1``, ``d = ref - logp``."""
    d = ref - logp
    return torch.exp(d) - d - 1


def _aggregate(total: Tensor, aggregation: str, S: int, num_tokens: int, items: Optional[float],
               config: GSPOConfig) -> Tensor:
    """The loss from ``total``, the sum over responses of their per-token losses (each response's mean for
    ``grpo``): over ``S`` responses, the ``num_tokens`` tokens, ``S * max_completion_length`` (``dr_grpo``), or
    the caller's global token count ``items`` (``dapo``)."""
    if aggregation in ("grpo", "seq_sum"):
        return total / max(S, 1)
    if aggregation == "bnpo":
        return total / max(num_tokens, 1)
    if aggregation == "dr_grpo":
        return total / (max(S, 1) * config.max_completion_length)
    return total / (max(num_tokens, 1) if items is None else items)  # dapo: else this batch's token count


def _objective_metrics(tally: _Tally, config: GSPOConfig, has_rollout: bool, f64: dict) -> Dict[str, Tensor]:
    """The metrics of the objective (TRL's names) but the entropy and the KL: weights and clip shares, each
    objective's own, the rollout mismatch."""
    num_tokens = tally.num_tokens
    metrics = _weight_metrics(tally.weights, tally.advs, config.epsilon_low, config.epsilon_high, f64)
    loss_type = config.loss_type
    if loss_type not in _CLIPPED_SURROGATE:
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            del metrics[name]
    if loss_type == "cispo":
        flags = torch.cat(tally.cispo) if tally.cispo else torch.zeros(0, dtype=torch.bool)
        metrics["cispo_clip_ratio"] = flags.sum().double() / max(flags.numel(), 1)
    if loss_type == "vespo":
        phis = torch.cat(tally.phi) if tally.phi else torch.zeros(0, **f64)
        metrics["vespo/phi_seq_mean"] = phis.sum() / max(phis.numel(), 1)
    if loss_type == "gmpo":
        low = torch.cat(tally.gmpo_low) if tally.gmpo_low else torch.zeros(0, dtype=torch.bool)
        high = torch.cat(tally.gmpo_high) if tally.gmpo_high else torch.zeros(0, dtype=torch.bool)
        metrics["clip_ratio/low_mean"] = low.sum().double() / max(num_tokens, 1)
        metrics["clip_ratio/high_mean"] = high.sum().double() / max(num_tokens, 1)
        metrics["clip_ratio/region_mean"] = (low | high).sum().double() / max(num_tokens, 1)
    if has_rollout:
        diff = torch.cat(tally.rollout_diff) if tally.rollout_diff else torch.zeros(0, **f64)
        rw = torch.cat(tally.rollout_weights) if tally.rollout_weights else torch.zeros(0, **f64)
        zero = torch.zeros((), **f64)
        metrics["rollout/kl"] = -diff.sum() / max(num_tokens, 1)  # mean of rollout - trainer log-probs
        metrics["rollout/masked_fraction"] = torch.tensor(tally.rollout_zeros / max(num_tokens, 1), **f64)
        metrics["rollout/is_filter_ratio"] = torch.tensor(tally.rollout_filtered / max(tally.rollout_units, 1), **f64)
        metrics["rollout/weight_min"] = rw.min() if rw.numel() else zero
        metrics["rollout/weight_mean"] = rw.sum() / max(rw.numel(), 1)
        metrics["rollout/weight_max"] = rw.max() if rw.numel() else zero
    return metrics


def _rollout_weight(trainer: Tensor, rollout: Tensor, config: GSPOConfig) -> Tuple[Tensor, Tensor]:
    """The rollout correction of one response's tokens, from the trainer's and the engine's log-probs, and
    whether each of the correction's units (the tokens, or the response as one) has its statistic outside
    ``[C_min, C_max]`` (a bool per token, or one).

    ``d_t = trainer_t - rollout_t`` (0 where the engine gave NaN). Token modes: ``rho_t = e^{d_t}``; sequence
    modes: ``rho = e^{sum_t d_t}`` for every token (TRL's sequence ratio: a product, not a geometric mean);
    ``sequence_masked_tis``: ``min(e^{d_t}, C_max)`` when the geometric mean ``e^{mean_t d_t}`` lies in
    ``[C_min, C_max]``, else 0; ``sequence_geometric_mask``: ``e^{d_t}`` under the same condition. Truncation
    clamps into ``[C_min, C_max]``; masking (icepop included) zeroes the weights outside it. The divergence gates
    keep ``e^{d_t}`` where the sampled token's divergence between the engine's probability ``p = e^{rollout}``
    and the trainer's ``q = e^{trainer}`` (both clamped to ``[1e-6, 1 - 1e-6]``) lies in ``[C_min, C_max]``: the
    binary KL ``p log(p/q) + (1-p) log((1-p)/(1-q))`` or the total variation ``|p - q|``, per token, or its mean
    over the response for the ``sequence_*`` gates. No mode: the raw token ratios (for the metrics only).
    """
    mode = config.rollout_correction
    unscored = torch.isnan(trainer - rollout)
    d = torch.where(unscored, 0.0, trainer - rollout)
    c_max = config.rollout_correction_max
    c_min = config.rollout_correction_min
    if c_min is None and c_max is not None and mode in ("icepop", "sequence_masked_tis"):
        c_min = 1.0 / c_max
    lower = -math.inf if c_min is None else c_min
    upper = math.inf if c_max is None else c_max

    def outside(statistic: Tensor) -> Tensor:
        return (statistic < lower) | (statistic > upper)

    token_ratio = torch.exp(d)
    if mode in ("sequence_truncate", "sequence_mask"):
        rho = torch.exp(d.sum()).expand(d.numel())
        out = outside(rho[:1])
        if mode == "sequence_truncate":
            return torch.clamp(rho, lower, upper), out
        return (torch.zeros_like(rho) if bool(out) else rho), out
    if mode in ("token_truncate", "token_mask", "icepop"):
        out = outside(token_ratio)
        if mode == "token_truncate":
            return torch.clamp(token_ratio, lower, upper), out
        return torch.where(out, 0.0, token_ratio), out
    if mode in ("sequence_masked_tis", "sequence_geometric_mask"):
        out = outside(torch.exp(d.mean()).reshape(1))
        kept = torch.clamp(token_ratio, max=upper) if mode == "sequence_masked_tis" else token_ratio
        return (torch.zeros_like(kept) if bool(out) else kept), out
    if mode is not None and ("binary_kl" in mode or "tv" in mode):
        p = torch.clamp(torch.exp(rollout), 1e-6, 1 - 1e-6)
        q = torch.clamp(torch.exp(trainer), 1e-6, 1 - 1e-6)
        if "binary_kl" in mode:
            divergence = p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))
        else:
            divergence = (p - q).abs()
        divergence = torch.where(unscored, 0.0, divergence)
        out = outside(divergence.mean().reshape(1) if mode.startswith("sequence_") else divergence)
        return torch.where(out, 0.0, token_ratio), out
    return token_ratio, torch.zeros(0, dtype=torch.bool)


def _exp(log_w: Tensor) -> Tensor:
    """``exp(log_w)``; where that overflows float64 the value is +inf and no gradient flows (none is finite)."""
    over = log_w.detach() > _LOG_FLOAT64_MAX
    w = torch.exp(torch.where(over, 0.0, log_w))
    return torch.where(over, math.inf, w)


def _clipped_surrogate(w: Tensor, A: Tensor, eps_low: float, eps_high: float, delta: Optional[float]) -> Tensor:
    """``l_t = -min(c1 A, c2 A)``, ``c1 = w`` (or ``min(w, delta)``), ``c2 = clamp(w, 1 - eps_low, 1 + eps_high)``.

    With ``A = 0`` the loss is 0 whatever ``w`` is (also for ``w = inf``, where ``inf * 0`` would be NaN).
    """
    c1 = w if delta is None else torch.clamp(w, max=delta)
    c2 = torch.clamp(w, 1 - eps_low, 1 + eps_high)
    loss_t = -torch.minimum(c1 * A, c2 * A)
    return torch.where(A == 0, 0.0, loss_t)


def _weight_metrics(weights, advs, eps_low: float, eps_high: float, f64: dict) -> Dict[str, Tensor]:
    """Clip shares and importance-weight statistics (TRL's names) over the counted responses or tokens."""
    w = torch.cat(weights) if weights else torch.zeros(0, **f64)
    A = torch.cat(advs).double() if advs else torch.zeros(0, **f64)
    count = max(w.numel(), 1)
    low = (w < 1 - eps_low) & (A < 0)
    high = (w > 1 + eps_high) & (A > 0)
    zero = torch.zeros((), **f64)
    return {
        "clip_ratio/low_mean": low.sum().double() / count,
        "clip_ratio/high_mean": high.sum().double() / count,
        "clip_ratio/region_mean": (low | high).sum().double() / count,
        "importance_weight/mean": w.sum() / count,
        "importance_weight/min": w.min() if w.numel() else zero,
        "importance_weight/max": w.max() if w.numel() else zero,
    }
