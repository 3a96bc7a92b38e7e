"""SAPO's Triton helpers (the sequence kernel's ``HELPERS``: :data:`TRITON`; ``obj_a``, ``obj_b``: the gate
temperatures). Imported by the Triton backend only."""

from __future__ import annotations

import triton
import triton.language as tl

from gspo_kernels.backends.triton.objectives.defaults import clip_counts, no_finish, no_response_values, no_sums
from gspo_kernels.objectives import sapo as sapo_objective


@triton.jit
def _sapo_surrogate(w, adv, tau_pos, tau_neg):
    """``(l, dl/dw)`` of SAPO's soft gate ``l = -(4 / tau) sigmoid(tau (w - 1)) A``, ``tau`` by ``A > 0``:
    ``dl/dw = -4 s (1 - s) A`` (0 where the gate saturates, also for ``w = inf``)."""
    tau = tl.where(adv > 0, tau_pos, tau_neg)
    sig = tl.sigmoid(tau * (w - 1.0))
    loss = -(4.0 / tau) * sig * adv
    return tl.where(adv == 0, 0.0, loss), -4.0 * sig * (1.0 - sig) * adv


@triton.jit
def token(w, adv, lp, old_ptr, idx, inside, on, low_edge, high_edge, eps_low, eps_high, delta, clip_ratio_c, obj_a, obj_b,
          obj_c, obj_d, u1, u2, u3, low_acc, high_acc, aux_acc, OBJ_OPTION: tl.constexpr, HAS_DELTA: tl.constexpr,
          HAS_DUAL: tl.constexpr, BLOCK_T: tl.constexpr):
    """``H_TOKEN``: SAPO's ``(l, dl/dw, 0)``."""
    loss, dl_dw = _sapo_surrogate(w, adv, obj_a, obj_b)
    return loss, dl_dw, tl.zeros([BLOCK_T], tl.float32), low_acc, high_acc, aux_acc


OBJECTIVE_NAME = sapo_objective.NAME  # the objective these helpers compute (objectives/sapo.py)
TRITON = (no_sums, no_response_values, token, no_finish, clip_counts)
