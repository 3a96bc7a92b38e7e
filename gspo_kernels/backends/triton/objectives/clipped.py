"""The clipped surrogate's Triton helpers (the sequence kernel's ``HELPERS``: :data:`TRITON`). Imported by the
Triton backend only, never by ``import gspo_kernels``."""

from __future__ import annotations

import triton
import triton.language as tl

from gspo_kernels.backends.triton.objectives.defaults import clip_counts, no_finish, no_response_values, no_sums
from gspo_kernels.backends.triton.sequence_kernels import _times
from gspo_kernels.objectives import clipped as clipped_objective


@triton.jit
def _clipped_surrogate(w, adv, low_edge, high_edge, delta, clip_ratio_c, HAS_DELTA: tl.constexpr,
                       HAS_DUAL: tl.constexpr, BLOCK_T: tl.constexpr):
    """``(l, dl/dw)`` of ``l = -min(min(w, delta) A, clamp(w, low_edge, high_edge) A)`` (PyTorch's subgradients),
    then for ``A < 0`` the dual clip ``min(l, clip_ratio_c |A|)``."""
    c2 = tl.minimum(tl.maximum(w, low_edge), high_edge)
    dc2 = ((w >= low_edge) & (w <= high_edge)).to(tl.float32)
    if HAS_DELTA:
        c1 = tl.minimum(w, delta)
        dc1 = (w <= delta).to(tl.float32)
    else:
        c1 = w
        dc1 = tl.full([BLOCK_T], 1.0, tl.float32)
    u1 = _times(adv, c1)  # c1 = w may be inf; a zero advantage contributes 0
    u2 = c2 * adv
    loss = -tl.minimum(u1, u2)
    dmin = tl.where(u1 < u2, dc1, tl.where(u1 > u2, dc2, 0.5 * (dc1 + dc2)))
    dl_dw = -adv * dmin
    if HAS_DUAL:
        cap = -clip_ratio_c * adv
        neg = adv < 0
        dl_dw = tl.where(neg & (loss > cap), 0.0, tl.where(neg & (loss == cap), 0.5 * dl_dw, dl_dw))
        loss = tl.where(neg, tl.minimum(loss, cap), loss)
    return loss, dl_dw


@triton.jit
def token(w, adv, lp, old_ptr, idx, inside, on, low_edge, high_edge, eps_low, eps_high, delta, clip_ratio_c, obj_a, obj_b,
          obj_c, obj_d, u1, u2, u3, low_acc, high_acc, aux_acc, OBJ_OPTION: tl.constexpr, HAS_DELTA: tl.constexpr,
          HAS_DUAL: tl.constexpr, BLOCK_T: tl.constexpr):
    """``H_TOKEN``: the clipped surrogate's ``(l, dl/dw, 0)``, its clip counts added."""
    loss, dl_dw = _clipped_surrogate(w, adv, low_edge, high_edge, delta, clip_ratio_c, HAS_DELTA, HAS_DUAL, BLOCK_T)
    low_acc += (on & (w < low_edge) & (adv < 0)).to(tl.float32)
    high_acc += (on & (w > high_edge) & (adv > 0)).to(tl.float32)
    return loss, dl_dw, tl.zeros([BLOCK_T], tl.float32), low_acc, high_acc, aux_acc


OBJECTIVE_NAME = clipped_objective.NAME  # the objective these helpers compute (objectives/clipped.py)
TRITON = (no_sums, no_response_values, token, no_finish, clip_counts)
