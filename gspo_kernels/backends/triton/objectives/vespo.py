"""VESPO's Triton helpers (the sequence kernel's ``HELPERS``: :data:`TRITON`; ``obj_a`` .. ``obj_d``: ``k_pos``,
``lambda_pos``, ``k_neg``, ``lambda_neg``). Imported by the Triton backend only."""

from __future__ import annotations

import triton
import triton.language as tl

from gspo_kernels.backends.triton.objectives.defaults import clip_counts, no_finish
from gspo_kernels.backends.triton.sequence_rollout import _rollout_weight
from gspo_kernels.backends.triton.sequence_slots import RC_NONE
from gspo_kernels.objectives import vespo as vespo_objective
from gspo_kernels.objectives.vespo import VESPO_LOG_MAX, VESPO_LOG_MIN

_VESPO_LOG_MIN = tl.constexpr(VESPO_LOG_MIN)
_VESPO_LOG_MAX = tl.constexpr(VESPO_LOG_MAX)


@triton.jit
def _clamped_log(c):
    """``log c`` clamped to VESPO's ``[VESPO_LOG_MIN, VESPO_LOG_MAX]`` (``c <= 0`` counts as ``1e-30``)."""
    return tl.minimum(tl.maximum(tl.log(tl.maximum(c, 1e-30)), _VESPO_LOG_MIN), _VESPO_LOG_MAX)


@triton.jit
def _vespo_log_weight(r, is_ratio_ptr, rollout_ptr, idx, inside, d, lo, hi, ROLLOUT: tl.constexpr):
    """VESPO's per-token log weight: the clamped log-ratio ``r``, plus the clamped logs of the IS ratio and of the
    token-level rollout weight (of the log-ratio ``d``) when present: VESPO folds its corrections into the weight."""
    v = tl.minimum(tl.maximum(r, -_VESPO_LOG_MAX), _VESPO_LOG_MAX)
    if is_ratio_ptr is not None:
        v += _clamped_log(tl.load(is_ratio_ptr + idx, mask=inside, other=1.0))
    if rollout_ptr is not None:
        if ROLLOUT != RC_NONE:  # token modes only (the config refuses the others for VESPO)
            v += _clamped_log(_rollout_weight(d, 0.0, lo, hi, ROLLOUT))
    return v


@triton.jit
def _vespo_phi(log_w, adv, k_pos, lam_pos, k_neg, lam_neg):
    """VESPO's gamma weight ``exp(lambda + k log w - lambda w)`` (``(k, lambda)`` by ``A >= 0``); 0 if not finite."""
    pos = adv >= 0
    k = tl.where(pos, k_pos, k_neg)
    lam = tl.where(pos, lam_pos, lam_neg)
    phi = tl.exp(lam + k * log_w - lam * tl.exp(log_w))
    return tl.where((phi == phi) & (phi < float("inf")), phi, 0.0)


@triton.jit
def sums(r, adv, on, is_ratio_ptr, rollout_ptr, idx, inside, d, lo, hi, eps_low, eps_high, ROLLOUT: tl.constexpr,
         BLOCK_T: tl.constexpr):
    """``H_SUMS``: the tile's log weights (its corrections folded in); nothing in the second sum."""
    v = tl.where(on, _vespo_log_weight(r, is_ratio_ptr, rollout_ptr, idx, inside, d, lo, hi, ROLLOUT), 0.0)
    return v, tl.zeros([BLOCK_T], tl.float32)


@triton.jit
def response_values(sum_1, sum_2, denom, w_seq, adv_seq, obj_a, obj_b, obj_c, obj_d, ADV_PER_TOKEN: tl.constexpr):
    """``H_RESPONSE``: the log sequence weight (``u1``), the weight, and phi of the response's advantage."""
    log_wv = tl.minimum(tl.maximum(sum_1, _VESPO_LOG_MIN), _VESPO_LOG_MAX)  # VESPO's log sequence weight
    return log_wv, 0.0, 0.0, tl.exp(log_wv), _vespo_phi(log_wv, adv_seq, obj_a, obj_b, obj_c, obj_d)


@triton.jit
def token(w, adv, lp, old_ptr, idx, inside, on, low_edge, high_edge, eps_low, eps_high, delta, clip_ratio_c, obj_a, obj_b,
          obj_c, obj_d, u1, u2, u3, low_acc, high_acc, aux_acc, OBJ_OPTION: tl.constexpr, HAS_DELTA: tl.constexpr,
          HAS_DUAL: tl.constexpr, BLOCK_T: tl.constexpr):
    """``H_TOKEN``: ``l = -phi(w_i) A logp``, phi of the response's weight: ``(l, 0, dl/dlogp)``, phi summed into
    ``aux_acc``."""
    phi = _vespo_phi(u1, adv, obj_a, obj_b, obj_c, obj_d)
    aux_acc += tl.where(on, phi, 0.0)
    return -phi * adv * lp, tl.zeros([BLOCK_T], tl.float32), -phi * adv, low_acc, high_acc, aux_acc


OBJECTIVE_NAME = vespo_objective.NAME  # the objective these helpers compute (objectives/vespo.py)
TRITON = (sums, response_values, token, no_finish, clip_counts)
