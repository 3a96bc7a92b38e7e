"""What every Triton kernel of this backend shares: where it launches, how it addresses rows, how it runs.

* :func:`device_guard` (host): the context in which a launch targets the tensors' CUDA device.
* :func:`interpreter_active` (host): whether the kernels run in the Triton interpreter (CPU tensors).
* :func:`row_strides` (host): ``(rows_per_batch, stride_b, stride_t, stride_x)`` for a ``[N, X]`` or
  ``[B, T, X]`` tensor with any strides (logits ``X = V``, hidden states ``X = H``). Row ``r`` of the
  flattened ``N = B * T`` rows starts at element ``(r // rows_per_batch) * stride_b + (r % rows_per_batch) * stride_t``.
* :func:`row_offsets` (device): that formula, in int64.
* :func:`grouped_tile` (device): the grouped (L2-friendly) decode of a 1-D program id into a
  ``(row_tile, column_tile)`` pair: ``GROUP`` row tiles times every column tile are consecutive programs,
  so the rows of the tiles running at the same time stay in L2 while the columns stream through.
* :data:`ELEMENT_SIZES`: bytes per element of the dtype names used in the launch configurations.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

ELEMENT_SIZES: Dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}


def device_guard(tensor: torch.Tensor):
    """Context in which a kernel launch targets ``tensor``'s CUDA device (not the current one).

    Triton launches on the *current* CUDA device; tensors on ``cuda:1`` while ``cuda:0`` is current would
    otherwise be handed to a kernel running on ``cuda:0``. A no-op for CPU tensors (the interpreter).
    """
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def row_strides(t: torch.Tensor, name: str = "tensor") -> Tuple[int, int, int, int]:
    """``(rows_per_batch, stride_b, stride_t, stride_x)`` locating row ``r`` of ``t [N, X]`` / ``[B, T, X]``.

    Row ``r`` starts at ``(r // rows_per_batch) * stride_b + (r % rows_per_batch) * stride_t``; its
    ``j``-th element is ``stride_x * j`` further. ``rows_per_batch`` is at least 1 (empty tensors).
    """
    if t.dim() == 2:
        return max(t.shape[0], 1), 0, t.stride(0), t.stride(1)
    if t.dim() == 3:
        return max(t.shape[1], 1), t.stride(0), t.stride(1), t.stride(2)
    raise ValueError(f"{name} must be [N, X] or [B, T, X], got shape {tuple(t.shape)}")


@triton.jit
def row_offsets(rows, rows_per_batch, stride_b, stride_t):
    """int64 element offsets of the rows ``rows`` (flattened indices) of a tensor addressed by :func:`row_strides`."""
    rows = rows.to(tl.int64)
    return (rows // rows_per_batch) * stride_b + (rows % rows_per_batch) * stride_t


@triton.jit
def grouped_tile(pid, num_row_tiles, num_col_tiles, GROUP: tl.constexpr):
    """``(row_tile, col_tile)`` of program ``pid`` in the grouped order (``GROUP`` row tiles x all column tiles)."""
    per_group = GROUP * num_col_tiles
    first = (pid // per_group) * GROUP
    group_size = tl.minimum(num_row_tiles - first, GROUP)
    local = pid % per_group
    return first + local % group_size, local // group_size


def interpreter_active() -> bool:
    """True when the Triton kernels of this library run in the Triton interpreter (CPU tensors).

    Reads the kernel objects (what ``TRITON_INTERPRET`` was when ``triton`` decorated them), not the
    environment now, so it cannot disagree with how the kernels actually run. The answer cannot change
    while the process runs (the kernels are decorated once, at import): it is read once and kept, since
    every launch asks.
    """
    global _INTERPRETER_ACTIVE
    if _INTERPRETER_ACTIVE is None:
        from triton.runtime.interpreter import InterpretedFunction

        _INTERPRETER_ACTIVE = isinstance(grouped_tile, InterpretedFunction)
    return _INTERPRETER_ACTIVE


_INTERPRETER_ACTIVE: Optional[bool] = None
