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

from gspo_kernels import objectives
from gspo_kernels.config import ROLLOUT_DIVERGENCES, ROLLOUT_PROBABILITY_CLAMP, ROLLOUT_SEQUENCE_MODES, GSPOConfig
from gspo_kernels.layout import LossInputs
from gspo_kernels.objectives.base import segment_sum

__all__ = ["LossOutput", "gspo_objective", "segment_sum", "off_policy_keep", "rollout_correction", "k3_kl"]


class LossOutput(NamedTuple):
    """``loss``: 0-dim differentiable tensor; ``metrics``: detached 0-dim tensors (TRL's names)."""

    loss: Tensor
    metrics: Dict[str, Tensor]


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
    spec = objectives.objective(config.objective)
    fold = factor if spec.folds_correction else None
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

    # The objective's per-token loss, and the one weight per response its metrics count (None: per item).
    per_token, unit_w = spec.surrogate(log_w=log_w, log_ratio=log_ratio, A=A, A_live=A_live, adv=adv, logp_m=logp_m,
                                       lengths=lengths, denom=denom, fold=fold, factor=factor, inputs=inputs,
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
        if unit_w is not None:  # one weight per response
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

    ``d_t = old_t - rollout_t`` (0 at masked tokens and where ``rollout`` is NaN). Each mode reads a statistic per
    unit (a token, or a response for :data:`~gspo_kernels.config.ROLLOUT_SEQUENCE_MODES`): the ratio ``e^{d_t}``,
    the sequence's product ``e^{sum_t d_t}`` (``sequence_truncate`` / ``_mask``, TRL) or geometric mean
    ``e^{mean_t d_t}`` (``sequence_masked_tis``, ``sequence_geometric_mask``), or the sampled token's binary KL /
    total variation (per token, or its mean over the response). Truncation clamps the ratio into
    ``[C_min, C_max]``; the other modes keep a unit whose statistic lies in ``[C_min, C_max]`` with its ratio
    (``sequence_masked_tis``: ``min(e^{d_t}, C_max)``; the divergence and geometric gates: ``e^{d_t}``) and
    give the others 0. ``rollout/is_filter_ratio``: the share of units whose statistic left the band.
    """
    mode = config.rollout_correction
    zero = old.new_zeros(())
    rollout = rollout.to(old.dtype)
    d = old - rollout
    scored = valid & ~torch.isnan(d)
    d = torch.where(scored, d, zero)
    fmask = valid.to(old.dtype)
    n_tok = fmask.sum().clamp(min=1)
    lengths = segment_sum(fmask, seq, S)
    counted = lengths > 0
    lo, hi = config.rollout_bounds
    metrics = {"rollout/kl": (-d.sum() / n_tok).float()}

    def inside(x: Tensor) -> Tensor:
        ok = torch.ones_like(x, dtype=torch.bool)
        if lo is not None:
            ok = ok & (x >= lo)
        if hi is not None:
            ok = ok & (x <= hi)
        return ok

    ratio = torch.exp(d)
    per_response = mode in ROLLOUT_SEQUENCE_MODES
    divergence = ROLLOUT_DIVERGENCES.get(mode)
    if divergence is not None:  # the sampled token's divergence, 0 where the engine gave no log-prob
        stat = torch.where(scored, _token_divergence(old, rollout, divergence), zero)
        if per_response:
            stat = segment_sum(stat, seq, S) / lengths.clamp(min=1)
    elif mode in ("sequence_truncate", "sequence_mask"):  # TRL's product ratio
        stat = torch.exp(segment_sum(d, seq, S))
    elif mode in ("sequence_masked_tis", "sequence_geometric_mask"):  # the geometric mean
        stat = torch.exp(segment_sum(d, seq, S) / lengths.clamp(min=1))
    else:  # the token modes of the ratio (and no mode: the raw ratios, for the metrics)
        stat = ratio
    keep = inside(stat)
    keep_t = keep[seq] if per_response else keep
    if mode in ("token_truncate", "sequence_truncate"):
        rho = torch.clamp(stat, min=lo, max=hi)
    elif mode == "sequence_mask":
        rho = torch.where(keep, stat, zero)
    elif mode == "sequence_masked_tis":
        rho = torch.where(keep_t, torch.clamp(ratio, max=hi), zero)
    elif mode is None:
        rho = ratio
    else:  # token_mask, icepop, the geometric and divergence gates: the kept units' tokens keep their ratio
        rho = torch.where(keep_t, ratio, zero)
    if per_response:
        units = counted
        if mode in ("sequence_truncate", "sequence_mask"):  # one weight per response
            stats = _weight_stats(rho, counted)
            rho = rho[seq]
        rho = torch.where(valid, rho, zero)
        if mode not in ("sequence_truncate", "sequence_mask"):
            stats = _weight_stats(rho, valid)
    else:
        units = valid
        rho = torch.where(valid, rho, zero)
        stats = _weight_stats(rho, valid)
    filtered = (units & ~keep).sum() if mode is not None else units.new_zeros((), dtype=torch.long)
    metrics["rollout/masked_fraction"] = ((valid & (rho == 0)).sum() / n_tok).float()
    metrics["rollout/is_filter_ratio"] = (filtered / units.sum().clamp(min=1)).float()
    metrics["rollout/weight_min"] = stats["importance_weight/min"]
    metrics["rollout/weight_mean"] = stats["importance_weight/mean"]
    metrics["rollout/weight_max"] = stats["importance_weight/max"]
    return (None if mode is None else rho.detach()), metrics


def _token_divergence(old: Tensor, rollout: Tensor, kind: str) -> Tensor:
    """The sampled token's divergence between the engine (``p = e^{rollout}``) and the trainer (``q = e^{old}``),
    both clamped to ``[eps, 1 - eps]`` (``eps`` = :data:`~gspo_kernels.config.ROLLOUT_PROBABILITY_CLAMP`):
    ``"binary_kl"``, ``p log(p/q) + (1-p) log((1-p)/(1-q))``, or ``"tv"``, ``|p - q|``. The clamp is taken on
    the log-probs (``log p = clamp(rollout, log eps, log(1 - eps))``, the same values), so ``log p`` is exact."""
    low, high = math.log(ROLLOUT_PROBABILITY_CLAMP), math.log1p(-ROLLOUT_PROBABILITY_CLAMP)
    log_p = torch.clamp(torch.nan_to_num(rollout), low, high)
    log_q = torch.clamp(torch.nan_to_num(old), low, high)
    p, q = torch.exp(log_p), torch.exp(log_q)
    if kind == "tv":
        return (p - q).abs()
    return p * (log_p - log_q) + (1 - p) * (torch.log(1 - p) - torch.log(1 - q))


def k3_kl(ref_logp: Tensor, logp: Tensor) -> Tensor:
    """The k3 estimator of KL(policy || reference) per token: ``exp(d) - d - 1`` with ``d = ref - logp``."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def _objective_metrics(w: Tensor, A: Tensor, valid: Tensor, config: GSPOConfig) -> Dict[str, Tensor]:
    """The clip metrics of the objective (TRL's names; ``Objective.clip_metrics``) and the importance-weight
    statistics over the counted items (responses or tokens)."""
    out: Dict[str, Tensor] = dict(objectives.objective(config.objective).clip_metrics(w, A, valid, config))
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
