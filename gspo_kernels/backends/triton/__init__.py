"""``backend="triton"``: fused Triton kernels for the logits path, the hidden-state path and the sequence stage.

One module per operation, each holding its ``@triton.jit`` kernels, their launchers and the autograd
Function side by side:

* ``logits.py``: ``logits -> (logp, entropy)`` and its gradient (``logits_logprobs``);
* ``linear.py``: ``hidden @ weight.T (+ bias) -> (logp, entropy)`` without the logits (``linear_logprobs``);
* ``sequence.py``: ``(logp, entropy) -> loss`` with the metrics (the backend's ``fused_objective``);

plus ``launch.py`` (device guard, interpreter detection, row offsets shared by the kernels) and
``configs.py`` (every tile size and tuning table, and ``H100_CONFIGS`` for ``gspo-kernels h100-report``).

Every entry point (``logits_logprobs``, ``linear_logprobs`` in both modes, ``fused_linear_loss``) takes
``softcap: Optional[float] = None``: the final-logit soft cap ``z -> c tanh(z / c)``, applied before the
temperature inside the kernels (None: the uncapped kernels, unchanged).

Runs on CUDA tensors, and on CPU tensors when the Triton interpreter is active (``TRITON_INTERPRET=1`` set
before ``triton`` was imported), which is how the kernels are tested on machines without a GPU.
Importing this package imports neither triton nor any kernel module, so that ``TRITON_INTERPRET`` can
still be set first.
"""

from __future__ import annotations

import torch


def supports(device: torch.device) -> bool:
    """CUDA devices, and the CPU while the interpreter is active."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        from gspo_kernels.backends.triton.launch import interpreter_active

        return interpreter_active()
    return False


def make_backend():
    """The Triton backend; raises (reported by ``backends.load``) when triton cannot be imported, or is older
    than the floor this package is tested on (:func:`gspo_kernels.versions.check_triton`), before any kernel
    module is imported."""
    from gspo_kernels.versions import check_triton

    check_triton()
    from gspo_kernels.backends import Backend
    from gspo_kernels.backends.triton.linear import linear_logprobs
    from gspo_kernels.backends.triton.linear_loss import fused_linear_loss
    from gspo_kernels.backends.triton.logits import logits_logprobs
    from gspo_kernels.backends.triton.logits_loss import fused_logits_loss
    from gspo_kernels.backends.triton.sequence import fused_objective

    return Backend("triton", logits_logprobs, linear_logprobs, objective=fused_objective, supports=supports,
                   fused_linear_loss=fused_linear_loss, fused_logits_loss=fused_logits_loss)
