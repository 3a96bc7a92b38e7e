"""Backend registry: which implementation of the heavy per-token stage (and the sequence stage) runs.

A backend provides, as differentiable functions (autograd Functions inside the backend):

``logits_logprobs(logits, labels, *, active, temperature, return_entropy, inplace_backward, softcap=None)``
    ``logits``: ``[N, V]`` or ``[B, T, V]`` (any strides, fp16/bf16/fp32/fp64), ``labels``: ``[N]`` int64
    already in ``[0, V)``; ``active``: ``[N]`` bool or None, rows that may be skipped in the forward
    (their outputs are 0) when False. Returns ``(logp [N] fp32, entropy [N] fp32 or None)``. The backward
    receives ``grad_logp`` / ``grad_entropy`` (``[N]`` each, possibly None) and does no work for rows
    where both are zero; their logits gradient is exactly 0. With ``inplace_backward`` the gradient is
    written into the logits' own storage.

``softcap`` (every backend's three functions accept it): ``None``, no cap, or a float ``c > 0`` (checked by
the public functions): every logit ``z`` (``hidden @ weight.T + bias`` on the hidden-state path, the bias
added first) becomes ``c * tanh(z / c)`` *before* the division by the temperature, so the backward
multiplies each logit's gradient by ``1 - tanh^2(z / c)``. The cap is not shift-invariant: a backend must
not shift the bias (or the logits) by a constant when it is set. The public functions pass the keyword
only when a cap is set, so an uncapped call is the call a backend received before the keyword existed.

``linear_logprobs(hidden, weight, bias, labels, *, active, temperature, return_entropy, memory_budget=None,
batch_invariant=False, softcap=None)``
    ``hidden``: ``[N, H]`` or ``[B, T, H]``, ``weight``: ``[V, H]``, ``bias``: ``[V]`` or None; same
    outputs and the same skipping rule, gradients for hidden, weight and bias. ``memory_budget``:
    bytes the backend may use for logits saved between forward and backward and for its chunk
    buffers (None: :data:`DEFAULT_MEMORY_BUDGET`, the one default of every backend that uses it); it is
    validated by the public functions (:func:`gspo_kernels.checks.check_memory_budget`), never again
    here, and never changes the results' meaning. ``batch_invariant=True`` (passed only when the caller asks):
    a row's results are the same bits whatever the rest of the batch; a backend that cannot promise it raises.

Labels outside ``[0, V)`` reach a backend only when the public checks are skipped (under
``torch.compile``): a backend never reads out of bounds for them, and that row's log-prob is NaN.

``objective`` (optional)
    a replacement for :func:`gspo_kernels.objective.gspo_objective` with the same signature.

``fused_linear_loss(objective, hidden, weight, bias, inputs, config, *, memory_budget=None, softcap=None,
leaves=None, logprobs_out=None)`` (optional)
    the whole loss of the hidden-state path in one call, its gradient formed during the forward (the
    one-pass form of :func:`gspo_kernels.fused_linear_gspo_loss`); returns a ``LossOutput``, or None when it
    cannot run this input (the pipeline then runs ``linear_logprobs`` and the objective). ``leaves``: the
    caller's tensors that the precision policy cast into the operands (the gradients go to them, in their
    dtypes); ``logprobs_out [N]``: receives the detached per-token log-probs, 0 where the mask is 0.

``fused_logits_loss(logits, inputs, config, *, inplace_backward=False, softcap=None)`` (optional)
    the whole loss of the logits path with the backend's own ``objective``, as one differentiable call (the
    log-probs and the sequence stage in one autograd node, no per-token gradient tensors between them);
    returns a ``LossOutput`` equal to ``objective(*logits_logprobs(...), inputs, config)``.

``"auto"`` picks, for the tensors' device, the first available of: CUDA -> triton, torch;
CPU -> cpu (the C++ kernels, compiled on first use: :mod:`gspo_kernels.backends.cpu_build`), torch. It logs
the backend it picked once per (device, name). When the C++ kernels cannot be built (no compiler, ...), the
``cpu`` backend is unavailable with one ``RuntimeWarning`` and :func:`unavailable_reason` says why; with
``GSPO_KERNELS_REQUIRE_EXT=1`` in the environment that is a ``RuntimeError`` instead. Likewise a triton
older than the tested floor (:mod:`gspo_kernels.versions`) makes the ``triton`` backend unavailable with one
``RuntimeWarning`` naming the installed and the required version (``"auto"`` then runs ``torch`` on CUDA
tensors), and ``backend="triton"`` raises a ``RuntimeError`` that says the same; no kernel is ever built on it.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from typing import Callable, Dict, Optional

import torch as _torch  # not ``torch``: importing the subpackage backends/torch binds that name here

from gspo_kernels.versions import UnsupportedVersion

logger = logging.getLogger("gspo_kernels")

BACKENDS = ("torch", "triton", "cpu")
DEFAULT_MEMORY_BUDGET = 1 << 30  # bytes; see the contract above
_MODULES = {
    "torch": "gspo_kernels.backends.torch",
    "triton": "gspo_kernels.backends.triton",
    "cpu": "gspo_kernels.backends.cpu",
}
_AUTO_ORDER = {"cuda": ("triton", "torch"), "cpu": ("cpu", "torch")}
_announced: set = set()


class Backend:
    """A named set of stage implementations (see module docstring)."""

    def __init__(
        self,
        name: str,
        logits_logprobs: Callable,
        linear_logprobs: Callable,
        objective: Optional[Callable] = None,
        supports: Optional[Callable[[_torch.device], bool]] = None,
        fused_linear_loss: Optional[Callable] = None,
        fused_logits_loss: Optional[Callable] = None,
    ) -> None:
        self.name = name
        self.logits_logprobs = logits_logprobs
        self.linear_logprobs = linear_logprobs
        self.objective = objective
        self.fused_linear_loss = fused_linear_loss
        self.fused_logits_loss = fused_logits_loss
        self._supports = supports

    def supports(self, device: _torch.device) -> bool:
        return True if self._supports is None else bool(self._supports(device))

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


_cache: Dict[str, Optional[Backend]] = {}
_errors: Dict[str, str] = {}


def load(name: str) -> Optional[Backend]:
    """Import a backend; None (with the reason in :func:`unavailable_reason`) if it cannot run here."""
    if name not in _MODULES:
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {name!r}")
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
        raise ValueError(f"backend {name!r} does not run on {device} tensors")
    return backend
