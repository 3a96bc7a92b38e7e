"""The logits path: ``(logits [N, V] | [B, T, V], labels [N]) -> (logp [N], entropy [N])`` and its gradient.

Forward (:func:`logprobs_fwd_kernel`, launched by :func:`logprobs_forward`). Each program owns one row
(token) of the caller's logits, any strides (e.g. ``logits[:, :-1]`` of a model output, never copied). It
streams the row once in ``BLOCK_V`` tiles and keeps, in fp32 (fp64 for fp64 logits; the temperature is an
fp32 scalar either way), in the base-2 domain with ``k = log2(e) / T`` (one multiply per element for both):

* ``row_max``: the running max of the logits ``z`` (one per row, so each element costs a single ``exp2``);
* per lane, with ``x = (z - row_max) k``: ``s = sum 2^x`` and ``a = sum 2^x x``.

Only a tile that raises the max rescales the lanes' sums (``d = (m - m') k``: ``s' = 2^d s``,
``a' = 2^d (a + d s)``); the branch is uniform over the block and, after the first tiles of a row, rarely taken.
At the end ``S = sum_lanes s``, ``log S = ln 2 log2 S``, ``H = ln 2 (log2 S - A / S)`` (entropy without the
cancellation of ``lse - E[x]``) and ``logp = ln 2 ((z_y - row_max) k - log2 S)``. On CUDA ``exp2`` is one
``MUFU.EX2`` (libdevice's ``exp2f``, flushing results below 2^-126 to 0); ``-inf`` logits (and the padding of
masked lanes) are clamped to a finite ``x`` where they multiply a zero probability.

Two precision choices (see docs/gpu.md):

* the max is subtracted from the logit *before* the multiplication by ``k``, so ``z - row_max`` is exact for
  logits close to the max (Sterbenz) however large their offset (``randn + 1e4``) and however small the
  temperature (``1e-6``); ``z k - row_max k`` in one FMA would carry ``row_max k``'s rounding, which is about
  ``1e3`` (log2 units) at ``T = 1e-6``;
* the row's max and ``log S`` are kept apart (``row_stats [2, N]``) instead of one fp32
  ``lse = row_max / T + log S``: a single fp32 ``lse`` near ``1e4`` carries an absolute rounding error of
  ``~5e-4``, which every ``p = exp(x - lse)`` of the backward would inherit.

Alignment: with unit vocabulary stride a row is read as a masked *head* (the columns before the first
16-byte-aligned address), an unmasked *body* of full tiles from there (128-bit loads whatever ``V`` and the
row stride: GPT-2's 50257, an uneven tensor-parallel shard, a trimmed head) and a masked *tail*; head and
tail are one masked tile, usually (:func:`row_layout`, :func:`edge_columns`). The body issues the load of tile
``t + 1`` before the reductions of tile ``t`` (a software prefetch held in registers).

Backward (:func:`logprobs_bwd_kernel`, launched by :func:`logprobs_backward`). For row ``t`` with
``log p = (z - row_max) / T - log S``, label ``y``, incoming gradients ``g = dL/dlogp_t`` and ``h = dL/dH_t``::

    dL/dz[v] = (g / T) * (1[v = y] - p[v])  -  (h / T) * p[v] * (log p[v] + H_t)

(see docs/math.md, "Gradients"), computed per element as ``p (c0 + c1 log2 p)`` with the per-row constants
``c0 = -(g + h H) / T``, ``c1 = -h ln 2 / T``: one subtraction, one FMA for ``log2 p``, one ``exp2``, an FMA and a
multiply. The one-hot term ``g / T`` is added to the label's column after the row is written (a block barrier,
then one store): no per-element compare. The entropy term is 0 where ``p[v] == 0`` (a ``-inf`` logit). One
program per *output* row, one streaming pass over the row, the same aligned body (128-bit loads and stores when
the gradient's rows share the logits' alignment, ``DST_ALIGNED``). A row whose ``g`` and ``h`` are both zero
(masked, clipped or zero-advantage tokens, or rows that were inactive in the forward) is not read: the program
only writes zeros.

Soft cap (``softcap = c``, Gemma's ``final_logit_softcapping``): every logit is first replaced by
``c tanh(z / c)`` (:func:`.kernel_math.soft_cap`), then divided by the temperature; ``row_stats[0]`` is the max
*capped* logit and the backward multiplies the gradient with respect to the capped logit by ``1 - tanh^2(z / c)``.
A constexpr (``HAS_SOFTCAP``): the uncapped kernels are unchanged.

Extra position: the gradient may have one more position per sequence than the logits
(``out_rows_per_batch = rows_per_batch + 1``): a model's ``[B, T + 1, V]`` output read as ``logits[:, :-1]``
gets its gradient for all ``T + 1`` positions in one launch, zeros at the last one, so autograd's
``slice_backward`` never allocates a second ``[B, T + 1, V]`` buffer (:func:`next_token_base`). With the
output pointing at the logits' own storage (``inplace``), each tile is read before it is overwritten by the
same program, and the label's logit is read before the row: no extra buffer at all.

Labels are bounds-checked in the kernels: a label outside ``[0, V)`` (e.g. an unmasked ``-100`` when the
eager check is skipped under ``torch.compile``) is never used as an address; that row's log-prob (and its
gradient, when it carries one) is NaN. Rows whose ``active`` flag is False are not read; their outputs are 0.

:class:`TritonLogitsLogprobs` (autograd) saves only ``[N]`` tensors (labels, active, ``row_stats``,
entropy) plus the logits themselves (no copy); ``inplace_backward=True`` writes the gradient into the logits'
storage (the caller's logits are consumed).
"""


from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from gspo_kernels.backends.tiling import next_token_base
from gspo_kernels.backends.triton.configs import (
    LOGITS_NUM_STAGES,
    LOGITS_NUM_WARPS,
    logits_block_v,
    logits_edge_v,
)
from gspo_kernels.backends.triton.kernel_math import soft_cap
from gspo_kernels.backends.triton.launch import device_guard, interpreter_active, row_offsets, row_strides
from gspo_kernels.backends.triton.logits_tiles import (
    _NEG_BIG,
    column_offsets,
    edge_columns,
    grad_tile,
    online_update,
    row_layout,
)
from gspo_kernels.options import DEFAULT_OPTIONS, CallOptions
from gspo_kernels.precision import compute_dtype

_LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln 2
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def logprobs_fwd_kernel(
    logits_ptr, labels_ptr, active_ptr, logp_ptr, entropy_ptr,
    row_stats_ptr,  # [2, N]: the row's max (capped) logit, then log S
    n_rows, rows_per_batch, stride_b, stride_t, stride_v, vocab_size, inv_temperature, softcap,
    BLOCK_V: tl.constexpr, EDGE_V: tl.constexpr, VEC: tl.constexpr, HAS_ACTIVE: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FAST_MATH: tl.constexpr,
):
    row = tl.program_id(0)
    if HAS_ACTIVE:
        is_active = tl.load(active_ptr + row) != 0
    else:
        is_active = True
    if is_active:
        row_off = row_offsets(row, rows_per_batch, stride_b, stride_t)
        cols = tl.arange(0, BLOCK_V)
        acc_dtype = logp_ptr.dtype.element_ty  # fp32 (fp64 for fp64 logits)
        k = tl.full([], _LOG2E, acc_dtype) * inv_temperature
        inv_cap = 1.0 / softcap
        row_max = tl.full([], _NEG_BIG, acc_dtype)  # running max of the (capped) logits: one exp2 per element
        s = tl.zeros([BLOCK_V], acc_dtype)  # per-lane sums, reduced once at the end
        a = tl.zeros([BLOCK_V], acc_dtype)
        aligned, n_body, n_head, tail_start, n_edge = row_layout(row_off, vocab_size, BLOCK_V, VEC)
        if VEC > 1:  # unit stride: an aligned, unmasked body
            body = logits_ptr + aligned
            # Prefetch: tile t + 1 is loaded before tile t is reduced (the last load repeats the last tile).
            z_next = tl.load(body + cols, mask=cols < n_body * BLOCK_V, other=0.0)
            for t in range(0, n_body):
                z = z_next.to(acc_dtype)
                z_next = tl.load(body + tl.minimum(t + 1, n_body - 1) * BLOCK_V + cols)
                if HAS_SOFTCAP:
                    z, _ = soft_cap(z, inv_cap, softcap, FAST_MATH, False)
                row_max, s, a = online_update(z, tl.max(z, axis=0), row_max, s, a, k, HAS_ENTROPY, FAST_MATH)
        base = logits_ptr + row_off
        # The masked edge (every column when the stride is not 1) in narrower tiles of EDGE_V columns: its
        # scattered addresses would otherwise hold more registers than the body needs. The body's sums ride in
        # lane 0 of the edge's.
        ecols = tl.arange(0, EDGE_V)
        s_edge = tl.where(ecols == 0, tl.sum(s, axis=0), 0.0)
        a_edge = tl.where(ecols == 0, tl.sum(a, axis=0), 0.0)
        for e0 in range(0, n_edge, EDGE_V):
            idx, inside = edge_columns(e0, ecols, n_head, tail_start, n_edge)
            z = tl.load(base + column_offsets(idx, stride_v, VEC), mask=inside, other=float("-inf")).to(acc_dtype)
            if HAS_SOFTCAP:
                z, _ = soft_cap(z, inv_cap, softcap, FAST_MATH, False)
                z = tl.where(inside, z, float("-inf"))
            row_max, s_edge, a_edge = online_update(z, tl.max(z, axis=0), row_max, s_edge, a_edge, k, HAS_ENTROPY,
                                                    FAST_MATH)
        s = s_edge
        a = a_edge
        sum_s = tl.sum(s, axis=0)
        log2_s = tl.log2(sum_s)
        label = tl.load(labels_ptr + row)
        valid = (label >= 0) & (label < vocab_size)
        z_label = tl.load(base + tl.where(valid, label, 0) * stride_v, mask=valid, other=0.0).to(acc_dtype)
        if HAS_SOFTCAP:
            z_label, _ = soft_cap(z_label, inv_cap, softcap, FAST_MATH, False)
        logp = ((z_label - row_max) * k - log2_s) * _LN2
        tl.store(logp_ptr + row, tl.where(valid, logp, float("nan")))
        tl.store(row_stats_ptr + row, row_max)
        tl.store(row_stats_ptr + n_rows + row, log2_s * _LN2)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, (log2_s - tl.sum(a, axis=0) / sum_s) * _LN2)
    else:
        tl.store(logp_ptr + row, 0.0)
        tl.store(row_stats_ptr + row, 0.0)
        tl.store(row_stats_ptr + n_rows + row, 0.0)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)


@triton.jit
def logprobs_bwd_kernel(
    logits_ptr, dlogits_ptr, labels_ptr, active_ptr, grad_logp_ptr, grad_entropy_ptr, entropy_ptr,
    row_stats_ptr,  # [2, N] from the forward
    grad_scale_ptr, logp_scale_ptr, entropy_scale_ptr,  # 0-dim fp32 each, read with HAS_GRAD_SCALE
    n_rows, rows_per_batch, out_rows_per_batch, stride_b, stride_t, stride_v, dstride_b, dstride_t, dstride_v,
    vocab_size, label_offset, label_limit, inv_temperature, softcap,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, DST_ALIGNED: tl.constexpr, HAS_ACTIVE: tl.constexpr,
    HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, FAST_MATH: tl.constexpr,
):
    out_row = tl.program_id(0).to(tl.int64)
    batch = out_row // out_rows_per_batch
    pos = out_row % out_rows_per_batch
    in_range = pos < rows_per_batch  # False only at the extra position of a [B, T + 1, V] gradient
    row = tl.where(in_range, batch * rows_per_batch + pos, 0)  # the token's index in [N]
    src_off = batch * stride_b + pos * stride_t
    dst_off = batch * dstride_b + pos * dstride_t
    cols = tl.arange(0, BLOCK_V)
    out_ty = dlogits_ptr.dtype.element_ty

    acc_dtype = row_stats_ptr.dtype.element_ty  # fp32 (fp64 for fp64 logits)
    g = 0.0
    h = 0.0
    if HAS_GRAD_LOGP:
        g_in = tl.load(grad_logp_ptr + row)
        if HAS_GRAD_SCALE:  # the sequence stage's backward, in fp32: coef_t * (grad_loss * scale)
            g_in = g_in * (tl.load(grad_scale_ptr) * tl.load(logp_scale_ptr))
        g = g_in.to(acc_dtype) * inv_temperature
    if HAS_GRAD_ENTROPY:
        h_in = tl.load(grad_entropy_ptr + row)
        if HAS_GRAD_SCALE:  # mask_t * (grad_loss * scale)
            h_in = h_in * (tl.load(grad_scale_ptr) * tl.load(entropy_scale_ptr))
        h = h_in.to(acc_dtype) * inv_temperature
    keep = in_range
    if HAS_ACTIVE:
        keep = keep & (tl.load(active_ptr + row) != 0)
    g = tl.where(keep, g, 0.0)
    h = tl.where(keep, h, 0.0)

    if (g != 0.0) | (h != 0.0):
        row_max = tl.load(row_stats_ptr + row)
        k = tl.full([], _LOG2E, acc_dtype) * inv_temperature
        log2_s = tl.load(row_stats_ptr + n_rows + row) * _LOG2E
        inv_cap = 1.0 / softcap
        label = tl.load(labels_ptr + row)
        # An out-of-range label never matches a column: the row is poisoned instead (its logp is NaN).
        g = tl.where((g != 0.0) & ((label < 0) | (label >= label_limit)), float("nan"), g)
        # The row's columns are the vocabulary's [label_offset, label_offset + vocab_size) (a slice of the
        # vocabulary, with the whole row's stats; 0 and V otherwise): a label outside them has no column here.
        label = label - label_offset
        valid = (label >= 0) & (label < vocab_size)
        # The label's logit, read before the loops (with an in-place gradient they overwrite it).
        z_label = tl.load(logits_ptr + src_off + tl.where(valid, label, 0) * stride_v, mask=valid,
                          other=0.0).to(acc_dtype)
        ent = 0.0
        if HAS_GRAD_ENTROPY:
            ent = tl.load(entropy_ptr + row)
        c0 = -(g + h * ent)
        c1 = -h * _LN2
        s_aligned, n_body, n_head, tail_start, n_edge = row_layout(src_off, vocab_size, BLOCK_V, VEC)
        if VEC > 1:
            src = logits_ptr + s_aligned
            if DST_ALIGNED:  # the output rows sit at the same offsets modulo 16 bytes
                dst = dlogits_ptr + tl.multiple_of(dst_off + (s_aligned - src_off), VEC)
            else:
                dst = dlogits_ptr + dst_off + (s_aligned - src_off)
            for t in range(0, n_body):
                offs = t * BLOCK_V + cols
                z = tl.load(src + offs).to(acc_dtype)
                grad = grad_tile(z, row_max, k, log2_s, c0, c1, inv_cap, softcap, HAS_GRAD_ENTROPY, HAS_SOFTCAP,
                                 FAST_MATH)
                tl.store(dst + offs, grad.to(out_ty))
        for e0 in range(0, n_edge, BLOCK_V):
            idx, inside = edge_columns(e0, cols, n_head, tail_start, n_edge)
            z = tl.load(logits_ptr + src_off + column_offsets(idx, stride_v, VEC), mask=inside, other=0.0).to(acc_dtype)
            grad = grad_tile(z, row_max, k, log2_s, c0, c1, inv_cap, softcap, HAS_GRAD_ENTROPY, HAS_SOFTCAP,
                             FAST_MATH)
            tl.store(dlogits_ptr + dst_off + column_offsets(idx, dstride_v, VEC), grad.to(out_ty), mask=inside)
        # The one-hot term: the label's column again, once every thread's tiles are written.
        tl.debug_barrier()
        if valid:
            slope = 1.0
            if HAS_SOFTCAP:
                z_label, slope = soft_cap(z_label, inv_cap, softcap, FAST_MATH, True)
            grad_label = grad_tile(z_label, row_max, k, log2_s, c0, c1, inv_cap, softcap, HAS_GRAD_ENTROPY, False,
                                   FAST_MATH)
            tl.store(dlogits_ptr + dst_off + label * dstride_v, ((grad_label + g) * slope).to(out_ty))
    else:
        zeros = tl.zeros([BLOCK_V], out_ty)
        d_aligned, n_body, n_head, tail_start, n_edge = row_layout(dst_off, vocab_size, BLOCK_V, VEC)
        if VEC > 1:
            for t in range(0, n_body):
                tl.store(dlogits_ptr + d_aligned + t * BLOCK_V + cols, zeros)
        for e0 in range(0, n_edge, BLOCK_V):
            idx, inside = edge_columns(e0, cols, n_head, tail_start, n_edge)
            tl.store(dlogits_ptr + dst_off + column_offsets(idx, dstride_v, VEC), zeros, mask=inside)


@functools.lru_cache(maxsize=256)
def _tiles(vocab_size: int, element_size: int, vec: int) -> Tuple[int, int]:
    """``(BLOCK_V, EDGE_V)`` of a launch: pure functions of the row length, the element size and the vector
    width, computed once per combination (a call would otherwise recompute them for every launch)."""
    block_v = logits_block_v(vocab_size, element_size)
    return block_v, logits_edge_v(block_v, vec)


def vector_width(t: Tensor, stride_v: int) -> int:
    """Elements per 16 bytes when ``t``'s rows are contiguous (``stride_v == 1``), else 1 (no aligned body)."""
    return max(1, 16 // t.element_size()) if stride_v == 1 else 1


def same_alignment(a: Tensor, b: Tensor, strides_a, strides_b, vec: int) -> bool:
    """Whether row ``r`` of ``a`` and of ``b`` always start at the same offset modulo 16 bytes (so one aligned
    body serves the read and the write): data pointers congruent, row strides congruent modulo ``vec``."""
    if (a.data_ptr() - b.data_ptr()) % 16 != 0 or a.element_size() != b.element_size():
        return False
    return all((sa - sb) % vec == 0 for sa, sb in zip(strides_a, strides_b))


def logsumexp_from_row_stats(row_stats: Tensor, temperature: float = 1.0) -> Tensor:
    """``logsumexp(logits / T)`` per row from the forward's ``row_stats [2, N]`` (``row_max / T + log S``)."""
    return row_stats[0] / temperature + row_stats[1]


def logprobs_forward(
    logits: Tensor,
    labels: Tensor,
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = True,
    out: Optional[Tuple[Tensor, Optional[Tensor], Tensor]] = None,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """Launch the forward kernel.

    Args:
        logits: ``[N, V]`` or ``[B, T, V]``, fp16/bf16/fp32/fp64, any strides (read in place).
        labels: ``[N]`` int64; a label outside ``[0, V)`` is not read and gives a NaN log-prob.
        active: ``[N]`` bool or None; rows with False are not read and get 0 outputs.
        temperature: logits are divided by it (> 0).
        return_entropy: also compute the entropy.
        out: optional preallocated ``(logp [N], entropy [N] or None, row_stats [2, N])`` buffers.
        softcap: None, or ``c > 0``: the logits are capped first, ``z -> c tanh(z / c)`` (then divided by the
            temperature); ``row_stats[0]`` is then the row's max *capped* logit.

    Returns:
        ``(logp [N], entropy [N] or None, row_stats [2, N])``, fp32 (fp64 for fp64 logits, computed in fp64;
        the temperature is an fp32 scalar either way). ``row_stats[0]`` is the row's max raw logit and
        ``row_stats[1]`` is ``log S = log sum exp((z - row_max) / T)``: the backward's
        ``log p = (z - row_max) / T - log S``.
    """
    vocab_size = logits.shape[-1]
    n_rows = labels.numel()
    if logits.numel() // max(vocab_size, 1) != n_rows and logits.numel() != 0:
        raise ValueError(f"logits {tuple(logits.shape)} do not hold one row per label ({n_rows} labels)")
    if out is None:
        acc = compute_dtype(logits.dtype)
        logp = torch.empty(n_rows, device=logits.device, dtype=acc)
        entropy = torch.empty_like(logp) if return_entropy else None
        row_stats = torch.empty((2, n_rows), device=logits.device, dtype=acc)
    else:
        logp, entropy, row_stats = out
    if n_rows == 0:
        return logp, entropy, row_stats
    if labels.dim() != 1:
        labels = labels.reshape(-1)
    if labels.dtype != torch.int64:
        labels = labels.to(torch.int64)
    rows_per_batch, stride_b, stride_t, stride_v = row_strides(logits, "logits")
    vec = vector_width(logits, stride_v)
    block_v, edge_v = _tiles(vocab_size, logits.element_size(), vec)
    with device_guard(logits):
        logprobs_fwd_kernel[(n_rows,)](
            logits,
            labels,
            active if active is not None else labels,
            logp,
            entropy if return_entropy else logp,
            row_stats,
            n_rows,
            rows_per_batch,
            stride_b,
            stride_t,
            stride_v,
            vocab_size,
            1.0 / float(temperature),
            1.0 if softcap is None else float(softcap),
            BLOCK_V=block_v,
            EDGE_V=edge_v,
            VEC=vec,
            HAS_ACTIVE=active is not None,
            HAS_ENTROPY=return_entropy,
            HAS_SOFTCAP=softcap is not None,
            FAST_MATH=not interpreter_active(),
            num_warps=LOGITS_NUM_WARPS,
            num_stages=LOGITS_NUM_STAGES,
        )
    return logp, entropy, row_stats


def gradient_rows(logits: Tensor, inplace: bool, extra_position: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """``(rows, destination)`` of a logits backward: the saved logits' rows (``[:, :-1]`` of a model's
    ``[B, T+1, V]`` output) and where the gradient goes: the logits' own storage (in place), a new tensor of the
    full output's shape (its last position's gradient is zero), or None (a new tensor of the rows' shape)."""
    full = logits.detach()
    rows = full[:, :-1] if extra_position else full
    if inplace:
        return rows, full
    if extra_position:
        return rows, torch.empty(full.shape, device=full.device, dtype=full.dtype)
    return rows, None


def logprobs_backward(
    logits: Tensor,
    labels: Tensor,
    row_stats: Tensor,
    entropy: Optional[Tensor],
    grad_logp: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    inplace: bool = False,
    out: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    grad_scale: Optional[Tuple[Tensor, Tensor, Tensor]] = None,
    vocab_window: Optional[Tuple[int, int]] = None,
) -> Tensor:
    """Launch the backward kernel.

    Args:
        logits: the forward's logits, ``[N, V]`` or ``[B, T, V]``, any strides.
        labels: ``[N]`` int64; ``row_stats [2, N]``, ``entropy [N]``: from :func:`logprobs_forward` (their
            dtype, fp32 or fp64, is the compute dtype).
        grad_logp, grad_entropy: ``[N]`` incoming gradients (any float dtype) or None (= zero).
        active: ``[N]`` bool or None: rows with False get a zero gradient.
        inplace: write the gradient into ``out`` when given (a tensor whose storage holds ``logits``, e.g. the
            ``[B, T + 1, V]`` base of a ``[:, :-1]`` view), else into ``logits`` itself; the caller's logits are
            consumed.
        softcap: the forward's ``softcap`` (the gradient is multiplied by the cap's slope ``1 - tanh^2``).
        grad_scale: None, or ``(s, a, b)``, 0-dim fp32 tensors: the incoming gradients are then
            ``grad_logp * (s * a)`` and ``grad_entropy * (s * b)``, formed in fp32 inside the kernel (the products
            the sequence stage's backward would otherwise launch as elementwise ops; the same bits).
        out: the gradient buffer (any strides): shaped like ``logits``, or ``[B, T + 1, V]`` for 3-D
            ``[B, T, V]`` logits, in which case position ``T`` of every sequence gets zeros. Default: a new
            tensor shaped like ``logits`` (or ``logits`` itself when ``inplace``).
        vocab_window: ``(offset, total)``: ``logits`` holds the columns ``[offset, offset + V)`` of a vocabulary
            of ``total`` (``row_stats`` and ``entropy`` are the whole rows'): labels are global ids, a label
            outside the window has no column here, one outside ``[0, total)`` poisons its row (None: ``(0, V)``).

    Returns:
        ``dlogits`` (``out``) in the logits' dtype.
    """
    if grad_entropy is not None and entropy is None:
        raise ValueError("grad_entropy needs the forward's entropy")
    if out is None:
        out = logits if inplace else torch.empty(logits.shape, device=logits.device, dtype=logits.dtype)
    n_rows = labels.numel()
    if out.numel() == 0:
        return out
    vocab_size = logits.shape[-1]
    rows_per_batch, stride_b, stride_t, stride_v = row_strides(logits, "logits")
    out_rows_per_batch, dstride_b, dstride_t, dstride_v = row_strides(out, "out")
    extra_position = logits.dim() == 3 and tuple(out.shape) == (logits.shape[0], logits.shape[1] + 1, vocab_size)
    if tuple(out.shape) != tuple(logits.shape) and not extra_position:
        raise ValueError(f"out must be shaped like logits {tuple(logits.shape)} (or [B, T + 1, V]), "
                         f"got {tuple(out.shape)}")
    if not extra_position:
        out_rows_per_batch = rows_per_batch
    n_out_rows = out.numel() // vocab_size
    if n_rows == 0:  # every out row is an extra position, or there is none
        out.zero_()
        return out
    vec = vector_width(logits, stride_v) if dstride_v == 1 else 1  # the aligned body reads and writes rows
    with device_guard(out):
        logprobs_bwd_kernel[(n_out_rows,)](
            logits,
            out,
            labels,
            active if active is not None else labels,
            grad_logp if grad_logp is not None else row_stats,
            grad_entropy if grad_entropy is not None else row_stats,
            entropy if entropy is not None else row_stats,
            row_stats,
            *(grad_scale if grad_scale is not None else (row_stats, row_stats, row_stats)),
            n_rows,
            rows_per_batch,
            out_rows_per_batch,
            stride_b,
            stride_t,
            stride_v,
            dstride_b,
            dstride_t,
            dstride_v,
            vocab_size,
            0 if vocab_window is None else int(vocab_window[0]),
            vocab_size if vocab_window is None else int(vocab_window[1]),
            1.0 / float(temperature),
            1.0 if softcap is None else float(softcap),
            BLOCK_V=_tiles(vocab_size, logits.element_size(), vec)[0],
            VEC=vec,
            DST_ALIGNED=vec > 1 and vector_width(out, dstride_v) == vec and same_alignment(
                logits, out, (stride_b, stride_t), (dstride_b, dstride_t), vec),
            HAS_ACTIVE=active is not None,
            HAS_GRAD_LOGP=grad_logp is not None,
            HAS_GRAD_ENTROPY=grad_entropy is not None,
            HAS_GRAD_SCALE=grad_scale is not None,
            HAS_SOFTCAP=softcap is not None,
            FAST_MATH=not interpreter_active(),
            num_warps=LOGITS_NUM_WARPS,
            num_stages=LOGITS_NUM_STAGES,
        )
    return out


class TritonLogitsLogprobs(torch.autograd.Function):
    """``(logits [N, V] | [B, T, V], labels [N]) -> (logp [N], entropy [N])``, fp32 (fp64 for fp64 logits).

    With ``extra_position=True`` the first input is the ``[B, T + 1, V]`` base of ``logits[:, :-1]`` (see
    :func:`next_token_base`): the kernels read its first ``T`` positions and the gradient covers all ``T + 1``.
    """

    @staticmethod
    def forward(ctx, logits, labels, active, options: CallOptions, extra_position=False):
        # the call's options (checked as they were built), kept whole for the backward: temperature,
        # return_entropy, inplace_backward and softcap read
        ctx.options = options
        # Grad mode is off inside forward: the views below record nothing (no detach needed). The usual inputs
        # (flat int64 labels, flat bool mask) pass through without an op.
        if labels.dim() != 1:
            labels = labels.reshape(-1)
        if labels.dtype != torch.int64:
            labels = labels.to(torch.int64)
        if active is not None and not (active.dtype == torch.bool and active.dim() == 1 and active.is_contiguous()):
            active = active.reshape(-1).to(torch.bool).contiguous()
        rows = logits[:, :-1] if extra_position else logits
        logp, entropy, row_stats = logprobs_forward(
            rows, labels, active=active, temperature=options.temperature, return_entropy=options.return_entropy,
            softcap=options.softcap
        )
        if entropy is None:
            entropy = torch.zeros_like(logp)
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, labels, row_stats, entropy, active if active is not None else torch.empty(0))
        ctx.has_active = active is not None
        ctx.extra_position = extra_position
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, row_stats, entropy, active = ctx.saved_tensors
        options = ctx.options
        if not options.return_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None
        rows, out = gradient_rows(logits, options.inplace_backward, ctx.extra_position)
        dlogits = logprobs_backward(
            rows,
            labels,
            row_stats,
            entropy if grad_entropy is not None else None,
            None if grad_logp is None else grad_logp.to(row_stats.dtype).contiguous(),
            None if grad_entropy is None else grad_entropy.to(row_stats.dtype).contiguous(),
            active=active if ctx.has_active else None,
            temperature=options.temperature,
            out=out,
            softcap=options.softcap,
        )
        return dlogits, None, None, None, None


def logits_logprobs(logits: Tensor, labels: Tensor, active: Optional[Tensor] = None,
                    options: CallOptions = DEFAULT_OPTIONS) -> Tuple[Tensor, Optional[Tensor]]:
    """The backend contract's ``logits_logprobs`` (:class:`gspo_kernels.backends.contract.LogitsLogprobs`).

    Args:
        logits: ``[N, V]`` or ``[B, T, V]`` fp16/bf16/fp32/fp64, any strides. A ``model_output[:, :-1]`` view
            is recognised (:func:`next_token_base`): its gradient goes straight to ``model_output``, with zeros
            at the last position, and no second logits-sized buffer is allocated (none at all with
            ``options.inplace_backward``).
        labels: ``[N]`` int64 in ``[0, V)`` (out of range: never read, NaN log-prob); active: ``[N]`` bool or
            None (False rows are not read, output 0).
        options: the call's :class:`~gspo_kernels.options.CallOptions`; read: ``temperature``,
            ``return_entropy``, ``inplace_backward`` and ``softcap``: None (no cap) or ``c > 0``:
            ``z -> c tanh(z / c)`` before the division by the temperature (Gemma's final-logit soft cap).
    Returns:
        ``(logp [N], entropy [N] or None)`` in fp32 (fp64 for fp64 logits, like the torch backend),
        differentiable with respect to ``logits``.
    """
    base = next_token_base(logits) if torch.is_grad_enabled() else None
    logp, entropy = TritonLogitsLogprobs.apply(logits if base is None else base, labels, active, options,
                                               base is not None)
    return logp, (entropy if options.return_entropy else None)
