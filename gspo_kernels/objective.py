"""The light per-sequence stage in PyTorch: importance weights, the objective of ``config.loss_type`` (clipped
surrogate with optional dual clip, SAPO, CISPO, VESPO, GMPO), off-policy masking, rollout correction, KL,
aggregation, metrics (docs/math.md).

Written once and used by every backend without a faster version of it. Everything here is
``[N]``- or ``[S]``-sized; the heavy per-token stage (log-softmax / gather / entropy) has already run.
Autograd through this function yields exactly zero ``dL/dlogp_t`` for masked tokens, clipped
responses and zero advantages, which the heavy backward stages use to skip those rows.

Robustness (``docs/policies.md``): every per-token input is replaced by 0 at masked positions before it
meets a product, so NaN / inf there never reaches a value or a gradient; and the clipping branch of each
token is selected from the detached weight before ``exp`` runs on a differentiable value, so a token whose
loss does not depend on its weight (clipped, capped by ``delta``, zero advantage) gets a zero gradient
even when its weight overflows (``exp(100)`` in fp32), instead of ``0 * inf = NaN``.
"""

from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.config import GSPOConfig
from gspo_kernels.layout import LossInputs


class LossOutput(NamedTuple):
    """``loss``: 0-dim differentiable tensor; ``metrics``: detached 0-dim tensors (TRL's names)."""

    loss: Tensor
    metrics: Dict[str, Tensor]


def segment_sum(values: Tensor, seq_index: Tensor, num_seqs: int) -> Tensor:
    """``out[i] = sum of values[t] over tokens t of response i`` (differentiable)."""
    return values.new_zeros(num_seqs).index_add(0, seq_index, values)


def gspo_objective(
    logp: Tensor, entropy: Optional[Tensor], inputs: LossInputs, config: GSPOConfig
) -> LossOutput:
    """The loss of ``config`` (GSPO / GRPO clipped surrogate, CISPO, SAPO, LUSPO, VESPO, GMPO; dual clip,
    off-policy masking, rollout correction) from per-token log-probs ``logp [N]`` and entropies ``entropy [N]``.

    ``entropy`` may be None only when ``config.entropy_coef == 0`` (the metric is then omitted).
    """
    batch = inputs.batch
    S, seq = batch.num_seqs, batch.seq_index
    valid = batch.mask > 0
    mask = batch.mask.to(logp.dtype)
    zero = logp.new_zeros(())

    # Masked positions are zeroed before any exp, so padding values (-inf, garbage) never leak.
    logp_m = torch.where(valid, logp, zero)
    old = inputs.old_logprobs
    old_m = logp_m.detach() if old is None else torch.where(valid, old.to(logp.dtype), zero)
    log_ratio = logp_m - old_m

    lengths = segment_sum(mask, seq, S)
    denom = lengths.clamp(min=1)
    level = config.importance_sampling_level
    seq_log_ratio = segment_sum(log_ratio, seq, S) / denom  # [S], mean log-ratio per response
    if level == "token":
        log_w = log_ratio
    elif level == "sequence":
        log_w = seq_log_ratio[seq]
    else:  # "sequence_token": value of the sequence weight, gradient of the token's own log-prob
        log_w = seq_log_ratio.detach()[seq] + logp_m - logp_m.detach()
    clamp = config.log_ratio_clamp
    if clamp is not None:  # verl's guard: value min(log w, c), no gradient through a clamped weight
        log_w = torch.clamp(log_w, max=clamp)

    adv = inputs.advantages.to(logp.dtype)
    A = torch.where(valid, adv if inputs.advantages_per_token else adv[seq], zero)
    metrics: Dict[str, Tensor] = {}

    # Per-token factors that need no gradient: the caller's is_ratio or the rollout correction (folded into the
    # sequence weight by VESPO instead), and the off-policy sequence mask.
    factor = None if inputs.is_ratio is None else torch.where(valid, inputs.is_ratio.to(logp.dtype), zero)
    if inputs.rollout_logprobs is not None:
        rho, rollout_metrics = rollout_correction(old_m.detach(), inputs.rollout_logprobs, valid, seq, S, config)
        metrics.update(rollout_metrics)
        if rho is not None:
            factor = rho.to(logp.dtype)
    fold = factor if config.objective == "vespo" else None
    if fold is not None:
        factor = None
    if config.off_policy_mask_threshold is not None:
        sampling = old_m if inputs.rollout_logprobs is None else inputs.rollout_logprobs.to(logp.dtype)
        keep = off_policy_keep(logp=logp_m.detach(), sampling=sampling, A=A, valid=valid, seq=seq, S=S,
                               threshold=config.off_policy_mask_threshold)
        factor = keep if factor is None else factor * keep
    # A token whose factor is 0 contributes nothing whatever its importance weight: it takes the finite stand-in
    # weight, so an overflowing weight there is no inf * 0.
    A_live = A if factor is None else torch.where(factor == 0, zero, A)

    objective = config.objective
    unit_w = None  # VESPO, GMPO: the one weight per response the importance_weight/* metrics count
    if objective == "clip":
        w = torch.exp(_live_log_weight(log_w, A_live, config))
        c1 = w if config.delta is None else torch.clamp(w, max=config.delta)
        c2 = torch.clamp(w, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
        per_token = -torch.minimum(c1 * A_live, c2 * A_live)
        if config.clip_ratio_c is not None:  # dual clip: for A < 0 the loss is at most clip_ratio_c * |A|
            per_token = torch.where(A_live < 0, torch.minimum(per_token, -config.clip_ratio_c * A_live), per_token)
    elif objective == "sapo":
        tau = torch.where(A > 0, A.new_tensor(config.sapo_temperature_pos),
                          A.new_tensor(config.sapo_temperature_neg))
        w = torch.exp(_sapo_live_log_weight(log_w, A_live, tau))
        per_token = -torch.sigmoid(tau * (w - 1.0)) * (4.0 / tau) * A_live
    elif objective == "cispo":
        w_hat = cispo_weight(log_w.detach(), config)
        per_token = -w_hat * A_live * logp_m
    elif objective == "vespo":
        per_token, unit_w = _vespo_surrogate(log_ratio=log_ratio, fold=fold, A=A, A_live=A_live, adv=adv,
                                             logp_m=logp_m, lengths=lengths, inputs=inputs, config=config,
                                             metrics=metrics)
    else:
        per_token, unit_w = _gmpo_surrogate(log_ratio=log_ratio, A=A, factor=factor, denom=denom, inputs=inputs,
                                            config=config, metrics=metrics)
    if factor is not None:
        per_token = per_token * factor

    kl = None
    if config.beta > 0:
        kl = k3_kl(torch.where(valid, inputs.ref_logprobs.to(logp.dtype), zero), logp_m)
        if config.use_bias_correction_kl:
            kl = kl * torch.exp(torch.where(valid, log_w, zero))  # the weight counts here whatever the clipping
        per_token = per_token + config.beta * kl
    per_token = torch.where(valid, per_token, zero)

    num_tokens = mask.sum()
    loss = _aggregate(per_token, denom, num_tokens, inputs, config)

    token_mean = num_tokens.clamp(min=1)
    if entropy is not None:  # None only when entropy_coef == 0 (the loss pipeline checked it)
        entropy_mean = torch.where(valid, entropy, zero).sum() / token_mean
        if config.entropy_coef != 0:
            loss = loss - config.entropy_coef * entropy_mean

    with torch.no_grad():
        if unit_w is not None:  # VESPO, GMPO: one weight per response
            metrics.update(_weight_stats(unit_w, lengths > 0))
        elif level == "sequence" and not inputs.advantages_per_token:
            seq_w = torch.exp(seq_log_ratio if clamp is None else torch.clamp(seq_log_ratio, max=clamp))
            metrics.update(_objective_metrics(seq_w, adv, lengths > 0, config))
        else:
            metrics.update(_objective_metrics(torch.exp(log_w.detach()), A, valid, config))
        if entropy is not None:
            metrics["entropy"] = entropy_mean.detach().float()
        if kl is not None:
            metrics["kl"] = (torch.where(valid, kl.detach(), zero).sum() / token_mean).float()
    return LossOutput(loss, metrics)


def _vespo_surrogate(*, log_ratio: Tensor, fold: Optional[Tensor], A: Tensor, A_live: Tensor, adv: Tensor,
                     logp_m: Tensor, lengths: Tensor, inputs: LossInputs, config: GSPOConfig,
                     metrics: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
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


def _gmpo_surrogate(*, log_ratio: Tensor, A: Tensor, factor: Optional[Tensor], denom: Tensor, inputs: LossInputs,
                    config: GSPOConfig, metrics: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
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


def _aggregate(per_token: Tensor, denom: Tensor, num_tokens: Tensor, inputs: LossInputs, config: GSPOConfig) -> Tensor:
    batch = inputs.batch
    S = batch.num_seqs
    aggregation = config.effective_aggregation
    if aggregation == "grpo":
        return (segment_sum(per_token, batch.seq_index, S) / denom).sum() / max(S, 1)
    total = per_token.sum()
    if aggregation == "seq_sum":
        return total / max(S, 1)
    if aggregation == "bnpo":
        return total / num_tokens.clamp(min=1)
    if aggregation == "dr_grpo":
        return total / (max(S, 1) * config.max_completion_length)
    # "dapo": the caller's global token count (validated finite and > 0, used as given), else this batch's
    if inputs.num_items_in_batch is None:
        return total / num_tokens.clamp(min=1)
    return total / inputs.num_items_in_batch.to(per_token.dtype)


# ---------------------------------------------------------------------------------------------
# The objectives' pieces (no gradient flows through any of these but the SAPO stand-in's live branch).
# ---------------------------------------------------------------------------------------------

# log(1e-8): VESPO's lower clamp of the log sequence weight (TRL's, from the paper's implementation).
VESPO_LOG_MIN = math.log(1e-8)
VESPO_LOG_MAX = 20.0
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


def cispo_weight(log_w: Tensor, config: GSPOConfig) -> Tensor:
    """CISPO's detached weight: ``min(w, epsilon_high)`` (``cispo_clip="upper"``) or
    ``clamp(w, 1 - epsilon_low, 1 + epsilon_high)`` (``"band"``)."""
    w = torch.exp(log_w.detach())
    if config.cispo_clip == "upper":
        return torch.clamp(w, max=config.epsilon_high)
    return torch.clamp(w, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)


def vespo_log_weight(log_ratio: Tensor, fold: Optional[Tensor], valid: Tensor, seq: Tensor, S: int) -> Tensor:
    """``[S]`` VESPO's log sequence weight: ``clamp(sum_t clamp(log r_t, -20, 20) + sum_t clamp(log c_t,
    log 1e-8, 20), log 1e-8, 20)`` with ``c_t`` the folded correction factor (detached)."""
    zero = log_ratio.new_zeros(())
    total = torch.where(valid, torch.clamp(log_ratio, -VESPO_LOG_MAX, VESPO_LOG_MAX), zero)
    if fold is not None:
        total = total + torch.where(valid, torch.clamp(torch.log(fold), VESPO_LOG_MIN, VESPO_LOG_MAX), zero)
    return torch.clamp(segment_sum(total, seq, S), VESPO_LOG_MIN, VESPO_LOG_MAX)


def vespo_phi(log_w: Tensor, A: Tensor, config: GSPOConfig) -> Tensor:
    """``phi = exp(lambda + k log w - lambda w)``, ``(k, lambda)`` by ``A >= 0`` (detached; non-finite -> 0)."""
    pos = A >= 0
    k = torch.where(pos, A.new_tensor(config.vespo_k_pos), A.new_tensor(config.vespo_k_neg))
    lam = torch.where(pos, A.new_tensor(config.vespo_lambda_pos), A.new_tensor(config.vespo_lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.where(torch.isfinite(phi), phi, torch.zeros_like(phi)).detach()


def off_policy_keep(logp: Tensor, sampling: Tensor, A: Tensor, valid: Tensor, seq: Tensor, S: int,
                    threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's definition): 1 where ``A >= 0`` or the response's mean
    ``sampling - logp`` (NaN taken as 0) is at most ``threshold``, else 0. Float ``[N]``, detached."""
    zero = logp.new_zeros(())
    d = sampling.to(logp.dtype) - logp
    d = torch.where(valid & ~torch.isnan(d), d, zero)
    lengths = segment_sum(valid.to(logp.dtype), seq, S).clamp(min=1)
    seq_kl = segment_sum(d, seq, S) / lengths
    return ((A >= 0) | (seq_kl[seq] <= threshold)).to(logp.dtype)


def rollout_correction(old: Tensor, rollout: Tensor, valid: Tensor, seq: Tensor, S: int,
                       config: GSPOConfig) -> Tuple[Optional[Tensor], Dict[str, Tensor]]:
    """The rollout correction weight ``[N]`` (None without ``config.rollout_correction``) and the mismatch
    metrics, from the trainer's log-probs ``old`` and the engine's ``rollout`` (detached; docs/math.md).

    ``d_t = old_t - rollout_t`` (0 at masked tokens and where ``rollout`` is NaN); token modes use
    ``rho_t = e^{d_t}``, sequence modes ``rho_i = e^{sum_t d_t}`` (TRL), ``sequence_masked_tis`` keeps a
    response whose geometric mean ``e^{mean_t d_t}`` lies in ``[C_min, C_max]`` and weights its tokens by
    ``min(rho_t, C_max)``; truncation clamps to ``[C_min, C_max]``, masking zeroes what leaves it.
    """
    mode = config.rollout_correction
    zero = old.new_zeros(())
    rollout = rollout.to(old.dtype)
    d = old - rollout
    d = torch.where(valid & ~torch.isnan(d), d, zero)
    fmask = valid.to(old.dtype)
    n_tok = fmask.sum().clamp(min=1)
    lengths = segment_sum(fmask, seq, S)
    counted = lengths > 0
    lo, hi = config.rollout_bounds
    metrics = {"rollout/kl": (-d.sum() / n_tok).float()}

    def bounded(x: Tensor) -> Tensor:  # truncation to [lo, hi]
        return torch.clamp(x, min=lo, max=hi)

    def inside(x: Tensor) -> Tensor:
        ok = torch.ones_like(x, dtype=torch.bool)
        if lo is not None:
            ok = ok & (x >= lo)
        if hi is not None:
            ok = ok & (x <= hi)
        return ok

    per_sequence = mode in ("sequence_truncate", "sequence_mask")
    if per_sequence:
        rho_seq = torch.exp(segment_sum(d, seq, S))
        rho_seq = bounded(rho_seq) if mode == "sequence_truncate" else torch.where(inside(rho_seq), rho_seq, zero)
        rho = torch.where(valid, rho_seq[seq], zero)
        stats = _weight_stats(rho_seq, counted)
    else:
        rho = torch.exp(d)
        if mode == "token_truncate":
            rho = bounded(rho)
        elif mode in ("token_mask", "icepop"):
            rho = torch.where(inside(rho), rho, zero)
        elif mode == "sequence_masked_tis":
            keep = inside(torch.exp(segment_sum(d, seq, S) / lengths.clamp(min=1)))
            rho = torch.where(keep[seq], torch.clamp(rho, max=hi), zero)
        rho = torch.where(valid, rho, zero)
        stats = _weight_stats(rho, valid)
    metrics["rollout/masked_fraction"] = ((valid & (rho == 0)).sum() / n_tok).float()
    metrics["rollout/weight_min"] = stats["importance_weight/min"]
    metrics["rollout/weight_mean"] = stats["importance_weight/mean"]
    metrics["rollout/weight_max"] = stats["importance_weight/max"]
    return (None if mode is None else rho.detach()), metrics


def _live_log_weight(log_w: Tensor, A: Tensor, config: GSPOConfig) -> Tensor:
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


def k3_kl(ref_logp: Tensor, logp: Tensor) -> Tensor:
    """The k3 estimator of KL(policy || reference) per token: ``exp(d) - d - 1`` with ``d = ref - logp``."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def clip_flags(w: Tensor, A: Tensor, config: GSPOConfig) -> Tuple[Tensor, Tensor]:
    """``(low, high)`` bool: the weight left the band on the side where clipping removes the gradient
    (``w < 1 - epsilon_low`` with ``A < 0``; ``w > 1 + epsilon_high`` with ``A > 0``). The one definition
    of the ``clip_ratio/*`` metrics (the TRL drop-in weights them across processes itself)."""
    low = (w < 1.0 - config.epsilon_low) & (A < 0)
    high = (w > 1.0 + config.epsilon_high) & (A > 0)
    return low, high


def _objective_metrics(w: Tensor, A: Tensor, valid: Tensor, config: GSPOConfig) -> Dict[str, Tensor]:
    """The clip metrics of the objective (TRL's names) and the importance-weight statistics over the counted
    items (responses or tokens): ``clip_ratio/*`` for the clipped surrogate, ``cispo_clip_ratio`` for CISPO
    (upper: ``w > epsilon_high`` with ``A > 0``, TRL; band: ``w`` outside the band, verl), none for SAPO."""
    count = valid.sum()
    n = count.clamp(min=1).to(torch.float32)
    out: Dict[str, Tensor] = {}
    if config.objective == "clip":
        low, high = clip_flags(w, A, config)
        low, high = valid & low, valid & high
        out["clip_ratio/low_mean"] = low.sum() / n
        out["clip_ratio/high_mean"] = high.sum() / n
        out["clip_ratio/region_mean"] = (low | high).sum() / n
    elif config.objective == "cispo":
        if config.cispo_clip == "upper":
            clipped = (w > config.epsilon_high) & (A > 0)
        else:
            clipped = (w < 1.0 - config.epsilon_low) | (w > 1.0 + config.epsilon_high)
        out["cispo_clip_ratio"] = (valid & clipped).sum() / n
    out.update(_weight_stats(w, valid))
    return out


def _weight_stats(w: Tensor, valid: Tensor) -> Dict[str, Tensor]:
    """``importance_weight/{mean,min,max}`` of ``w`` over ``valid`` (0 when nothing counts), fp32."""
    count = valid.sum()
    n = count.clamp(min=1).to(torch.float32)
    w32 = w.to(torch.float32)
    some = count > 0
    zero = w32.new_zeros(())
    return {
        "importance_weight/mean": torch.where(valid, w32, zero).sum() / n,
        "importance_weight/min": torch.where(some, torch.where(valid, w32, w32.new_tensor(float("inf"))).amin(), zero)
        if w32.numel()
        else zero,
        "importance_weight/max": torch.where(some, torch.where(valid, w32, w32.new_tensor(float("-inf"))).amax(), zero)
        if w32.numel()
        else zero,
    }
