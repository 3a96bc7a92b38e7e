"""The helpers an objective leaves at their default in its ``TRITON`` tuple (the sequence kernel's ``HELPERS``,
called by position: ``H_SUMS``, ``H_RESPONSE``, ``H_FINISH``, ``H_CLIP_COUNTS`` of
:mod:`gspo_kernels.backends.triton.sequence_slots`)."""

from __future__ import annotations

import triton
import triton.language as tl


# The objective's helpers when it has nothing to add at a step (``HELPERS[H_*]``; an objective's module uses
# them in its ``TRITON`` tuple). Their signatures are the hooks' signatures.
@triton.jit
def no_sums(r, adv, on, is_ratio_ptr, rollout_ptr, idx, inside, d, lo, hi, eps_low, eps_high, ROLLOUT: tl.constexpr,
            BLOCK_T: tl.constexpr):
    """``H_SUMS``: the tile's contributions to the objective's two per-response sums (none)."""
    zeros = tl.zeros([BLOCK_T], tl.float32)
    return zeros, zeros


@triton.jit
def no_response_values(sum_1, sum_2, denom, w_seq, adv_seq, obj_a, obj_b, obj_c, obj_d, ADV_PER_TOKEN: tl.constexpr):
    """``H_RESPONSE``: ``(u1, u2, u3, w_one, aux_one)``, the objective's per-response values (passed to its token
    and finish helpers), the response's one weight (its metrics with one weight per response) and its extra
    metric's value (none; the sequence-level weight)."""
    return 0.0, 0.0, 0.0, w_seq, 0.0


@triton.jit
def no_finish(coef_ptr, logp_ptr, old_ptr, mask_ptr, adv_ptr, start, end, adv_seq, f_sum, lam, denom, u1, u2, u3,
              eps_low, eps_high, ADV_PER_TOKEN: tl.constexpr, BLOCK_T: tl.constexpr):
    """``H_FINISH``: pass 3, a gradient through the objective's per-response values (none)."""
    return


@triton.jit
def clip_counts(low_sum, high_sum, n_tok, w_seq, adv_seq, low_edge, high_edge, eps_high, OBJ_OPTION: tl.constexpr,
                SEQ_UNITS: tl.constexpr):
    """``H_CLIP_COUNTS``: ``(low, high, units)`` of the response's partials row: the token counts ``low_sum`` /
    ``high_sum`` over ``n_tok`` tokens, or, with one weight and one advantage per response (``SEQ_UNITS``), the
    response counted once, its weight out of the band on the side of its advantage's sign."""
    if SEQ_UNITS == 0:  # clip counts over unmasked tokens
        low = low_sum
        high = high_sum
        units = n_tok
    else:  # one weight and one advantage per response: counted once
        counted = n_tok > 0
        low = (counted & (w_seq < low_edge) & (adv_seq < 0)).to(tl.float32)
        high = (counted & (w_seq > high_edge) & (adv_seq > 0)).to(tl.float32)
        units = counted.to(tl.float32)
    return low, high, units
