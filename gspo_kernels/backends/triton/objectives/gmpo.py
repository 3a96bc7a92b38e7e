"""GMPO's Triton helpers (the sequence kernel's ``HELPERS``: :data:`TRITON`). Imported by the Triton backend
only."""

from __future__ import annotations

import triton
import triton.language as tl

from gspo_kernels.backends.triton.sequence_kernels import _advantages, _masked_load, _old_logprobs, _times
from gspo_kernels.objectives import gmpo as gmpo_objective


@triton.jit
def _gmpo_clipped(r, adv, eps_low, eps_high):
    """GMPO's sign-aware clip of the token log-ratio ``r`` and whether the gradient passes (``(m, pass)``)."""
    rc = tl.minimum(tl.maximum(r, -eps_low), eps_high)
    s = tl.where(adv > 0, 1.0, tl.where(adv < 0, -1.0, 0.0))
    m = s * tl.minimum(s * r, s * rc)
    in_band = (r >= -eps_low) & (r <= eps_high)
    passes = (s != 0) & (in_band | (s * r < s * rc))
    return m, passes.to(tl.float32)


@triton.jit
def _gmpo_token(lp, old, adv, on, loss_g, eps_low, eps_high, low_acc, high_acc, BLOCK_T: tl.constexpr):
    """``(l, low_acc, high_acc)``: GMPO's per-response loss ``loss_g`` on every token of the tile (its gradient
    is added in pass 3), and the tokens whose log-ratio left ``[-eps_low, eps_high]`` counted by the sign of A."""
    r = lp - old
    moved = on & ((r < -eps_low) | (r > eps_high))
    low_acc += (moved & (adv < 0)).to(tl.float32)
    high_acc += (moved & (adv > 0)).to(tl.float32)
    return tl.full([BLOCK_T], 1.0, tl.float32) * loss_g, low_acc, high_acc


@triton.jit
def _add_gmpo_term(coef_ptr, logp_ptr, old_ptr, mask_ptr, adv_ptr, start, end, adv_seq, scale, eps_low, eps_high,
                   ADV_PER_TOKEN: tl.constexpr, BLOCK_T: tl.constexpr):
    """Pass 3 (GMPO): ``coef_t += scale`` on the tokens whose clipped log-ratio passes the gradient
    (``scale = lam * sum_t' f_t' * (-A_mean) * rho_i / |y_i|``, the gradient through the geometric mean)."""
    offs = tl.arange(0, BLOCK_T)
    for t0 in range(start, end, BLOCK_T):
        idx = t0 + offs
        inside = idx < end
        on = tl.load(mask_ptr + idx, mask=inside, other=0.0) > 0
        lp = _masked_load(logp_ptr, idx, inside, on)
        old = _old_logprobs(old_ptr, idx, inside, on, lp)
        adv = _advantages(adv_ptr, idx, inside, adv_seq, ADV_PER_TOKEN, BLOCK_T)
        _, passes = _gmpo_clipped(lp - old, adv, eps_low, eps_high)
        coef = tl.load(coef_ptr + idx, mask=inside, other=0.0)
        tl.store(coef_ptr + idx, coef + tl.where(on, _times(passes, scale), 0.0), mask=inside)


@triton.jit
def sums(r, adv, on, is_ratio_ptr, rollout_ptr, idx, inside, d, lo, hi, eps_low, eps_high, ROLLOUT: tl.constexpr,
         BLOCK_T: tl.constexpr):
    """``H_SUMS``: the tile's clipped log-ratios ``m_t`` and advantages."""
    m, _ = _gmpo_clipped(r, adv, eps_low, eps_high)
    return tl.where(on, m, 0.0), tl.where(on, adv, 0.0)


@triton.jit
def response_values(sum_1, sum_2, denom, w_seq, adv_seq, obj_a, obj_b, obj_c, obj_d, ADV_PER_TOKEN: tl.constexpr):
    """``H_RESPONSE``: ``(loss_g, rho_g, A_mean, rho_g, 0)``: the per-response loss, the geometric-mean weight
    and the mean advantage."""
    rho_g = tl.exp(sum_1 / denom)  # GMPO's geometric-mean weight
    if ADV_PER_TOKEN:
        adv_mean = sum_2 / denom
    else:
        adv_mean = adv_seq
    loss_g = _times(-adv_mean, rho_g)  # GMPO's per-response loss
    return loss_g, rho_g, adv_mean, rho_g, 0.0


@triton.jit
def token(w, adv, lp, old_ptr, idx, inside, on, low_edge, high_edge, eps_low, eps_high, delta, clip_ratio_c, obj_a, obj_b,
          obj_c, obj_d, u1, u2, u3, low_acc, high_acc, aux_acc, OBJ_OPTION: tl.constexpr, HAS_DELTA: tl.constexpr,
          HAS_DUAL: tl.constexpr, BLOCK_T: tl.constexpr):
    """``H_TOKEN``: the response's loss on every token (``(l, 0, 0)``; its gradient in pass 3), the clip counts."""
    loss, low_acc, high_acc = _gmpo_token(lp, _old_logprobs(old_ptr, idx, inside, on, lp), adv, on, u1, eps_low,
                                          eps_high, low_acc, high_acc, BLOCK_T)
    zeros = tl.zeros([BLOCK_T], tl.float32)
    return loss, zeros, zeros, low_acc, high_acc, aux_acc


@triton.jit
def finish(coef_ptr, logp_ptr, old_ptr, mask_ptr, adv_ptr, start, end, adv_seq, f_sum, lam, denom, u1, u2, u3,
           eps_low, eps_high, ADV_PER_TOKEN: tl.constexpr, BLOCK_T: tl.constexpr):
    """``H_FINISH``: the gradient through the geometric mean (``u2 = rho_g``, ``u3`` the mean advantage)."""
    scale = _times(lam * f_sum * -u3 / denom, u2)
    _add_gmpo_term(coef_ptr, logp_ptr, old_ptr, mask_ptr, adv_ptr, start, end, adv_seq, scale, eps_low, eps_high,
                   ADV_PER_TOKEN, BLOCK_T)


@triton.jit
def clip_counts(low_sum, high_sum, n_tok, w_seq, adv_seq, low_edge, high_edge, eps_high, OBJ_OPTION: tl.constexpr,
                SEQ_UNITS: tl.constexpr):
    """``H_CLIP_COUNTS``: the token counts of its log-space clip, whatever the units of its weight."""
    return low_sum, high_sum, n_tok


OBJECTIVE_NAME = gmpo_objective.NAME  # the objective these helpers compute (objectives/gmpo.py)
TRITON = (sums, response_values, token, finish, clip_counts)
