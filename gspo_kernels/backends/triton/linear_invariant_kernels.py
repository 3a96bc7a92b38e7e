"""The ``@triton.jit`` kernels of the batch-invariant hidden-state path: the forward (:func:`logits_tile`,
:func:`linear_logprobs_fwd_kernel`, :func:`linear_logprobs_combine_kernel`) and the backward's three
(:func:`linear_dz_kernel`, :func:`linear_dh_kernel`, :func:`linear_dw_kernel`). What they compute, and why a row's
bits do not depend on the other rows, is in ``linear_invariant.py``'s docstring, with their launchers, the autograd
Function and the public :func:`~gspo_kernels.backends.triton.linear_invariant.linear_logprobs`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gspo_kernels.backends.triton.kernel_math import soft_cap
from gspo_kernels.backends.triton.launch import grouped_tile, row_offsets

# A finite "minus infinity" for the running max: exp(_NEG_BIG - m) is 0 and (_NEG_BIG - m) * 0 is 0 (no NaN
# when a whole tile or split is -inf, e.g. a -inf bias over a vocabulary range).
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def logits_tile(
    hidden_ptr, weight_ptr, bias_ptr, h_row_off, offs_v, v_ok, V, H,
    stride_hh, stride_wv, stride_wh, stride_bv, inv_temperature, softcap,
    HAS_BIAS: tl.constexpr, EVEN_H: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, FAST_MATH: tl.constexpr,
):
    """``z [BLOCK_N, BLOCK_V]`` fp32 = ``(hidden[rows] @ weight[offs_v].T + bias[offs_v]) * inv_temperature``,
    or with ``HAS_SOFTCAP`` ``softcap * tanh((h . W[v] + b[v]) / softcap) * inv_temperature``.

    ``h_row_off`` [BLOCK_N] int64: element offsets of the rows in ``hidden`` (every one a valid row).
    Columns ``>= V`` hold finite junk values that the caller must mask. The reduction over ``H`` runs in
    ``BLOCK_H`` steps from 0 upwards for every row: a row's value does not depend on the other rows.
    """
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    # Out-of-range rows already point at a valid row and out-of-range columns are clamped to V - 1, so
    # only a ragged H needs a load mask (EVEN_H drops it: fewer registers on the tensor-core path).
    w_col_off = tl.minimum(offs_v, V - 1).to(tl.int64) * stride_wv
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        a_ptrs = hidden_ptr + h_row_off[:, None] + offs_h[None, :] * stride_hh
        b_ptrs = weight_ptr + w_col_off[None, :] + offs_h[:, None] * stride_wh
        if EVEN_H:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(offs_h < H)[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=(offs_h < H)[:, None], other=0.0)
        if UPCAST:  # the interpreter's bf16 tl.dot is wrong (docs/kernels.md): multiply in fp32 there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_v.to(tl.int64) * stride_bv, mask=v_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        acc, _ = soft_cap(acc, 1.0 / softcap, softcap, FAST_MATH, False)
    return acc * inv_temperature


@triton.jit
def as_operand(x, like_ptr, UPCAST: tl.constexpr):
    """``x`` in the element type of ``like_ptr`` (the other ``tl.dot`` operand), or fp32 when upcasting."""
    if UPCAST:
        return x.to(tl.float32)
    else:
        return x.to(like_ptr.dtype.element_ty)


# Row and split counts vary per batch: never specialize on them (no recompile for N == 1 or N % 16 == 0).
@triton.jit(do_not_specialize=["M", "T", "cols_per_split", "num_splits"])
def linear_logprobs_fwd_kernel(
    hidden_ptr,  # [B, T, H] or [N, H], any strides, fp16/bf16/fp32
    weight_ptr,  # [V, H], same dtype
    bias_ptr,  # [V] (any stride, any float dtype) or dummy
    order_ptr,  # [M] int64: the computed rows, compacted (read only when HAS_ORDER)
    count_ptr,  # [1] int64: how many entries of order are valid (read only when HAS_ORDER)
    labels_ptr,  # [N] int64 (any values: compared, never used as an address)
    part_max_ptr, part_sum_ptr, part_ent_ptr,  # [splits, M] fp32 each, indexed by position in order
    label_logit_ptr,  # [M] fp32 (written by the split that holds the label)
    M, V, H, T,
    stride_hb, stride_ht, stride_hh, stride_wv, stride_wh, stride_bv,
    inv_temperature, cols_per_split, num_splits, softcap,
    HAS_BIAS: tl.constexpr, HAS_ORDER: tl.constexpr, EVEN_H: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, GROUP_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, FAST_MATH: tl.constexpr,
):
    row_tile, split = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_N), num_splits, GROUP_N)
    if HAS_ORDER:
        count = tl.load(count_ptr).to(tl.int32)
    else:
        count = M
    if row_tile * BLOCK_N < count:  # tiles past the active rows do nothing
        offs_n = row_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_n < count
        if HAS_ORDER:
            rows = tl.load(order_ptr + offs_n, mask=row_ok, other=0)
        else:
            rows = tl.where(row_ok, offs_n, 0).to(tl.int64)
        h_row_off = row_offsets(rows, T, stride_hb, stride_ht)
        label = tl.load(labels_ptr + rows, mask=row_ok, other=-1)

        v_begin = split * cols_per_split
        v_end = tl.minimum(v_begin + cols_per_split, V)
        row_max = tl.full((BLOCK_N,), _NEG_BIG, dtype=tl.float32)  # of this split's scaled logits
        s_i = tl.zeros((BLOCK_N,), dtype=tl.float32)
        t_i = tl.zeros((BLOCK_N,), dtype=tl.float32)
        lab = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for v0 in range(v_begin, v_end, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            v_ok = offs_v < v_end
            z = logits_tile(
                hidden_ptr, weight_ptr, bias_ptr, h_row_off, offs_v, v_ok, V, H,
                stride_hh, stride_wv, stride_wh, stride_bv, inv_temperature, softcap,
                HAS_BIAS, EVEN_H, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H, HAS_SOFTCAP, FAST_MATH,
            )
            lab += tl.sum(tl.where(offs_v[None, :] == label[:, None], z, 0.0), axis=1)
            z = tl.where(v_ok[None, :], z, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(z, axis=1))
            shift = row_max - new_max
            alpha = tl.exp(shift)
            zs = z - new_max[:, None]
            e = tl.exp(zs)
            # e == 0 where z = -inf (padding, a -inf bias entry): its p log p term is 0, not 0 * -inf = NaN.
            t_i = alpha * (t_i + shift * s_i) + tl.sum(tl.where(e > 0, e * zs, 0.0), axis=1)
            s_i = alpha * s_i + tl.sum(e, axis=1)
            row_max = new_max

        out = split * M + offs_n
        tl.store(part_max_ptr + out, row_max, mask=row_ok)
        tl.store(part_sum_ptr + out, s_i, mask=row_ok)
        tl.store(part_ent_ptr + out, t_i, mask=row_ok)
        tl.store(label_logit_ptr + offs_n, lab, mask=row_ok & (label >= v_begin) & (label < v_end))


@triton.jit(do_not_specialize=["M", "num_splits"])
def linear_logprobs_combine_kernel(
    order_ptr, count_ptr, labels_ptr, part_max_ptr, part_sum_ptr, part_ent_ptr, label_logit_ptr,
    logp_ptr,  # [N] fp32 outputs, indexed by row
    entropy_ptr,
    row_max_ptr,  # [N] fp32: the row's largest scaled logit
    log_sum_ptr,  # [N] fp32: log sum exp(z - row_max)
    M, V, num_splits,
    HAS_ORDER: tl.constexpr, BLOCK: tl.constexpr,
):
    """Combines the splits of each row in split order (0, 1, ...): the same bits for any batch."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if HAS_ORDER:
        count = tl.load(count_ptr).to(tl.int32)
    else:
        count = M
    ok = offs < count
    if HAS_ORDER:
        rows = tl.load(order_ptr + offs, mask=ok, other=0)
    else:
        rows = offs.to(tl.int64)
    row_max = tl.full((BLOCK,), _NEG_BIG, dtype=tl.float32)
    for s in range(0, num_splits):
        row_max = tl.maximum(row_max, tl.load(part_max_ptr + s * M + offs, mask=ok, other=_NEG_BIG))
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    t = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, num_splits):
        pm = tl.load(part_max_ptr + s * M + offs, mask=ok, other=_NEG_BIG)
        ps = tl.load(part_sum_ptr + s * M + offs, mask=ok, other=0.0)
        pt = tl.load(part_ent_ptr + s * M + offs, mask=ok, other=0.0)
        scale = tl.exp(pm - row_max)
        total += scale * ps
        t += scale * (pt + (pm - row_max) * ps)
    total = tl.where(ok, total, 1.0)  # lanes past the rows: no log(0) on junk
    log_sum = tl.log(total)
    label = tl.load(labels_ptr + rows, mask=ok, other=0)
    label_ok = (label >= 0) & (label < V)
    logp = (tl.load(label_logit_ptr + offs, mask=ok, other=0.0) - row_max) - log_sum
    logp = tl.where(label_ok, logp, float("nan"))  # an out-of-range label gives NaN, never an address
    tl.store(logp_ptr + rows, logp, mask=ok)
    tl.store(entropy_ptr + rows, log_sum - t / total, mask=ok)
    tl.store(row_max_ptr + rows, row_max, mask=ok)
    tl.store(log_sum_ptr + rows, log_sum, mask=ok)


@triton.jit(do_not_specialize=["chunk_start", "C", "T"])
def linear_dz_kernel(
    hidden_ptr, weight_ptr, bias_ptr,
    order_ptr,  # [N] int64: compacted rows with a gradient; count_ptr: [1] int64
    count_ptr,
    labels_ptr, row_max_ptr, log_sum_ptr, ent_ptr, g_logp_ptr, g_ent_ptr,  # [N], indexed by row
    dz_ptr,  # [C, V] operand dtype (row stride V): q of the chunk's rows
    db_part_ptr,  # [ceil(C / BLOCK_N), V] fp32: column sums of q per row tile (COMPUTE_DB)
    chunk_start, C, V, H, T,
    stride_hb, stride_ht, stride_hh, stride_wv, stride_wh, stride_bv, inv_temperature, softcap,
    HAS_BIAS: tl.constexpr, HAS_LOGP_GRAD: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
    COMPUTE_DB: tl.constexpr, EVEN_H: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, GROUP: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, FAST_MATH: tl.constexpr,
):
    row_tile, vocab_tile = grouped_tile(tl.program_id(0), tl.cdiv(C, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP)
    n_here = tl.minimum(tl.load(count_ptr).to(tl.int32) - chunk_start, C)
    if row_tile * BLOCK_N < n_here:
        offs_n = row_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_n < n_here
        rows = tl.load(order_ptr + chunk_start + offs_n, mask=row_ok, other=0)
        offs_v = vocab_tile * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = offs_v < V
        z = logits_tile(
            hidden_ptr, weight_ptr, bias_ptr, row_offsets(rows, T, stride_hb, stride_ht), offs_v, v_ok, V, H,
            stride_hh, stride_wv, stride_wh, stride_bv, inv_temperature, softcap,
            HAS_BIAS, EVEN_H, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H, HAS_SOFTCAP, FAST_MATH,
        )
        row_max = tl.load(row_max_ptr + rows, mask=row_ok, other=0.0)
        log_sum = tl.load(log_sum_ptr + rows, mask=row_ok, other=0.0)
        label = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
        softcap_t = 1.0 / inv_temperature  # the temperature (z = capped logit / T)
        valid = row_ok[:, None] & v_ok[None, :]
        logp = (z - row_max[:, None]) - log_sum[:, None]
        p = tl.where(valid, tl.exp(logp), 0.0)
        q = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        if HAS_LOGP_GRAD:
            g_logp = tl.load(g_logp_ptr + rows, mask=row_ok, other=0.0)
            q = g_logp[:, None] * (tl.where(offs_v[None, :] == label[:, None], 1.0, 0.0) - p)
        if HAS_ENTROPY_GRAD:
            g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
            ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
            # p == 0 where z = -inf (a -inf bias entry): its term is 0, not 0 * -inf = NaN
            q -= g_ent[:, None] * tl.where(p > 0, p * (logp + ent[:, None]), 0.0)
        if HAS_SOFTCAP:
            # The gradient with respect to the uncapped logit: times the cap's slope 1 - tanh^2, tanh recovered
            # from log p (z = log p + row_max + log_sum, z T / c = tanh): no second [BLOCK_N, BLOCK_V] tile
            # held across the kernel (registers), ~1e-7 absolute error on the slope.
            th = (logp + (row_max + log_sum)[:, None]) * (softcap_t / softcap)
            q = q * ((1.0 - th) * (1.0 + th))
        label_ok = (label >= 0) & (label < V)  # an out-of-range label: NaN gradient, like its NaN log-prob
        q = tl.where(valid, tl.where(label_ok[:, None], q, float("nan")), 0.0)
        dz_off = offs_n.to(tl.int64)[:, None] * V + offs_v[None, :]
        tl.store(dz_ptr + dz_off, q.to(dz_ptr.dtype.element_ty), mask=valid)
        if COMPUTE_DB:
            tl.store(db_part_ptr + row_tile.to(tl.int64) * V + offs_v, tl.sum(q, axis=0), mask=v_ok)


@triton.jit(do_not_specialize=["chunk_start", "C"])
def linear_dh_kernel(
    dz_ptr,  # [C, V] operand dtype
    weight_ptr,  # [V, H]
    order_ptr, count_ptr,
    dh_ptr,  # [N, H] contiguous, hidden dtype: rows order[chunk_start:...] are written
    chunk_start, C, V, H,
    stride_wv, stride_wh, inv_temperature,
    UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr,
    GROUP: tl.constexpr,
):
    row_tile, h_tile = grouped_tile(tl.program_id(0), tl.cdiv(C, BLOCK_N), tl.cdiv(H, BLOCK_H), GROUP)
    n_here = tl.minimum(tl.load(count_ptr).to(tl.int32) - chunk_start, C)
    if row_tile * BLOCK_N < n_here:
        offs_n = row_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_n < n_here
        offs_h = h_tile * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        dz_rows = dz_ptr + offs_n.to(tl.int64)[:, None] * V
        w_cols = weight_ptr + offs_h[None, :] * stride_wh
        acc = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
        for v0 in range(0, V, BLOCK_V):  # the same steps for every row: batch-invariant
            offs_v = v0 + tl.arange(0, BLOCK_V)
            v_ok = offs_v < V
            a = tl.load(dz_rows + offs_v[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0)
            b = tl.load(w_cols + offs_v.to(tl.int64)[:, None] * stride_wv, mask=v_ok[:, None] & h_ok[None, :], other=0.0)
            acc = tl.dot(as_operand(a, weight_ptr, UPCAST), as_operand(b, weight_ptr, UPCAST), acc, input_precision="ieee")
        rows = tl.load(order_ptr + chunk_start + offs_n, mask=row_ok, other=0)
        out = dh_ptr + rows.to(tl.int64)[:, None] * H + offs_h[None, :]
        tl.store(out, (acc * inv_temperature).to(dh_ptr.dtype.element_ty), mask=row_ok[:, None] & h_ok[None, :])


@triton.jit(do_not_specialize=["chunk_start", "C", "T"])
def linear_dw_kernel(
    dz_ptr,  # [C, V] operand dtype
    hidden_ptr,  # [B, T, H] or [N, H], any strides
    order_ptr, count_ptr,
    db_part_ptr,  # [ceil(C / DZ_BLOCK_N), V] fp32
    dw_ptr,  # [V, H] fp32 accumulator (contiguous)
    db_ptr,  # [V] fp32 accumulator
    chunk_start, C, V, H, T,
    stride_hb, stride_ht, stride_hh, inv_temperature,
    COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DZ_BLOCK_N: tl.constexpr,
):
    vocab_tile, h_tile = grouped_tile(tl.program_id(0), tl.cdiv(V, BLOCK_V), tl.cdiv(H, BLOCK_H), GROUP)
    n_here = tl.minimum(tl.load(count_ptr).to(tl.int32) - chunk_start, C)
    if n_here > 0:
        offs_v = vocab_tile * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = offs_v < V
        if COMPUTE_DW:
            offs_h = h_tile * BLOCK_H + tl.arange(0, BLOCK_H)
            h_ok = offs_h < H
            acc = tl.zeros((BLOCK_V, BLOCK_H), dtype=tl.float32)
            for k0 in range(0, n_here, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < n_here
                a = tl.load(dz_ptr + offs_k.to(tl.int64)[:, None] * V + offs_v[None, :],
                            mask=k_ok[:, None] & v_ok[None, :], other=0.0)
                rows = tl.load(order_ptr + chunk_start + offs_k, mask=k_ok, other=0)
                h_off = row_offsets(rows, T, stride_hb, stride_ht)
                b = tl.load(hidden_ptr + h_off[:, None] + offs_h[None, :] * stride_hh,
                            mask=k_ok[:, None] & h_ok[None, :], other=0.0)
                acc = tl.dot(tl.trans(as_operand(a, hidden_ptr, UPCAST)), as_operand(b, hidden_ptr, UPCAST), acc,
                             input_precision="ieee")
            ptrs = dw_ptr + offs_v.to(tl.int64)[:, None] * H + offs_h[None, :]
            io_mask = v_ok[:, None] & h_ok[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=io_mask, other=0.0) + acc * inv_temperature, mask=io_mask)
        if COMPUTE_DB:
            if h_tile == 0:
                db = tl.zeros((BLOCK_V,), dtype=tl.float32)
                for t in range(0, tl.cdiv(n_here, DZ_BLOCK_N)):  # row-tile order: deterministic
                    db += tl.load(db_part_ptr + t * V + offs_v, mask=v_ok, other=0.0)
                old = tl.load(db_ptr + offs_v, mask=v_ok, other=0.0)
                tl.store(db_ptr + offs_v, old + db * inv_temperature, mask=v_ok)
