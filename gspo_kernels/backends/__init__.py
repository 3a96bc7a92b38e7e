"""Backend registry: which implementation of the heavy per-token stage (and the sequence stage) runs.

A backend provides the stage functions of the backend contract, written once as Protocols in
:mod:`gspo_kernels.backends.contract`: ``logits_logprobs`` (:class:`~.contract.LogitsLogprobs`),
``linear_logprobs`` (:class:`~.contract.LinearLogprobs`) and, optionally, ``objective``,
``fused_linear_loss`` and ``fused_logits_loss`` (:class:`~.contract.Objective`,
:class:`~.contract.FusedLinearLoss`, :class:`~.contract.FusedLogitsLoss`).

``"auto"`` picks, for the tensors' device, the first available of: CUDA -> triton, torch;
CPU -> cpu (the C++ kernels, compiled on first use: :mod:`gspo_kernels.backends.cpu.build`), torch. It logs
the backend it picked once per (device, name). When the C++ kernels cannot be built (no compiler, ...), the
``cpu`` backend is unavailable with one ``RuntimeWarning`` and :func:`unavailable_reason` says why; with
``GSPO_KERNELS_REQUIRE_EXT=1`` in the environment that is a ``RuntimeError`` instead. Likewise a triton
older than the tested floor (:mod:`gspo_kernels.versions`) makes the ``triton`` backend unavailable with one
``RuntimeWarning`` naming the installed and the required version (``"auto"`` then runs ``torch`` on CUDA
tensors), and ``backend="triton"`` raises a ``RuntimeError`` that says the same; no kernel is ever built on it.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import warnings
from typing import Dict, Optional

import torch as _torch  # not ``torch``: importing the subpackage backends/torch binds that name here

from gspo_kernels.backends.contract import DEFAULT_MEMORY_BUDGET, Backend  # noqa: F401 (the package's names)
from gspo_kernels.versions import UnsupportedVersion

logger = logging.getLogger("gspo_kernels")



@dataclasses.dataclass(frozen=True)
class Registration:
    """A backend, registered once: its ``name`` (``backend=name``), the ``module`` whose ``make_backend()`` builds
    its :class:`Backend` (imported at first use), and ``auto``: for each device type where ``"auto"`` may pick it,
    its rank there (lower first)."""

    name: str
    module: str
    auto: Dict[str, int]


# The one list of backends: everything else (BACKENDS, "auto"'s order, the trainers' and the CLI's choices) reads it.
# Adding a backend: its folder (a make_backend() following backends/contract.py) and one line here.
REGISTRY = (
    Registration("torch", "gspo_kernels.backends.torch", auto={"cuda": 1, "cpu": 1}),
    Registration("triton", "gspo_kernels.backends.triton", auto={"cuda": 0}),
    Registration("cpu", "gspo_kernels.backends.cpu", auto={"cpu": 0}),
)
BACKENDS = tuple(r.name for r in REGISTRY)
_MODULES = {r.name: r.module for r in REGISTRY}
_AUTO_ORDER = {device: tuple(r.name for r in sorted((r for r in REGISTRY if device in r.auto),
                                                     key=lambda r: r.auto[device]))
               for device in sorted({d for r in REGISTRY for d in r.auto})}
_announced: set = set()


_cache: Dict[str, Optional[Backend]] = {}
_errors: Dict[str, str] = {}


def load(name: str) -> Optional[Backend]:
    """Import a backend; None (with the reason in :func:`unavailable_reason`) if it cannot run here."""
    if name not in _MODULES:
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {name!r}")
    if name not in _cache and _torch.compiler.is_compiling():
        # a backend's first use imports it (and may build the C++ kernels): nothing torch.compile can trace. Without
        # fullgraph Dynamo runs this call eagerly (one graph break, where the backend then loads); with it, this
        # error says what to do
        raise RuntimeError(f"backend {name!r} is not loaded yet, and torch.compile cannot import it while tracing: "
                           f"load it before compiling, with gspo_kernels.available_backends(device) or one eager "
                           f"call of the loss")
    if name not in _cache:
        try:
            module = importlib.import_module(_MODULES[name])
            _cache[name] = module.make_backend()
        except Exception as exc:  # an optional backend that cannot load here is reported, not fatal
            _cache[name] = None
            _errors[name] = f"{type(exc).__name__}: {exc}"
            if name == "cpu" and not _extension_required():
                warnings.warn(
                    f"gspo_kernels: backend 'cpu' (the C++ CPU kernels) is unavailable, so backend='auto' runs "
                    f"'torch' on CPU tensors: {_errors[name]}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            elif name == "triton" and isinstance(exc, UnsupportedVersion):
                # an absent triton (CPU-only installs) is normal and silent; one too old is said once
                warnings.warn(
                    f"gspo_kernels: backend 'triton' is unavailable, so backend='auto' runs 'torch' on CUDA "
                    f"tensors: {exc}",
                    RuntimeWarning,
                    stacklevel=2,
                )
    if _cache[name] is None and name == "cpu" and _extension_required():
        raise RuntimeError(f"GSPO_KERNELS_REQUIRE_EXT=1 but backend 'cpu' is unavailable: {_errors[name]}")
    return _cache[name]


def _extension_required() -> bool:
    """``GSPO_KERNELS_REQUIRE_EXT=1``: an unavailable ``cpu`` backend is an error (CI), not a warning."""
    return os.environ.get("GSPO_KERNELS_REQUIRE_EXT") == "1"


def unavailable_reason(name: str) -> Optional[str]:
    load(name)
    return _errors.get(name)


def available(device: _torch.device | str = "cpu") -> list:
    """Names of the backends that can run on ``device``."""
    device = _torch.device(device)
    out = []
    for name in BACKENDS:
        backend = load(name)
        if backend is not None and backend.supports(device):
            out.append(name)
    return out


def resolve(name: str, device: _torch.device) -> Backend:
    """The backend ``name`` (or the fastest one for ``device`` when ``name == "auto"``)."""
    if name == "auto":
        for candidate in _AUTO_ORDER.get(device.type, ("torch",)):
            backend = load(candidate)
            if backend is not None and backend.supports(device):
                key = (device.type, candidate)
                if key not in _announced:
                    _announced.add(key)
                    skipped = [
                        f"{c} ({unavailable_reason(c) or 'does not support ' + device.type})"
                        for c in _AUTO_ORDER.get(device.type, ())[: _AUTO_ORDER.get(device.type, ()).index(candidate)]
                    ] if candidate in _AUTO_ORDER.get(device.type, ()) else []
                    logger.debug(
                        "gspo_kernels: backend 'auto' on %s runs %r%s",
                        device.type,
                        candidate,
                        f"; unavailable: {', '.join(skipped)}" if skipped else "",
                    )
                return backend
        raise RuntimeError(f"no gspo_kernels backend can run on {device}")
    backend = load(name)
    if backend is None:
        raise RuntimeError(f"backend {name!r} is not available here: {unavailable_reason(name)}")
    if not backend.supports(device):
        raise ValueError(unsupported_device_message(name, device))
    return backend


def unsupported_device_message(name: str, device: _torch.device) -> str:
    """Why ``backend=name`` cannot take tensors on ``device``, and what the caller can pass or do instead."""
    others = [other for other in BACKENDS if other != name and (b := load(other)) is not None and b.supports(device)]
    named = ["'auto' (the fastest available)", *(repr(other) for other in others)]
    choices = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " or " + named[-1]
    message = f"backend {name!r} does not run on {device.type} tensors; for {device.type} tensors pass backend={choices}"
    if name == "triton" and device.type == "cpu":
        message += (", or move the tensors to a CUDA device; to debug the Triton kernels on the CPU, set "
                    "TRITON_INTERPRET=1 in the environment before triton is imported (the Triton interpreter: "
                    "slow, for tests)")
    elif name == "cpu" and device.type != "cpu":
        message += ", or move the tensors to the CPU"
    return message
