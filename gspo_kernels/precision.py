"""The mixed-precision policy of the hidden-state functions (applied once, before any backend runs).

Which dtype the operands of ``hidden @ weight.T + bias`` take (the *operand dtype*):

1. ``fp32_head=True``: fp32 (bf16 / fp16 operands are upcast; TRL's ``cast_lm_head_to_fp32``).
2. Any fp64 operand: fp64 for both (a bf16 / fp16 / fp32 partner converts exactly); fp64 inputs give fp64
   results where the backend can.
3. Under ``torch.autocast`` on the tensors' device: the autocast dtype, for hidden, weight and bias
   alike (as autocast treats ``F.linear``): an fp32 hidden state and an fp32 lm_head become bf16 under
   bf16 autocast.
4. Outside autocast: the operands' common dtype; when hidden and weight differ, the lower-precision
   one (bf16 or fp16 against fp32). bf16 against fp16 has no lower-precision side and is refused.

Whatever the operand dtype, the products accumulate in fp32 (fp64 for fp64 operands), and the
log-probs, entropies and the loss are fp32 (fp64 for fp64 inputs); they are never rounded to the
operand dtype (:func:`compute_dtype`, asked by every backend). The casts are differentiable, so gradients reach the caller's tensors in their own
dtypes. The backends themselves run with autocast disabled: the policy has already decided.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor

_LOW = (torch.bfloat16, torch.float16)


def operand_dtype(
    hidden_dtype: torch.dtype, weight_dtype: torch.dtype, *, fp32_head: bool = False, device_type: str = "cpu"
) -> torch.dtype:
    """The dtype ``hidden`` and ``weight`` are cast to before the product (see the module docstring).

    Args:
        hidden_dtype, weight_dtype: the floating dtypes of the two operands.
        fp32_head: force fp32 operands.
        device_type: ``"cpu"`` / ``"cuda"``: whose autocast state applies.
    Returns:
        the operand dtype; both operands are cast to it.
    """
    if torch.float64 in (hidden_dtype, weight_dtype):
        return torch.float64
    if fp32_head:
        return torch.float32
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden_dtype == weight_dtype:
        return hidden_dtype
    if hidden_dtype in _LOW and weight_dtype in _LOW:
        raise TypeError(
            f"hidden is {hidden_dtype} and weight is {weight_dtype}: no lower-precision side to pick; cast one "
            "of them, or run under torch.autocast, or pass fp32_head=True"
        )
    return hidden_dtype if hidden_dtype in _LOW else weight_dtype


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a backend accumulates in and returns log-probs / entropies in, for inputs of ``dtype``:
    fp64 for fp64, fp32 for everything else (bf16 / fp16 values are converted exactly)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(x: Tensor) -> Tensor:
    """``x`` in :func:`compute_dtype` of its dtype: fp16 / bf16 -> fp32 (exact); fp32 and fp64 returned as is
    (the same tensor, so the float64 oracle keeps full precision). Shape unchanged."""
    dtype = compute_dtype(x.dtype)
    return x if x.dtype == dtype else x.to(dtype)


def apply_precision(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], *, fp32_head: bool = False
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(hidden, weight, bias)`` cast (differentiably) to :func:`operand_dtype`; unchanged if already there."""
    if not isinstance(fp32_head, bool):
        raise TypeError(f"fp32_head must be a bool, got {type(fp32_head).__name__}")
    dtype = operand_dtype(hidden.dtype, weight.dtype, fp32_head=fp32_head, device_type=hidden.device.type)
    hidden = hidden if hidden.dtype == dtype else hidden.to(dtype)
    weight = weight if weight.dtype == dtype else weight.to(dtype)
    if bias is not None and bias.dtype != dtype and bias.dtype != torch.float64:
        bias = bias.to(dtype)
    return hidden, weight, bias


@contextlib.contextmanager
def backend_context(device: torch.device) -> Iterator[None]:
    """Autocast off while a backend runs: its matmuls must not be recast after the policy decided."""
    if torch.is_autocast_enabled(device.type):
        with torch.autocast(device.type, enabled=False):
            yield
    else:
        yield


def kernel_operand_dtype(hidden_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel backend without fp64 products (Triton) multiplies ``hidden`` and ``weight`` in.

    Called by a backend *after* :func:`apply_precision` has decided; it decides nothing new: fp64 runs in
    fp32, equal dtypes keep that dtype, and a pair that still differs raises ``TypeError`` naming both.
    """
    hidden_kernel = torch.float32 if hidden_dtype == torch.float64 else hidden_dtype
    weight_kernel = torch.float32 if weight_dtype == torch.float64 else weight_dtype
    if hidden_kernel != weight_kernel:
        raise TypeError(
            f"hidden is {hidden_dtype} and weight is {weight_dtype}: the kernels need one operand dtype; "
            "apply gspo_kernels.precision.apply_precision first (the public functions do)"
        )
    return hidden_kernel
