"""``backend="triton"``: fused Triton kernels for the logits path, the hidden-state path and the sequence stage.

One module per kernel direction (``logits_forward``, ``logits_backward``, ``linear_forward``,
``linear_backward``, ``sequence``: the ``@triton.jit`` kernel, then its launcher) and one module of
autograd Functions (``autograd``) that composes them. Every kernel module exposes ``H100_CONFIGS``
for ``gspo-kernels h100-report``.

Runs on CUDA tensors, and on CPU tensors when the Triton interpreter is active (``TRITON_INTERPRET=1`` set
before ``triton`` was imported), which is how the kernels are tested on machines without a GPU.
Importing this package imports neither triton nor any kernel module, so that ``TRITON_INTERPRET`` can
still be set first.
"""

from __future__ import annotations

import contextlib

import torch


def interpreter_active() -> bool:
    """True when the Triton kernels of this library run in the Triton interpreter (CPU tensors)."""
    from gspo_kernels.backends.triton.addressing import interpreter_active as active

    return active()


def device_guard(tensor: torch.Tensor):
    """Context in which a kernel launch targets ``tensor``'s CUDA device (not the current one).

    Triton launches on the *current* CUDA device; tensors on ``cuda:1`` while ``cuda:0`` is current would
    otherwise be handed to a kernel running on ``cuda:0``. A no-op for CPU tensors (the interpreter).
    """
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def supports(device: torch.device) -> bool:
    """CUDA devices, and the CPU while the interpreter is active."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        return interpreter_active()
    return False


def make_backend():
    """The Triton backend; raises (reported by ``backends.load``) when triton cannot be imported."""
    from gspo_kernels.backends import Backend
    from gspo_kernels.backends.triton.autograd import gspo_objective, linear_logprobs, logits_logprobs

    return Backend("triton", logits_logprobs, linear_logprobs, objective=gspo_objective, supports=supports)
