"""``backend="triton"``: fused Triton kernels for the logits path, the hidden-state path and the sequence stage.

Runs on CUDA tensors, and on CPU tensors when the Triton interpreter is active (``TRITON_INTERPRET=1`` set
before ``triton`` was imported), which is how the kernels are tested on machines without a GPU.
"""

from __future__ import annotations

import torch

from gspo_kernels.backends import Backend


def interpreter_active() -> bool:
    """True when the Triton kernels of this library run in the Triton interpreter (CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    from gspo_kernels.triton import logprobs

    return isinstance(logprobs._logprobs_fwd_kernel, InterpretedFunction)


def supports(device: torch.device) -> bool:
    """CUDA devices, and the CPU while the interpreter is active."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        return interpreter_active()
    return False


def make_backend() -> Backend:
    """The Triton backend; raises (reported by ``backends.load``) when triton cannot be imported."""
    from gspo_kernels.triton.linear_function import linear_logprobs
    from gspo_kernels.triton.logits_function import gspo_objective, logits_logprobs

    return Backend("triton", logits_logprobs, linear_logprobs, objective=gspo_objective, supports=supports)
