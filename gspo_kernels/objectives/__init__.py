"""The objectives, one module each, and their registry (:mod:`gspo_kernels.objectives.registry`).

Each module declares an :class:`~gspo_kernels.objectives.registry.Objective` (``OBJECTIVE``: its names, the
aggregation each implies, its options' checks, its PyTorch surrogate, its metrics, the module of its Triton
helpers) or a :class:`~gspo_kernels.objectives.registry.LossType` running another's (``LOSS_TYPE``); they are
registered here, in this order (the order of the derived tables). docs/architecture.md: how to add one.
"""

from __future__ import annotations

from gspo_kernels.objectives import cispo, clipped, gmpo, luspo, sapo, vespo
from gspo_kernels.objectives.registry import (
    LossType,
    Objective,
    check_options,
    loss_type,
    loss_types,
    objective,
    objectives,
    register,
    register_loss_type,
    triton_helpers,
    unregister,
)

__all__ = ["LossType", "Objective", "check_options", "loss_type", "loss_types", "objective", "objectives",
           "register", "register_loss_type", "triton_helpers", "unregister"]

for _module in (clipped, cispo, sapo):
    register(_module.OBJECTIVE)
register_loss_type(luspo.LOSS_TYPE)
for _module in (vespo, gmpo):
    register(_module.OBJECTIVE)
