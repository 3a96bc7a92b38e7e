"""The rollout correction's ``@triton.jit`` helpers of the sequence kernel: the correction weight, the
trainer - rollout log-ratio, the divergence gates' statistics and their band."""

from __future__ import annotations

import triton
import triton.language as tl

from gspo_kernels.backends.triton.sequence_slots import (
    _LOG_P_HIGH,
    _LOG_P_LOW,
    RC_ICEPOP,
    RC_SEQUENCE_BINARY_KL_MASK,
    RC_SEQUENCE_MASK,
    RC_SEQUENCE_MASKED_TIS,
    RC_SEQUENCE_TRUNCATE,
    RC_SEQUENCE_TV_MASK,
    RC_TOKEN_BINARY_KL_MASK,
    RC_TOKEN_MASK,
    RC_TOKEN_TRUNCATE,
    RC_TOKEN_TV_MASK,
)


@triton.jit
def _rollout_weight(d, seq_value, lo, hi, ROLLOUT: tl.constexpr):
    """The rollout correction weight of tokens with trainer - rollout log-ratio ``d`` (``seq_value``: the
    response's sum of ``d`` for the sequence modes, its mean for ``sequence_masked_tis``); ``RC_NONE``: the raw
    ratio (metrics only)."""
    if ROLLOUT == RC_SEQUENCE_TRUNCATE:
        rho = tl.minimum(tl.maximum(tl.exp(seq_value + 0.0 * d), lo), hi)
    elif ROLLOUT == RC_SEQUENCE_MASK:
        e = tl.exp(seq_value + 0.0 * d)
        rho = tl.where((e >= lo) & (e <= hi), e, 0.0)
    elif ROLLOUT == RC_SEQUENCE_MASKED_TIS:
        g = tl.exp(seq_value)
        rho = tl.where((g >= lo) & (g <= hi), tl.minimum(tl.exp(d), hi), 0.0)
    elif ROLLOUT == RC_TOKEN_TRUNCATE:
        rho = tl.minimum(tl.maximum(tl.exp(d), lo), hi)
    elif (ROLLOUT == RC_TOKEN_MASK) | (ROLLOUT == RC_ICEPOP):
        e = tl.exp(d)
        rho = tl.where((e >= lo) & (e <= hi), e, 0.0)
    else:
        rho = tl.exp(d)
    return rho


@triton.jit
def _rollout_log_ratio(lp, old, roll_ptr, idx, inside, on):
    """``d = old - rollout`` of the tile, 0 at masked tokens and where the engine's log-prob is NaN."""
    d = old - tl.load(roll_ptr + idx, mask=inside, other=0.0)
    return tl.where(on & (d == d), d, 0.0)


@triton.jit
def _divergence(old, roll_ptr, idx, inside, on, ROLLOUT: tl.constexpr):
    """The sampled token's divergence between the engine (``p = e^{rollout}``) and the trainer (``q = e^{old}``),
    both clamped to ``[eps, 1 - eps]`` through their logs: the binary KL ``p log(p/q) + (1-p) log((1-p)/(1-q))``
    or the total variation ``|p - q|`` by ``ROLLOUT``; 0 at masked tokens and where the engine's log-prob is NaN."""
    rollout = tl.load(roll_ptr + idx, mask=inside, other=0.0)
    scored = on & (rollout == rollout)
    log_p = tl.minimum(tl.maximum(tl.where(scored, rollout, 0.0), _LOG_P_LOW), _LOG_P_HIGH)
    log_q = tl.minimum(tl.maximum(tl.where(scored, old, 0.0), _LOG_P_LOW), _LOG_P_HIGH)
    p = tl.exp(log_p)
    q = tl.exp(log_q)
    if (ROLLOUT == RC_TOKEN_TV_MASK) | (ROLLOUT == RC_SEQUENCE_TV_MASK):
        value = tl.abs(p - q)
    else:
        value = p * (log_p - log_q) + (1.0 - p) * (tl.log(1.0 - p) - tl.log(1.0 - q))
    return tl.where(scored, value, 0.0)


@triton.jit
def _token_statistic(d, old, roll_ptr, idx, inside, on, ROLLOUT: tl.constexpr):
    """The per-token statistic of a token mode: the sampled token's divergence for the divergence gates, else the
    ratio ``e^d``."""
    if (ROLLOUT == RC_TOKEN_BINARY_KL_MASK) | (ROLLOUT == RC_TOKEN_TV_MASK):
        stat = _divergence(old, roll_ptr, idx, inside, on, ROLLOUT)
    else:
        stat = tl.exp(d)
    return stat


@triton.jit
def _sequence_statistic(rc_seq, ROLLOUT: tl.constexpr):
    """The per-response statistic of a sequence mode from ``rc_seq`` (the log of the product or geometric mean of
    the ratios; the mean divergence for the divergence gates)."""
    if (ROLLOUT == RC_SEQUENCE_BINARY_KL_MASK) | (ROLLOUT == RC_SEQUENCE_TV_MASK):
        stat = rc_seq
    else:
        stat = tl.exp(rc_seq)
    return stat


@triton.jit
def _in_band(stat, lo, hi):
    return (stat >= lo) & (stat <= hi)
