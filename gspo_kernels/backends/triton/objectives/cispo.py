"""CISPO's Triton helpers (the sequence kernel's ``HELPERS``: :data:`TRITON`; ``OBJ_OPTION``: the band clip).
Imported by the Triton backend only."""

from __future__ import annotations

import triton
import triton.language as tl

from gspo_kernels.backends.triton.objectives.defaults import clip_counts as token_clip_counts
from gspo_kernels.backends.triton.objectives.defaults import no_finish, no_response_values, no_sums
from gspo_kernels.objectives import cispo as cispo_objective


@triton.jit
def _cispo_surrogate(w, adv, lp, on, low_edge, high_edge, eps_high, high_acc, CISPO_BAND: tl.constexpr):
    """``(l, dl/dlogp, high_acc)`` of CISPO's ``l = -sg(w_hat) A logp``: ``w_hat = clamp(w, low_edge, high_edge)``
    (``CISPO_BAND``) or ``min(w, eps_high)``; the clipped tokens counted into ``high_acc``."""
    if CISPO_BAND:
        w_hat = tl.minimum(tl.maximum(w, low_edge), high_edge)
        high_acc += (on & ((w < low_edge) | (w > high_edge))).to(tl.float32)
    else:
        w_hat = tl.minimum(w, eps_high)
        high_acc += (on & (w > eps_high) & (adv > 0)).to(tl.float32)
    return -w_hat * adv * lp, -w_hat * adv, high_acc


@triton.jit
def token(w, adv, lp, old_ptr, idx, inside, on, low_edge, high_edge, eps_low, eps_high, delta, clip_ratio_c, obj_a, obj_b,
          obj_c, obj_d, u1, u2, u3, low_acc, high_acc, aux_acc, OBJ_OPTION: tl.constexpr, HAS_DELTA: tl.constexpr,
          HAS_DUAL: tl.constexpr, BLOCK_T: tl.constexpr):
    """``H_TOKEN``: CISPO's ``(l, 0, dl/dlogp)``, its clipped tokens counted into ``high_acc``."""
    loss, direct, high_acc = _cispo_surrogate(w, adv, lp, on, low_edge, high_edge, eps_high, high_acc, OBJ_OPTION)
    return loss, tl.zeros([BLOCK_T], tl.float32), direct, low_acc, high_acc, aux_acc


@triton.jit
def clip_counts(low_sum, high_sum, n_tok, w_seq, adv_seq, low_edge, high_edge, eps_high, OBJ_OPTION: tl.constexpr,
                SEQ_UNITS: tl.constexpr):
    """``H_CLIP_COUNTS``: the token counts (the general helper's), or (``SEQ_UNITS``) the response counted once in
    the high column when its weight was clipped (the band with ``OBJ_OPTION``, else above the cap with ``A > 0``)."""
    if SEQ_UNITS == 0:  # clip counts over unmasked tokens
        low, high, units = token_clip_counts(low_sum, high_sum, n_tok, w_seq, adv_seq, low_edge, high_edge, eps_high,
                                             OBJ_OPTION, SEQ_UNITS)
    else:  # one weight and one advantage per response: counted once
        counted = n_tok > 0
        if OBJ_OPTION:
            high = counted & ((w_seq < low_edge) | (w_seq > high_edge))
        else:
            high = counted & (w_seq > eps_high) & (adv_seq > 0)
        low = (counted & (w_seq < 0.0)).to(tl.float32)
        high = high.to(tl.float32)
        units = counted.to(tl.float32)
    return low, high, units

OBJECTIVE_NAME = cispo_objective.NAME  # the objective these helpers compute (objectives/cispo.py)
TRITON = (no_sums, no_response_values, token, no_finish, clip_counts)
