"""``backend="triton"``: fused Triton kernels for the logits path, the hidden-state path and the sequence stage.

One module per operation, each read top to bottom: its ``@triton.jit`` kernels, their launchers, the autograd
Function, the public function:

* ``logits.py``: ``logits -> (logp, entropy)`` and its gradient (``logits_logprobs``);
* ``linear.py``: ``hidden @ weight.T (+ bias) -> (logp, entropy)`` without the ``[N, V]`` logits, on the vendor
  GEMMs (``linear_logprobs``, the default);
* ``linear_invariant.py``: the same on Triton GEMMs, batch invariant (``linear_logprobs(batch_invariant=True)``;
  its kernels in ``linear_invariant_kernels.py``);
* ``sequence.py``: ``(logp, entropy) -> loss`` with the metrics (the backend's ``fused_objective``);

the composite losses, each one call over an operation and the sequence stage:

* ``logits_loss.py``: ``logits -> loss`` in one autograd node (``fused_logits_loss``);
* ``linear_loss.py``: ``hidden -> loss`` in one pass, the gradient formed in the forward (``fused_linear_loss``);

and what they share: ``kernel_math.py`` (the ``@triton.jit`` exp2 and soft cap, the bias the kernels add), ``launch.py`` (device guard, interpreter detection, row offsets) and ``configs.py`` (every tile
size and tuning table, and ``H100_CONFIGS`` for ``gspo-kernels h100-report``). ``linear.py`` imports nothing
from ``linear_invariant.py``: :func:`linear_logprobs` here picks one of the two.

Under ``torch.compile`` the entries call ``torch.library`` operators instead of the autograd Functions
(``operators.py``: the operators, their fake implementations and autograd formulas, and the entries that choose).

Every entry point (``logits_logprobs``, ``linear_logprobs`` in both modes, ``fused_linear_loss``,
``fused_logits_loss``) takes the call's :class:`~gspo_kernels.options.CallOptions` and hands it, as one object, to
its autograd Function; among its fields ``softcap``: the final-logit soft cap ``z -> c tanh(z / c)``, applied
before the temperature inside the kernels (None: the uncapped kernels, unchanged).

Runs on CUDA tensors, and on CPU tensors when the Triton interpreter is active (``TRITON_INTERPRET=1`` set
before ``triton`` was imported), which is how the kernels are tested on machines without a GPU.
Importing this package imports neither triton nor any kernel module, so that ``TRITON_INTERPRET`` can
still be set first.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.options import DEFAULT_OPTIONS, CallOptions


def supports(device: torch.device) -> bool:
    """CUDA devices, and the CPU while the interpreter is active."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        from gspo_kernels.backends.triton.launch import interpreter_active

        return interpreter_active()
    return False


def linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                    active: Optional[Tensor] = None, options: CallOptions = DEFAULT_OPTIONS, *,
                    leaves: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """The backend contract's ``linear_logprobs`` (:class:`gspo_kernels.backends.contract.LinearLogprobs`):
    :func:`.operators.linear_logprobs` (the vendor GEMMs by default, the batch-invariant Triton GEMMs with
    ``options.batch_invariant``; their operator under ``torch.compile``)."""
    from gspo_kernels.backends.triton import operators

    return operators.linear_logprobs(hidden, weight, bias, labels, active, options, leaves=leaves)


def make_backend():
    """The Triton backend; raises (reported by ``backends.load``) when triton cannot be imported, or is older
    than the floor this package is tested on (:func:`gspo_kernels.versions.check_triton`), before any kernel
    module is imported."""
    from gspo_kernels.versions import check_triton

    check_triton()
    from gspo_kernels.backends.contract import Backend
    from gspo_kernels.backends.triton import operators

    return Backend("triton", operators.logits_logprobs, operators.linear_logprobs,
                   sequence_stage=operators.sequence_stage, supports=supports,
                   fused_linear_loss=operators.fused_linear_loss, fused_logits_loss=operators.fused_logits_loss)
