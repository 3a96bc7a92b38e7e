"""Each objective's Triton helpers for the sequence kernel, one module per objective, reached by ordinary imports.

A module declares ``OBJECTIVE_NAME`` (the objective it computes, ``Objective.name``) and ``TRITON``: the tuple of
``@triton.jit`` helpers the sequence kernel takes as its ``HELPERS`` constexpr and calls by position, in the one
order :mod:`gspo_kernels.backends.triton.sequence_slots` names (``H_SUMS``, ``H_RESPONSE``, ``H_TOKEN``,
``H_FINISH``, ``H_CLIP_COUNTS``; a named record is not a constexpr the oldest supported triton, 3.4, can index by
name). :data:`HELPERS` maps an objective's name to its tuple; an objective without an entry (one registered from
outside the package) runs the PyTorch sequence stage on the Triton backend too.
"""

from gspo_kernels.backends.triton.objectives import cispo, clipped, gmpo, sapo, vespo

HELPERS = {module.OBJECTIVE_NAME: module.TRITON for module in (clipped, sapo, cispo, vespo, gmpo)}
