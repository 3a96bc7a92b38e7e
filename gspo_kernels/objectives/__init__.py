"""The objectives, one module each, and their registry (:mod:`gspo_kernels.objectives.registry`).

Each module declares an :class:`~gspo_kernels.objectives.registry.Objective` (``OBJECTIVE``: its names, the
aggregation each implies, its options' checks, its PyTorch surrogate, its metrics, the module of its Triton
helpers) or a :class:`~gspo_kernels.objectives.registry.LossType` running another's (``LOSS_TYPE``); they are
registered here when the package is imported, in the order of their ``ORDER`` (the order of the derived tables).
docs/architecture.md: how to add one.
"""

from __future__ import annotations

import importlib
import pkgutil

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


def _register_builtins() -> None:
    """Register every module of this package that declares an ``OBJECTIVE`` or a ``LOSS_TYPE``, by its ``ORDER``
    (the order of the derived tables); ``*_triton`` modules (the Triton helpers) are not imported here."""
    modules = []
    for info in pkgutil.iter_modules(__path__):
        if info.name in ("base", "registry") or info.name.endswith("_triton"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "OBJECTIVE") or hasattr(module, "LOSS_TYPE"):
            modules.append(module)
    for module in sorted(modules, key=lambda m: m.ORDER):
        if hasattr(module, "OBJECTIVE"):
            register(module.OBJECTIVE)
        else:
            register_loss_type(module.LOSS_TYPE)


_register_builtins()
