"""The fused sequence stage's kernels: ``(logp [N], entropy [N]) -> loss`` with importance weights, the objective
of the config (clipped surrogate with optional dual clip, SAPO, CISPO, VESPO, GMPO), the off-policy mask, the
rollout correction, IS correction, KL, aggregation, metrics and gradients. Their launcher, the autograd Function
and the backend's objective (:func:`~gspo_kernels.backends.triton.sequence.fused_objective`) are in
``sequence.py``.

Two launches (:func:`sequence_stage`), both deterministic (fixed reduction order, no floating-point atomics):

1. :func:`gspo_sequence_kernel`, one program per response ``i`` (a 1-D grid over ``cu_seqlens``; the padded
   layout arrives as regular ``cu_seqlens``). Pass 1 (:func:`_response_sums`) forms the response's sums:
   ``|y_i|``, ``sum_t (logp - old)``, the rollout log-ratio sum, the off-policy gap and the objective's own two
   sums (VESPO's log weight; GMPO's clipped log-ratio and advantage sums). Pass 2 computes, per token, the weight ``w``, the objective's loss
   ``l_t`` (times the correction factor, plus ``beta * kl_t``), the response's partial sums (the columns
   ``P_*``) and the gradient coefficient ``c_t = dL/dlogp_t`` up to the global divisor; pass 3 adds the terms
   that flow through a per-response quantity: the mean log-ratio at the ``"sequence"`` level
   (``w_i / |y_i| * sum_t' dl_t'/dw``), and the objective's own (GMPO's geometric mean).
2. :func:`gspo_reduce_kernel`, a single program: sums (or takes the min / max of) the ``[S, PARTIALS_STRIDE]``
   partials in a fixed order and writes the loss, the metrics and the two global gradient scales (``O_*``).

``sequence.py``'s :class:`TritonSequenceObjective` turns the coefficients into gradients with
``dL/dlogp = c * (grad_out * out[O_SCALE_LOGP])`` and ``dL/dH = mask * (grad_out * out[O_SCALE_ENTROPY])``:
it saves the per-token coefficients ``[N]``, so its backward is two ``[N]`` multiplications.

Per token (docs/math.md): ``c1 = min(w, delta)``, ``c2 = clamp(w, 1 - eps_low, 1 + eps_high)``,
``l = -min(c1 A, c2 A)``. ``dl/dw`` follows PyTorch's subgradients of the reference: the clamps pass the
gradient on their closed intervals, and a tie ``c1 A == c2 A`` splits it in halves (``torch.minimum``).

Overflow: a weight ``w = e^(logp - old)`` may be ``inf`` in fp32 (``old = logp - 100``) where the float64
reference still has a finite ``e^100``. Every product with a weight is taken as ``_times(a, w)``: a factor
``a == 0`` (a clipped token's ``dl/dw``, a zero advantage, a zero KL term) gives exactly 0, never
``0 * inf = NaN``; a clipped or ``delta``-capped response therefore has finite loss and gradients.

The level, aggregation and rollout-mode codes are the positions of the names in the config's tuples; the
kernels compare them with the named constants of ``sequence_slots.py``. The objective is no code: its
``@triton.jit`` helpers (``gspo_kernels/backends/triton/objectives/<name>.py``, ``TRITON``) arrive as the ``HELPERS`` constexpr, called by
position (``H_*``). The per-token steps of the sequence kernel are ``@triton.jit`` helpers (inlined by the
compiler: the same code as one function).
"""

from __future__ import annotations

import triton
import triton.language as tl

from gspo_kernels.backends.triton.sequence_rollout import (
    _divergence,
    _in_band,
    _rollout_log_ratio,
    _rollout_weight,
    _sequence_statistic,
    _token_statistic,
)
from gspo_kernels.backends.triton.sequence_slots import (
    H_CLIP_COUNTS,
    H_FINISH,
    H_RESPONSE,
    H_SUMS,
    H_TOKEN,
    LEVEL_SEQUENCE,
    LEVEL_SEQUENCE_TOKEN,
    LEVEL_TOKEN,
    LOSS_BNPO,
    LOSS_DAPO,
    LOSS_DR_GRPO,
    MAX_COLUMNS,
    MIN_COLUMNS,
    O_AUX_MEAN,
    O_ENTROPY,
    O_HIGH,
    O_KL,
    O_LOSS,
    O_LOW,
    O_REGION,
    O_ROLLOUT_FILTERED,
    O_ROLLOUT_KL,
    O_ROLLOUT_MASKED,
    O_RW_MAX,
    O_RW_MEAN,
    O_RW_MIN,
    O_SCALE_ENTROPY,
    O_SCALE_LOGP,
    O_W_MAX,
    O_W_MEAN,
    O_W_MIN,
    P_AUX,
    P_AUX_UNITS,
    P_CLIP_UNITS,
    P_COUNT,
    P_ENTROPY,
    P_HIGH,
    P_KL,
    P_LOSS,
    P_LOW,
    P_R_DIFF,
    P_R_ZERO,
    P_RF,
    P_RF_UNITS,
    P_RW_MAX,
    P_RW_MIN,
    P_RW_SUM,
    P_RW_UNITS,
    P_TOKENS,
    P_UNITS,
    P_W_MAX,
    P_W_MIN,
    P_W_SUM,
    PARTIALS_STRIDE,
    RC_NONE,
    RC_SEQUENCE_BINARY_KL_MASK,
    RC_SEQUENCE_GEOMETRIC_MASK,
    RC_SEQUENCE_MASK,
    RC_SEQUENCE_MASKED_TIS,
    RC_SEQUENCE_TRUNCATE,
    RC_SEQUENCE_TV_MASK,
    RC_TOKEN_BINARY_KL_MASK,
    RC_TOKEN_TV_MASK,
)


@triton.jit
def _times(a, w):
    """``a * w`` where a zero ``a`` gives exactly 0 even when ``w`` overflowed to ``inf``."""
    return tl.where(a == 0, 0.0, a * w)


@triton.jit
def _masked_load(ptr, idx, inside, on):
    """The tile of ``ptr`` at ``idx``: 0 at masked tokens and past the response's end."""
    return tl.where(on, tl.load(ptr + idx, mask=inside, other=0.0), 0.0)


@triton.jit
def _old_logprobs(old_ptr, idx, inside, on, lp):
    """The tile's sampling-time log-probs (0 at masked tokens); ``lp`` itself when ``old_ptr`` is None (on-policy:
    every weight is 1)."""
    if old_ptr is not None:
        old = _masked_load(old_ptr, idx, inside, on)
    else:
        old = lp
    return old


@triton.jit
def _advantages(adv_ptr, idx, inside, adv_seq, ADV_PER_TOKEN: tl.constexpr, BLOCK_T: tl.constexpr):
    """The tile's advantages: per token (``ADV_PER_TOKEN``), else the response's ``adv_seq`` on every token."""
    if ADV_PER_TOKEN:
        adv = tl.load(adv_ptr + idx, mask=inside, other=0.0)
    else:
        adv = tl.full([BLOCK_T], 1.0, tl.float32) * adv_seq
    return adv


@triton.jit
def _response_sums(logp_ptr, old_ptr, mask_ptr, roll_ptr, isr_ptr, adv_ptr, start, end, adv_seq, lo, hi,
                   eps_low, eps_high, LEVEL: tl.constexpr, HELPERS: tl.constexpr, ROLLOUT: tl.constexpr,
                   HAS_OPSM: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, BLOCK_T: tl.constexpr):
    """Pass 1 over the response ``[start, end)``: ``|y_i|``, ``sum (logp - old)``, ``sum (old - rollout)``,
    the off-policy gap ``sum (sampling - logp)``, the objective's two sums (``HELPERS[H_SUMS]``) and the sum of
    the sampled tokens' divergences (the sequence divergence gates) (each only when the options and the inputs
    present need it; the others stay 0)."""
    offs = tl.arange(0, BLOCK_T)
    tok_acc = tl.zeros([BLOCK_T], tl.float32)
    r_acc = tl.zeros([BLOCK_T], tl.float32)
    d_acc = tl.zeros([BLOCK_T], tl.float32)
    gap_acc = tl.zeros([BLOCK_T], tl.float32)
    s1_acc = tl.zeros([BLOCK_T], tl.float32)
    s2_acc = tl.zeros([BLOCK_T], tl.float32)
    div_acc = tl.zeros([BLOCK_T], tl.float32)
    for t0 in range(start, end, BLOCK_T):
        idx = t0 + offs
        inside = idx < end
        token_mask = tl.load(mask_ptr + idx, mask=inside, other=0.0)
        on = token_mask > 0
        tok_acc += token_mask
        lp = _masked_load(logp_ptr, idx, inside, on)
        old = _old_logprobs(old_ptr, idx, inside, on, lp)
        r = lp - old
        if LEVEL != LEVEL_TOKEN:
            r_acc += r
        d = tl.zeros([BLOCK_T], tl.float32)
        if roll_ptr is not None:
            d = _rollout_log_ratio(lp, old, roll_ptr, idx, inside, on)
            d_acc += d
            if (ROLLOUT == RC_SEQUENCE_BINARY_KL_MASK) | (ROLLOUT == RC_SEQUENCE_TV_MASK):
                div_acc += _divergence(old, roll_ptr, idx, inside, on, ROLLOUT)
            if HAS_OPSM:
                g = tl.load(roll_ptr + idx, mask=inside, other=0.0) - lp
                gap_acc += tl.where(on & (g == g), g, 0.0)
        elif HAS_OPSM:
            gap_acc += old - lp
        adv = _advantages(adv_ptr, idx, inside, adv_seq, ADV_PER_TOKEN, BLOCK_T)
        x1, x2 = HELPERS[H_SUMS](r, adv, on, isr_ptr, roll_ptr, idx, inside, d, lo, hi, eps_low, eps_high,
                                   ROLLOUT, BLOCK_T)
        s1_acc += x1
        s2_acc += x2
    return (tl.sum(tok_acc, axis=0), tl.sum(r_acc, axis=0), tl.sum(d_acc, axis=0), tl.sum(gap_acc, axis=0),
            tl.sum(s1_acc, axis=0), tl.sum(s2_acc, axis=0), tl.sum(div_acc, axis=0))


@triton.jit
def _token_weight(lp, old_ptr, idx, inside, on, w_seq, seq_pass, log_ratio_clamp, LEVEL: tl.constexpr,
                  HAS_CLAMP: tl.constexpr, BLOCK_T: tl.constexpr):
    """``(w, dw)``: the tile's importance weights and ``d w_t / d logp_t`` (0 at the ``"sequence"`` level,
    whose gradient flows through the mean log-ratio in pass 3)."""
    if LEVEL == LEVEL_TOKEN:
        if old_ptr is not None:
            lr = lp - _masked_load(old_ptr, idx, inside, on)
            if HAS_CLAMP:
                w = tl.exp(tl.minimum(lr, log_ratio_clamp))
                dw = tl.where(lr <= log_ratio_clamp, w, 0.0)
            else:
                w = tl.exp(lr)
                dw = w
        else:
            w = tl.full([BLOCK_T], 1.0, tl.float32)
            dw = w
    else:
        w = tl.full([BLOCK_T], 1.0, tl.float32) * w_seq
        if LEVEL == LEVEL_SEQUENCE_TOKEN:
            dw = w * seq_pass  # GSPO-token: the sequence value, the token's own gradient
        else:
            dw = tl.zeros([BLOCK_T], tl.float32)  # GSPO: flows through the mean (pass 3)
    return w, dw


@triton.jit
def _correction_factor(lp, adv, old_ptr, is_ratio_ptr, rollout_ptr, idx, inside, on, rc_seq, rc_lo, rc_hi, seq_gap,
                       opsm_threshold, rz_acc, rw_acc, rw_min, rw_max, rf_acc, FOLD: tl.constexpr,
                       ROLLOUT: tl.constexpr, HAS_OPSM: tl.constexpr, BLOCK_T: tl.constexpr):
    """``(f, rz_acc, rw_acc, rw_min, rw_max, rf_acc)``: the tile's correction factor ``f_t`` (the IS ratio, or the
    rollout weight; an objective that folds them into its weight (``FOLD``) takes them in pass 1 instead) times
    the off-policy mask, and the rollout statistics (zero weights, sum, min, max; tokens whose statistic left the
    band, for the token modes) with the tile added."""
    f = tl.full([BLOCK_T], 1.0, tl.float32)
    if is_ratio_ptr is not None:
        if not FOLD:
            f = tl.load(is_ratio_ptr + idx, mask=inside, other=0.0)
    if rollout_ptr is not None:
        old = _old_logprobs(old_ptr, idx, inside, on, lp)
        d = _rollout_log_ratio(lp, old, rollout_ptr, idx, inside, on)
        if ((ROLLOUT == RC_SEQUENCE_TRUNCATE) | (ROLLOUT == RC_SEQUENCE_MASK) | (ROLLOUT == RC_SEQUENCE_MASKED_TIS)
                | (ROLLOUT == RC_SEQUENCE_GEOMETRIC_MASK) | (ROLLOUT == RC_SEQUENCE_BINARY_KL_MASK)
                | (ROLLOUT == RC_SEQUENCE_TV_MASK)):  # one statistic per response (its filter counted once)
            stat = tl.full([BLOCK_T], 1.0, tl.float32) * _sequence_statistic(rc_seq, ROLLOUT)
        else:
            stat = _token_statistic(d, old, rollout_ptr, idx, inside, on, ROLLOUT)
            if ROLLOUT != RC_NONE:
                rf_acc += (on & ~_in_band(stat, rc_lo, rc_hi)).to(tl.float32)
        if ((ROLLOUT == RC_SEQUENCE_GEOMETRIC_MASK) | (ROLLOUT == RC_TOKEN_BINARY_KL_MASK)
                | (ROLLOUT == RC_SEQUENCE_BINARY_KL_MASK) | (ROLLOUT == RC_TOKEN_TV_MASK)
                | (ROLLOUT == RC_SEQUENCE_TV_MASK)):  # the gates: a kept unit's tokens keep their ratio e^d
            rho = tl.where(on & _in_band(stat, rc_lo, rc_hi), tl.exp(d), 0.0)
        else:
            rho = tl.where(on, _rollout_weight(d, rc_seq, rc_lo, rc_hi, ROLLOUT), 0.0)
        if ROLLOUT != RC_NONE:
            rz_acc += (on & (rho == 0)).to(tl.float32)
            if not FOLD:
                f = rho
        rw_acc += rho
        rw_min = tl.minimum(rw_min, tl.where(on, rho, float("inf")))
        rw_max = tl.maximum(rw_max, tl.where(on, rho, float("-inf")))
    if HAS_OPSM:
        f = f * tl.where(adv >= 0, 1.0, tl.where(seq_gap <= opsm_threshold, 1.0, 0.0))
    return f, rz_acc, rw_acc, rw_min, rw_max, rf_acc


@triton.jit
def _kl_penalty(ref_ptr, idx, inside, on, lp, w, beta, BIAS_CORRECTION_KL: tl.constexpr):
    """``(kl, kl as added to the loss, d(beta kl)/dlogp not through w)`` of ``kl = e^d - d - 1``,
    ``d = ref - logp``; with the bias correction (``use_bias_correction_kl``) the added term is ``w kl``."""
    d = _masked_load(ref_ptr, idx, inside, on) - lp
    ed = tl.exp(d)
    kl = ed - d - 1.0
    if BIAS_CORRECTION_KL:
        return kl, _times(kl, w), _times(beta * (1.0 - ed), w)
    else:
        return kl, kl, beta * (1.0 - ed)


@triton.jit
def _add_sequence_cross_term(coef_ptr, mask_ptr, start, end, cross, BLOCK_T: tl.constexpr):
    """Pass 3 (``"sequence"`` level): ``coef_t += cross`` on every unmasked token of the response, the
    gradient through the mean log-ratio."""
    offs = tl.arange(0, BLOCK_T)
    for t0 in range(start, end, BLOCK_T):
        idx = t0 + offs
        inside = idx < end
        token_mask = tl.load(mask_ptr + idx, mask=inside, other=0.0)
        coef = tl.load(coef_ptr + idx, mask=inside, other=0.0)
        tl.store(coef_ptr + idx, coef + tl.where(token_mask > 0, cross, 0.0), mask=inside)


@triton.jit
def _store_weight_metrics(out, w_sum, w_min, w_max, units):
    """The weight statistics of one response into its partials row ``out``."""
    tl.store(out + P_W_SUM, w_sum)
    tl.store(out + P_W_MIN, w_min)
    tl.store(out + P_W_MAX, w_max)
    tl.store(out + P_UNITS, units)


@triton.jit
def _store_rollout_metrics(out, diff, zeros, w_sum, w_min, w_max, units):
    """The rollout mismatch sums of one response into its partials row ``out`` (its filtered units apart)."""
    tl.store(out + P_R_DIFF, diff)
    tl.store(out + P_R_ZERO, zeros)
    tl.store(out + P_RW_SUM, w_sum)
    tl.store(out + P_RW_MIN, w_min)
    tl.store(out + P_RW_MAX, w_max)
    tl.store(out + P_RW_UNITS, units)


@triton.jit
def _store_one_per_response(out, value, counted, SUM: tl.constexpr, MIN: tl.constexpr, MAX: tl.constexpr,
                            UNITS: tl.constexpr):
    """A statistic with one value per response into the partials row ``out``: sum, min, max and units count it
    once when the response has a token (``counted``), not at all otherwise."""
    tl.store(out + SUM, tl.where(counted, value, 0.0))
    tl.store(out + MIN, tl.where(counted, value, float("inf")))
    tl.store(out + MAX, tl.where(counted, value, float("-inf")))
    tl.store(out + UNITS, counted.to(tl.float32))


@triton.jit
def _rollout_response_value(sum_d, sum_div, denom, ROLLOUT: tl.constexpr):
    """The response's value the rollout correction gates on (from pass 1's sums)."""
    if (ROLLOUT == RC_SEQUENCE_MASKED_TIS) | (ROLLOUT == RC_SEQUENCE_GEOMETRIC_MASK):
        rc_seq = sum_d / denom  # the geometric mean's log
    elif (ROLLOUT == RC_SEQUENCE_BINARY_KL_MASK) | (ROLLOUT == RC_SEQUENCE_TV_MASK):
        rc_seq = sum_div / denom  # the mean divergence
    else:
        rc_seq = sum_d
    return rc_seq


@triton.jit
def _store_rollout_partials(out, counted, n_tok, rc_seq, rc_lo, rc_hi, sum_d, rz_acc, rw_acc, rw_min, rw_max, rf_acc,
                            rollout_ptr, ROLLOUT: tl.constexpr):
    """The rollout correction's columns of the response's partials row: the filtered share (``P_RF``,
    ``P_RF_UNITS``), the mismatch and the correction weights' statistics (``P_R_*``, ``P_RW_*``)."""
    if ((ROLLOUT == RC_SEQUENCE_TRUNCATE) | (ROLLOUT == RC_SEQUENCE_MASK) | (ROLLOUT == RC_SEQUENCE_MASKED_TIS)
            | (ROLLOUT == RC_SEQUENCE_GEOMETRIC_MASK) | (ROLLOUT == RC_SEQUENCE_BINARY_KL_MASK)
            | (ROLLOUT == RC_SEQUENCE_TV_MASK)):  # the response is the unit of the filtered share
        filtered = counted & ~_in_band(_sequence_statistic(rc_seq, ROLLOUT), rc_lo, rc_hi)
        tl.store(out + P_RF, filtered.to(tl.float32))
        tl.store(out + P_RF_UNITS, counted.to(tl.float32))
    else:  # tokens (none counted without a mode, or without rollout log-probs)
        tl.store(out + P_RF, tl.sum(rf_acc, axis=0))
        if ROLLOUT != RC_NONE:
            tl.store(out + P_RF_UNITS, n_tok)
        else:
            tl.store(out + P_RF_UNITS, 0.0)
    if rollout_ptr is None:
        _store_rollout_metrics(out, 0.0, 0.0, 0.0, float("inf"), float("-inf"), 0.0)
    elif (ROLLOUT == RC_SEQUENCE_TRUNCATE) | (ROLLOUT == RC_SEQUENCE_MASK):  # one weight per response
        tl.store(out + P_R_DIFF, -sum_d)
        tl.store(out + P_R_ZERO, tl.sum(rz_acc, axis=0))
        _store_one_per_response(out, _rollout_weight(0.0, rc_seq, rc_lo, rc_hi, ROLLOUT), counted, P_RW_SUM,
                                P_RW_MIN, P_RW_MAX, P_RW_UNITS)
    else:
        _store_rollout_metrics(out, -sum_d, tl.sum(rz_acc, axis=0), tl.sum(rw_acc, axis=0), tl.min(rw_min, axis=0),
                               tl.max(rw_max, axis=0), n_tok)


# Inputs the options do not need arrive as None (``old_ptr``: on-policy; ``entropy_ptr``: no entropy term;
# ``ref_ptr``: no KL; ``is_ratio_ptr``, ``rollout_ptr``): Triton compiles a launch for each pattern of absent
# inputs, as for the constexpr options, so each launch is the code of its options only. Pass 2's per-token
# steps are the helpers above (inlined by the compiler: the same code as one function).
@triton.jit
def gspo_sequence_kernel(
    logp_ptr, entropy_ptr, old_ptr, ref_ptr, adv_ptr, is_ratio_ptr, rollout_ptr, mask_ptr, cu_seqlens_ptr,
    coef_ptr, partials_ptr,
    eps_low, eps_high, delta, beta, log_ratio_clamp, clip_ratio_c, obj_a, obj_b, obj_c, obj_d,
    rc_lo, rc_hi, opsm_threshold,
    LEVEL: tl.constexpr, HELPERS: tl.constexpr, ROLLOUT: tl.constexpr, BIAS_CORRECTION_KL: tl.constexpr,
    HAS_DELTA: tl.constexpr, HAS_CLAMP: tl.constexpr, HAS_DUAL: tl.constexpr, OBJ_OPTION: tl.constexpr,
    FOLD: tl.constexpr, THROUGH_WEIGHT: tl.constexpr, HAS_OPSM: tl.constexpr, ADV_PER_TOKEN: tl.constexpr,
    SEQ_MEAN: tl.constexpr, SEQ_UNITS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """One program per response. ``HELPERS``: the objective's helpers (its module's ``TRITON`` tuple, indexed by
    ``H_*``), ``obj_a`` .. ``obj_d`` its float options and ``OBJ_OPTION`` its constexpr one; ``FOLD``: it folds
    the correction factor into its weight; ``THROUGH_WEIGHT``: its loss depends on the weight (the
    ``"sequence"`` level's gradient flows through the mean log-ratio)."""
    seq = tl.program_id(0)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    offs = tl.arange(0, BLOCK_T)
    low_edge = 1.0 - eps_low
    high_edge = 1.0 + eps_high
    if not ADV_PER_TOKEN:
        adv_seq = tl.load(adv_ptr + seq)
    else:
        adv_seq = 0.0

    n_tok, sum_r, sum_d, sum_gap, sum_1, sum_2, sum_div = _response_sums(
        logp_ptr, old_ptr, mask_ptr, rollout_ptr, is_ratio_ptr, adv_ptr, start, end, adv_seq, rc_lo, rc_hi,
        eps_low, eps_high, LEVEL, HELPERS, ROLLOUT, HAS_OPSM, ADV_PER_TOKEN, BLOCK_T)
    denom = tl.maximum(n_tok, 1.0)
    mean_r = sum_r / denom
    if HAS_CLAMP:  # w = exp(min(log w, c)) (verl's guard); no gradient through a clamped weight
        seq_pass = (mean_r <= log_ratio_clamp).to(tl.float32)
        mean_r = tl.minimum(mean_r, log_ratio_clamp)
    else:
        seq_pass = 1.0
    w_seq = tl.exp(mean_r)
    if SEQ_MEAN:
        lam = 1.0 / denom
    else:
        lam = 1.0
    rc_seq = _rollout_response_value(sum_d, sum_div, denom, ROLLOUT)
    seq_gap = sum_gap / denom
    # the objective's per-response values, the one weight of the response and its extra metric's value
    u1, u2, u3, w_one, aux_one = HELPERS[H_RESPONSE](sum_1, sum_2, denom, w_seq, adv_seq, obj_a, obj_b, obj_c,
                                                       obj_d, ADV_PER_TOKEN)

    # Pass 2: per-token objective, partial sums and (local) gradient coefficients.
    loss_acc = tl.zeros([BLOCK_T], tl.float32)
    ent_acc = tl.zeros([BLOCK_T], tl.float32)
    kl_acc = tl.zeros([BLOCK_T], tl.float32)
    q_acc = tl.zeros([BLOCK_T], tl.float32)
    f_acc = tl.zeros([BLOCK_T], tl.float32)
    low_acc = tl.zeros([BLOCK_T], tl.float32)
    high_acc = tl.zeros([BLOCK_T], tl.float32)
    w_acc = tl.zeros([BLOCK_T], tl.float32)
    w_min = tl.full([BLOCK_T], float("inf"), tl.float32)
    w_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
    aux_acc = tl.zeros([BLOCK_T], tl.float32)
    rz_acc = tl.zeros([BLOCK_T], tl.float32)
    rw_acc = tl.zeros([BLOCK_T], tl.float32)
    rw_min = tl.full([BLOCK_T], float("inf"), tl.float32)
    rw_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
    rf_acc = tl.zeros([BLOCK_T], tl.float32)
    for t0 in range(start, end, BLOCK_T):
        idx = t0 + offs
        inside = idx < end
        on = tl.load(mask_ptr + idx, mask=inside, other=0.0) > 0
        lp = _masked_load(logp_ptr, idx, inside, on)
        w, dw = _token_weight(lp, old_ptr, idx, inside, on, w_seq, seq_pass, log_ratio_clamp, LEVEL, HAS_CLAMP,
                              BLOCK_T)
        adv = _advantages(adv_ptr, idx, inside, adv_seq, ADV_PER_TOKEN, BLOCK_T)
        f, rz_acc, rw_acc, rw_min, rw_max, rf_acc = _correction_factor(
            lp, adv, old_ptr, is_ratio_ptr, rollout_ptr, idx, inside, on, rc_seq, rc_lo, rc_hi, seq_gap,
            opsm_threshold, rz_acc, rw_acc, rw_min, rw_max, rf_acc, FOLD, ROLLOUT, HAS_OPSM, BLOCK_T)
        loss, dl_dw, direct, low_acc, high_acc, aux_acc = HELPERS[H_TOKEN](
            w, adv, lp, old_ptr, idx, inside, on, low_edge, high_edge, eps_low, eps_high, delta, clip_ratio_c,
            obj_a, obj_b, obj_c, obj_d, u1, u2, u3, low_acc, high_acc, aux_acc, OBJ_OPTION, HAS_DELTA, HAS_DUAL,
            BLOCK_T)
        loss = _times(f, loss)  # a token dropped by its factor adds 0 even when its weight overflowed
        dl_dw = _times(f, dl_dw)
        direct = direct * f
        f_acc += tl.where(on, f, 0.0)
        if ref_ptr is not None:  # the KL term
            kl, kl_weighted, kl_direct = _kl_penalty(ref_ptr, idx, inside, on, lp, w, beta, BIAS_CORRECTION_KL)
            direct += kl_direct
            if BIAS_CORRECTION_KL:
                dl_dw += beta * kl
            loss += beta * kl_weighted
            kl_acc += tl.where(on, kl_weighted, 0.0)
        loss_acc += tl.where(on, loss, 0.0)
        if entropy_ptr is not None:
            ent_acc += _masked_load(entropy_ptr, idx, inside, on)
        if LEVEL == LEVEL_SEQUENCE:
            q_acc += tl.where(on, dl_dw, 0.0)
            coef = tl.where(on, lam * direct, 0.0)
        else:
            coef = tl.where(on, lam * (_times(dl_dw, dw) + direct), 0.0)
        tl.store(coef_ptr + idx, coef, mask=inside)
        if not SEQ_UNITS:  # weight statistics over unmasked tokens
            w_acc += tl.where(on, w, 0.0)
            w_min = tl.minimum(w_min, tl.where(on, w, float("inf")))
            w_max = tl.maximum(w_max, tl.where(on, w, float("-inf")))

    # Pass 3: the gradient through a per-response quantity.
    if LEVEL == LEVEL_SEQUENCE:
        # the objectives whose loss depends on w, and the bias-corrected KL (w kl) whatever the objective
        if THROUGH_WEIGHT | BIAS_CORRECTION_KL:
            cross = _times(lam * tl.sum(q_acc, axis=0) * seq_pass / denom, w_seq)
            _add_sequence_cross_term(coef_ptr, mask_ptr, start, end, cross, BLOCK_T)
    HELPERS[H_FINISH](coef_ptr, logp_ptr, old_ptr, mask_ptr, adv_ptr, start, end, adv_seq, tl.sum(f_acc, axis=0),
                        lam, denom, u1, u2, u3, eps_low, eps_high, ADV_PER_TOKEN, BLOCK_T)

    # The response's partials row.
    out = partials_ptr + seq.to(tl.int64) * PARTIALS_STRIDE
    counted = n_tok > 0
    tl.store(out + P_LOSS, lam * tl.sum(loss_acc, axis=0))
    tl.store(out + P_TOKENS, n_tok)
    tl.store(out + P_ENTROPY, tl.sum(ent_acc, axis=0))
    tl.store(out + P_KL, tl.sum(kl_acc, axis=0))
    low, high, clip_units = HELPERS[H_CLIP_COUNTS](tl.sum(low_acc, axis=0), tl.sum(high_acc, axis=0), n_tok,
                                                     w_seq, adv_seq, low_edge, high_edge, eps_high, OBJ_OPTION,
                                                     SEQ_UNITS)
    tl.store(out + P_LOW, low)
    tl.store(out + P_HIGH, high)
    tl.store(out + P_CLIP_UNITS, clip_units)
    if SEQ_UNITS:  # one weight per response
        _store_one_per_response(out, w_one, counted, P_W_SUM, P_W_MIN, P_W_MAX, P_UNITS)
    else:
        _store_weight_metrics(out, tl.sum(w_acc, axis=0), tl.min(w_min, axis=0), tl.max(w_max, axis=0), n_tok)
    if ADV_PER_TOKEN:
        tl.store(out + P_AUX, tl.sum(aux_acc, axis=0))
        tl.store(out + P_AUX_UNITS, n_tok)
    else:  # one value per response
        tl.store(out + P_AUX, tl.where(counted, aux_one, 0.0))
        tl.store(out + P_AUX_UNITS, counted.to(tl.float32))
    _store_rollout_partials(out, counted, n_tok, rc_seq, rc_lo, rc_hi, sum_d, rz_acc, rw_acc, rw_min, rw_max, rf_acc,
                            rollout_ptr, ROLLOUT)


@triton.jit
def _column(values, cols, c):
    """Entry ``c`` of the ``[PARTIALS_STRIDE]`` vector ``values``."""
    return tl.sum(tl.where(cols == c, values, 0.0), axis=0)


@triton.jit
def _ratio(values, cols, c, units):
    """Column ``c`` over column ``units`` (at least 1)."""
    return _column(values, cols, c) / tl.maximum(_column(values, cols, units), 1.0)


@triton.jit
def gspo_reduce_kernel(
    partials_ptr, num_items_ptr, out_ptr, loss_ptr, num_seqs, grpo_denominator, dr_grpo_denominator, entropy_coef,
    LOSS_TYPE: tl.constexpr, HAS_NUM_ITEMS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Reduce the ``[S, PARTIALS_STRIDE]`` partials (sum; min / max for the ``*_MIN`` / ``*_MAX`` columns) in a
    fixed order, then write the ``O_*`` slots, and the loss once more at ``loss_ptr`` (a 0-dim tensor of its
    own: the autograd output, no copy of ``out[O_LOSS]`` on the host's side). ``LOSS_TYPE``: the aggregation's
    code (``AGGREGATION_CODES``)."""
    rows_in = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, PARTIALS_STRIDE)
    is_min = (cols == MIN_COLUMNS[0]) | (cols == MIN_COLUMNS[1])
    is_max = (cols == MAX_COLUMNS[0]) | (cols == MAX_COLUMNS[1])
    pad = tl.where(is_min, float("inf"), tl.where(is_max, float("-inf"), 0.0))
    acc = tl.zeros([BLOCK_S, PARTIALS_STRIDE], tl.float32) + pad[None, :]
    for s0 in range(0, num_seqs, BLOCK_S):
        rows = s0 + rows_in
        inside = (rows < num_seqs)[:, None] & (cols < P_COUNT)[None, :]
        tile = tl.load(partials_ptr + rows.to(tl.int64)[:, None] * PARTIALS_STRIDE + cols[None, :], mask=inside,
                       other=0.0)
        tile = tl.where(inside, tile, pad[None, :])
        acc = tl.where(is_min[None, :], tl.minimum(acc, tile), tl.where(is_max[None, :], tl.maximum(acc, tile),
                                                                        acc + tile))
    sums = tl.sum(acc, axis=0)
    mins = tl.min(acc, axis=0)
    maxs = tl.max(acc, axis=0)
    values = tl.where(is_min, mins, tl.where(is_max, maxs, sums))
    token_mean = tl.maximum(_column(values, cols, P_TOKENS), 1.0)
    if LOSS_TYPE == LOSS_BNPO:  # bnpo: token mean
        denominator = token_mean
    elif LOSS_TYPE == LOSS_DR_GRPO:  # dr_grpo: S * max_completion_length
        denominator = dr_grpo_denominator
    elif LOSS_TYPE == LOSS_DAPO:  # dapo: the caller's global token count, else this batch's
        if HAS_NUM_ITEMS:  # validated finite and > 0, used as given (docs/policies.md)
            denominator = tl.load(num_items_ptr).to(tl.float32)
        else:
            denominator = token_mean
    else:  # grpo (mean over responses of the per-response token means) and seq_sum: S
        denominator = grpo_denominator
    entropy_mean = _column(values, cols, P_ENTROPY) / token_mean
    low = _ratio(values, cols, P_LOW, P_CLIP_UNITS)
    high = _ratio(values, cols, P_HIGH, P_CLIP_UNITS)
    some = _column(values, cols, P_UNITS) > 0
    rollout_some = _column(values, cols, P_RW_UNITS) > 0
    loss = _column(values, cols, P_LOSS) / denominator - entropy_coef * entropy_mean
    tl.store(out_ptr + O_LOSS, loss)
    tl.store(loss_ptr, loss)
    tl.store(out_ptr + O_SCALE_LOGP, 1.0 / denominator)
    tl.store(out_ptr + O_SCALE_ENTROPY, -entropy_coef / token_mean)
    tl.store(out_ptr + O_LOW, low)
    tl.store(out_ptr + O_HIGH, high)
    tl.store(out_ptr + O_REGION, low + high)  # low and high never hold for the same item
    tl.store(out_ptr + O_W_MEAN, _ratio(values, cols, P_W_SUM, P_UNITS))
    tl.store(out_ptr + O_W_MIN, tl.where(some, _column(values, cols, P_W_MIN), 0.0))
    tl.store(out_ptr + O_W_MAX, tl.where(some, _column(values, cols, P_W_MAX), 0.0))
    tl.store(out_ptr + O_ENTROPY, entropy_mean)
    tl.store(out_ptr + O_KL, _column(values, cols, P_KL) / token_mean)
    tl.store(out_ptr + O_AUX_MEAN, _ratio(values, cols, P_AUX, P_AUX_UNITS))
    tl.store(out_ptr + O_ROLLOUT_KL, _column(values, cols, P_R_DIFF) / token_mean)
    tl.store(out_ptr + O_ROLLOUT_MASKED, _column(values, cols, P_R_ZERO) / token_mean)
    tl.store(out_ptr + O_RW_MIN, tl.where(rollout_some, _column(values, cols, P_RW_MIN), 0.0))
    tl.store(out_ptr + O_RW_MEAN, _ratio(values, cols, P_RW_SUM, P_RW_UNITS))
    tl.store(out_ptr + O_RW_MAX, tl.where(rollout_some, _column(values, cols, P_RW_MAX), 0.0))
    tl.store(out_ptr + O_ROLLOUT_FILTERED, _ratio(values, cols, P_RF, P_RF_UNITS))
