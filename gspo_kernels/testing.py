"""What the library's own checks share (``gspo-kernels verify``, ``gpu-check``, the test suite): the
tolerances against the float64 reference, and the Triton interpreter's setup on machines without a GPU.

Like ``torch.testing``, this module is for checking the library, not for computing losses; importing it
imports neither triton nor any kernel.

Tolerances (see ``docs/kernels.md``): fp32 results within :data:`FP32_RTOL` of float64; a gradient
returned in bf16 / fp16 may add one rounding to that dtype per rounding its path performs
(:data:`PATH_ROUNDINGS`: the logits path rounds once, the hidden-state path twice). One exception, named by
the backend itself: ``backend="torch"`` on an accelerator writes fp16 / bf16 logits' gradient from a softmax in
their own dtype where no softmax kernel reads them into fp32 (bf16 on CUDA), so an entry off the label column is
rounded twice there (``gradient_tolerance(..., backend=, device=)``).
"""

from __future__ import annotations

import importlib.util
import os
import sys

FP32_RTOL = 1e-5
# One rounding of a result to the dtype, relative: half an ulp (round to nearest even).
UNIT_ROUNDOFF = {"fp32": 0.0, "bf16": 2.0**-8, "fp16": 2.0**-11}
PATH_ROUNDINGS = {"logits": 1, "linear": 2}


def gradient_tolerance(dtype_name: str, path: str, *, backend: "str | None" = None, device=None) -> float:
    """Relative tolerance of a gradient returned in ``dtype_name`` (see the module docstring); ``backend`` and
    ``device`` (where the gradient was computed) name the one case that rounds more (None: the path's rule)."""
    roundings = PATH_ROUNDINGS[path]
    if path == "logits" and backend == "torch" and device is not None and dtype_name in ("bf16", "fp16"):
        import torch

        from gspo_kernels.backends.torch.logits import logits_gradient_roundings

        dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float16
        roundings = logits_gradient_roundings(torch.device(device), dtype)
    return FP32_RTOL + roundings * UNIT_ROUNDOFF[dtype_name]


def rel_err(a, b) -> float:
    """Largest absolute difference relative to the largest entry of the reference ``b``."""
    a, b = a.detach().double(), b.detach().double().to(a.device)
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def setup_triton_interpreter() -> str:
    """Without a CUDA device, run Triton kernels in the interpreter (must precede importing triton), with
    its fp32 -> bf16 casts rounding to nearest even as the GPU's do (:func:`round_interpreter_bf16_casts`)."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if importlib.util.find_spec("triton") is None:  # an install without triton: no Triton backend to check
        return "cpu"
    if "triton" not in sys.modules and os.environ.get("TRITON_INTERPRET") is None:
        os.environ["TRITON_INTERPRET"] = "1"
    if os.environ.get("TRITON_INTERPRET") == "1":
        round_interpreter_bf16_casts()
        return "cpu (Triton kernels run in the Triton interpreter: correctness only, no GPU timing)"
    return "cpu"


def round_interpreter_bf16_casts() -> None:
    """Make the Triton interpreter's fp32 -> bf16 casts round to nearest even, as the GPU's ``cvt.rn`` does.

    The interpreter (triton 3.7 - 3.9) drops the low 16 bits (truncation toward zero: up to one ulp, always
    toward zero), and its ``fp_downcast_rounding="rtne"`` path mishandles the carry into the exponent. Every
    implicit or explicit fp32 -> bf16 conversion of a kernel (``.to(tl.bfloat16)``, a store through a bf16
    pointer) goes through ``InterpreterBuilder.cast_impl``; this wraps it. Without the wrapper, bf16 results
    of the Triton backend under the interpreter err up to twice as much as on a GPU, biased toward zero.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "rounds_bf16_to_nearest", False):
        return
    truncating = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # ties to even; overflow rounds to inf
            quiet_nan = (bits >> 16) | 0x40
            out = np.where(np.isnan(src.data), quiet_nan, rounded).astype(np.uint16)
            return interpreter.TensorHandle(out.reshape(np.shape(src.data)), tl.bfloat16)
        return truncating(self, src, dst_type)

    cast_impl.rounds_bf16_to_nearest = True
    builder.cast_impl = cast_impl
