"""The logits path's per-tile ``@triton.jit`` helpers (inlined into ``logits.py``'s kernels): a row's tile layout,
the column offsets, the online max / sum update of the forward and the gradient tile of the backward."""

from __future__ import annotations

import triton
import triton.language as tl

from gspo_kernels.backends.triton.kernel_math import exp2, soft_cap

# A finite "minus infinity": the running max starts there (exp2((_NEG_BIG - m) k) is 0, no -inf - -inf), and the
# log2-domain exponents are clamped to it where they multiply a probability (0 * _NEG_BIG is 0, 0 * -inf is NaN).
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def row_layout(row_off, vocab_size, BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    """How a row of ``vocab_size`` elements starting at element ``row_off`` (int64) is streamed: ``(aligned,
    n_body, n_head, tail_start, n_edge)``. The body is ``n_body`` full tiles from column ``head = aligned -
    row_off``, the first column whose address is a multiple of 16 bytes (``VEC`` elements; the tensor's data
    pointer is 16-byte aligned), read without masks: 128-bit loads whatever ``V`` and the row stride. The edge
    (masked) is columns ``[0, n_head)`` and ``[tail_start, V)``: ``n_edge`` columns, usually one tile.
    ``VEC == 1`` (a non-unit vocabulary stride): no body, the whole row is edge (``aligned`` is then unused)."""
    if VEC > 1:
        aligned = tl.multiple_of(((row_off + (VEC - 1)) // VEC) * VEC, VEC)
        head = (aligned - row_off).to(tl.int32)
        n_head = tl.minimum(head, vocab_size)
        n_body = tl.maximum(vocab_size - head, 0) // BLOCK_V
        tail_start = head + n_body * BLOCK_V
        n_edge = n_head + tl.maximum(vocab_size - tail_start, 0)
    else:
        aligned = row_off
        n_body = 0
        n_head = vocab_size
        tail_start = vocab_size
        n_edge = vocab_size
    return aligned, n_body, n_head, tail_start, n_edge


@triton.jit
def edge_columns(e0, cols, n_head, tail_start, n_edge):
    """Columns (and mask) of the edge tile starting at ``e0``: ``[0, n_head)`` then ``[tail_start, V)``."""
    idx = e0 + cols
    return tl.where(idx < n_head, idx, idx - n_head + tail_start), idx < n_edge


@triton.jit
def column_offsets(idx, stride_v, VEC: tl.constexpr):
    """Element offsets of the columns ``idx``: int32 for a unit stride (``VEC > 1``: fewer registers than 64-bit
    offsets), else int64 ``idx * stride_v`` (a transposed tensor's stride times a column can pass 2^31)."""
    if VEC > 1:
        return idx
    else:
        return idx.to(tl.int64) * stride_v


@triton.jit
def online_update(z, tile_max, row_max, s, a, k, HAS_ENTROPY: tl.constexpr, FAST_MATH: tl.constexpr):
    """Fold a tile of (capped) logits ``z`` (its max ``tile_max``) into the running max and the per-lane sums
    (log2 domain, ``x = (z - row_max) k``, ``k = log2(e) / T``): ``s = sum 2^x``, ``a = sum 2^x x``. The sums are
    rescaled only when the tile raises the max (a branch uniform over the block): per element a tile costs the
    max, ``x`` (one exact subtraction, one multiply), one ``exp2`` and the sums."""
    if tile_max > row_max:
        d = (row_max - tile_max) * k  # < 0
        scale = exp2(d, FAST_MATH)
        if HAS_ENTROPY:
            # a rescale by 2^d == 0 (d = -inf at tiny temperatures) empties the old sums instead of 0 * -inf
            a = tl.where(scale > 0, scale * (a + d * s), 0.0)
        s = s * scale
        row_max = tile_max
    x = (z - row_max) * k  # exact difference, then one rounding by log2(e) / T
    if HAS_ENTROPY:
        x = tl.maximum(x, _NEG_BIG, propagate_nan=tl.PropagateNan.ALL)  # -inf (or padding): 2^x = 0, 0 * x = 0 (a NaN stays)
    e = exp2(x, FAST_MATH)
    s += e
    if HAS_ENTROPY:
        a += e * x
    return row_max, s, a




@triton.jit
def grad_tile(z, row_max, k, log2_s, c0, c1, inv_cap, softcap,
              HAS_GRAD_ENTROPY: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FAST_MATH: tl.constexpr):
    """``dL/dz`` of a tile without the one-hot term: ``p (c0 + c1 log2 p)`` (times the cap's slope), with
    ``log2 p = (z - row_max) k - log2 S``; ``c0 = -(g + h H)``, ``c1 = -h ln 2`` per row (``c0 = -g`` without
    the entropy gradient). Per element: one subtraction, one FMA, one exp2, an FMA and a multiply."""
    slope = 1.0
    if HAS_SOFTCAP:
        z, slope = soft_cap(z, inv_cap, softcap, FAST_MATH, True)
    lp2 = (z - row_max) * k - log2_s
    if HAS_GRAD_ENTROPY:
        lp2 = tl.maximum(lp2, _NEG_BIG, propagate_nan=tl.PropagateNan.ALL)  # p = 0 at -inf: term 0; NaN stays
        grad = exp2(lp2, FAST_MATH) * (c0 + c1 * lp2)
    else:
        grad = exp2(lp2, FAST_MATH) * c0
    if HAS_SOFTCAP:
        grad = grad * slope
    return grad
