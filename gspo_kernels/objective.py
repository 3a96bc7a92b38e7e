"""The light per-sequence stage in PyTorch: importance weights, clipping, KL, aggregation, metrics.

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
    """GSPO / GRPO loss from per-token log-probs ``logp [N]`` and entropies ``entropy [N]`` (fp32).

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
    is_ratio = None if inputs.is_ratio is None else torch.where(valid, inputs.is_ratio.to(logp.dtype), zero)
    # A token whose correction weight is 0 (masked by the rollout correction) contributes nothing whatever its
    # importance weight: it takes the finite stand-in weight, so an overflowing weight there is no inf * 0.
    A_live = A if is_ratio is None else torch.where(is_ratio == 0, zero, A)
    w = torch.exp(_live_log_weight(log_w, A_live, config))
    c1 = w if config.delta is None else torch.clamp(w, max=config.delta)
    c2 = torch.clamp(w, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
    per_token = -torch.minimum(c1 * A_live, c2 * A_live)
    if is_ratio is not None:
        per_token = per_token * is_ratio

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
    if entropy is not None:
        entropy_mean = torch.where(valid, entropy, zero).sum() / token_mean
        if config.entropy_coef != 0:
            loss = loss - config.entropy_coef * entropy_mean
    elif config.entropy_coef != 0:
        raise ValueError("entropy is required when config.entropy_coef != 0")

    with torch.no_grad():
        if level == "sequence" and not inputs.advantages_per_token:
            seq_w = torch.exp(seq_log_ratio if clamp is None else torch.clamp(seq_log_ratio, max=clamp))
            metrics = _weight_metrics(seq_w, adv, lengths > 0, config)
        else:
            metrics = _weight_metrics(torch.exp(log_w.detach()), A, valid, config)
        if entropy is not None:
            metrics["entropy"] = entropy_mean.detach().float()
        if kl is not None:
            metrics["kl"] = (torch.where(valid, kl.detach(), zero).sum() / token_mean).float()
    return LossOutput(loss, metrics)


def _aggregate(per_token: Tensor, denom: Tensor, num_tokens: Tensor, inputs: LossInputs, config: GSPOConfig) -> Tensor:
    batch = inputs.batch
    S = batch.num_seqs
    if config.loss_type == "grpo":
        return (segment_sum(per_token, batch.seq_index, S) / denom).sum() / max(S, 1)
    total = per_token.sum()
    if config.loss_type == "bnpo":
        return total / num_tokens.clamp(min=1)
    if config.loss_type == "dr_grpo":
        return total / (max(S, 1) * config.max_completion_length)
    # "dapo": the caller's global token count (validated finite and > 0, used as given), else this batch's
    if inputs.num_items_in_batch is None:
        return total / num_tokens.clamp(min=1)
    return total / inputs.num_items_in_batch.to(per_token.dtype)


def _live_log_weight(log_w: Tensor, A: Tensor, config: GSPOConfig) -> Tensor:
    """``log_w`` where the token's surrogate ``-min(c1 A, c2 A)`` depends on the weight; a detached, finite
    stand-in giving the same clipped value elsewhere (its gradient is exactly 0 there, with no ``0 * inf``).

    ``c1 = min(w, delta)`` (or ``w``), ``c2 = clamp(w, 1 - eps_low, 1 + eps_high)``. The value is constant
    in ``w`` when ``A == 0``, or when the branch ``torch.minimum`` picks is a clamped constant (for a tie,
    when both are). Only those tokens get the stand-in: ``min(log_w, log(cap))`` with ``cap`` above every
    clip edge, which leaves the clipped values unchanged.
    """
    lo, hi, delta = 1.0 - config.epsilon_low, 1.0 + config.epsilon_high, config.delta
    with torch.no_grad():
        lw = log_w.detach()
        w = torch.exp(lw)  # may be inf: used for comparisons only
        c1 = w if delta is None else torch.clamp(w, max=delta)
        c2 = torch.clamp(w, lo, hi)
        c1_const = torch.zeros_like(w, dtype=torch.bool) if delta is None else w > delta
        c2_const = (w < lo) | (w > hi)
        a1, a2 = c1 * A, c2 * A
        frozen = (A == 0) | ((a1 < a2) & c1_const) | ((a2 < a1) & c2_const) | (c1_const & c2_const)
        cap = math.log(2.0 * max(hi, delta or hi))
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


def _weight_metrics(w: Tensor, A: Tensor, valid: Tensor, config: GSPOConfig) -> Dict[str, Tensor]:
    """Clip shares and importance-weight stats over the counted items (responses or tokens)."""
    count = valid.sum()
    n = count.clamp(min=1).to(torch.float32)
    low, high = clip_flags(w, A, config)
    low, high = valid & low, valid & high
    w32 = w.to(torch.float32)
    some = count > 0
    zero = w32.new_zeros(())
    return {
        "clip_ratio/low_mean": low.sum() / n,
        "clip_ratio/high_mean": high.sum() / n,
        "clip_ratio/region_mean": (low | high).sum() / n,
        "importance_weight/mean": torch.where(valid, w32, zero).sum() / n,
        "importance_weight/min": torch.where(some, torch.where(valid, w32, w32.new_tensor(float("inf"))).amin(), zero)
        if w32.numel()
        else zero,
        "importance_weight/max": torch.where(some, torch.where(valid, w32, w32.new_tensor(float("-inf"))).amax(), zero)
        if w32.numel()
        else zero,
    }
