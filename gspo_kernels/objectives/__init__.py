"""The objectives, one module each, and their registry (:mod:`gspo_kernels.objectives.registry`).

Each module declares an :class:`~gspo_kernels.objectives.registry.Objective` (``OBJECTIVE``: its names, the
aggregation each implies, its options' checks, its PyTorch surrogate, its metrics) or a
:class:`~gspo_kernels.objectives.registry.LossType` running another's (``LOSS_TYPE``); they are imported here
(:data:`MODULES`, ordinary imports) and registered when the package is imported, in the order of their ``ORDER``
(the order of the derived tables). A backend's own form of an objective lives in that backend (the Triton
helpers: ``backends/triton/objectives/``). docs/architecture.md: how to add one.
"""

from __future__ import annotations

import sys

from gspo_kernels import config
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
    unregister,
)

__all__ = ["LossType", "Objective", "check_options", "loss_type", "loss_types", "objective", "objectives",
           "register", "register_loss_type", "unregister"]


MODULES = (clipped, cispo, sapo, luspo, vespo, gmpo)  # the package's objective modules (registered by ORDER)


def _register_builtins() -> None:
    """Register each module of :data:`MODULES` (an ``OBJECTIVE``, or a ``LOSS_TYPE`` running another's) by its
    ``ORDER`` (the order of the derived tables)."""
    for module in sorted(MODULES, key=lambda m: m.ORDER):
        if hasattr(module, "OBJECTIVE"):
            register(module.OBJECTIVE)
        else:
            register_loss_type(module.LOSS_TYPE)


_register_builtins()
config.use_registry(sys.modules[__name__])  # the config reads the objectives through this package
