"""Row tiling shared by the CPU-side backends: views of ``[..., D]`` tensors as row blocks, never copies."""

from __future__ import annotations

from typing import Sequence

from torch import Tensor


def as_rows(x: Tensor) -> Tensor:
    """``[..., D]`` -> ``[rows, D]`` without a copy when the leading dimensions can be merged."""
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


def row_blocks(x: Tensor, block: int, balanced: bool = False) -> Sequence[tuple]:
    """Split ``x [..., D]`` into ``(r0, r1, view [r1 - r0, D])`` row blocks that never copy.

    A ``[B, T, V]`` tensor whose ``B`` and ``T`` cannot be merged into one strided dimension
    (e.g. ``logits[:, :-1]``) is walked one batch element at a time. ``balanced``: as many blocks as
    ``block`` rows need, of (nearly) equal size (1024 rows at ``block = 883``: 2 x 512, not 883 + 141).
    """
    if x.dim() == 2:
        n = x.shape[0]
        if balanced and n > 0:
            block = -(-n // -(-n // block))
        return [(r0, min(r0 + block, n), x[r0 : r0 + block]) for r0 in range(0, n, block)]
    try:
        flat = x.view(-1, x.shape[-1])
        return row_blocks(flat, block, balanced)
    except RuntimeError:
        pass
    out = []
    T = x.shape[1]
    for b in range(x.shape[0]):
        for r0, r1, view in row_blocks(x[b], block, balanced):
            out.append((b * T + r0, b * T + r1, view))
    return out
