"""Backward of the hidden-state path: ``dH``, ``dW`` and ``dbias`` without the ``[N, V]`` logits and without atomics.

Only the rows whose incoming gradient is non-zero are visited: the autograd Function compacts them on the
device (``order[:count]``, see ``linear_forward.compact_rows``; ``count`` stays on the device, so nothing
synchronises with the host). The rows are processed in fixed-size **chunks** of ``C`` compacted rows
(``C`` from the memory budget); each chunk runs three kernels:

1. ``linear_dz_kernel`` (grid: row tiles x vocabulary tiles of the chunk, grouped order): recomputes the
   logits tile ``z = (h W^T + b) / tau`` with ``tl.dot`` (fp32 accumulation) and forms

       q[r, v] = g_logp[r] * (1[v = y_r] - p[r, v]) - g_ent[r] * p[r, v] * (log p[r, v] + entropy[r]),
       log p = (z - m) - log_sum,

   the gradient with respect to ``z`` (the raw logits' gradient is ``q / tau``; ``1 / tau`` is applied in
   fp32 by the next kernels, so a tiny temperature cannot overflow a half-precision ``q``). ``q`` is written
   to the chunk buffer ``dZ [C, V]`` in the operand dtype, and, with a bias, the fp32 column sums of each
   row tile to ``dB_part [C / BLOCK_N, V]``.
2. ``linear_dh_kernel`` (grid: row tiles x ``H`` tiles): ``dH[rows] = (dZ @ W) / tau``, fp32 accumulation,
   the reduction over ``V`` in ``BLOCK_V`` steps from 0 upwards for every row; stored in the hidden dtype.
3. ``linear_dw_kernel`` (grid: vocabulary tiles x ``H`` tiles): ``dW += (dZ^T @ H[rows]) / tau`` into an fp32
   ``[V, H]`` accumulator that each program owns for its tile (plain load, add, store: no atomics), and
   ``dbias += sum of the chunk's dB_part rows / tau`` in row-tile order.

Determinism and batch invariance. Nothing is summed by atomics; every reduction has a fixed order, so two
runs give the same bits. A row's ``q`` and ``dH`` row depend only on that row and on the launch
configuration (a function of the dtype alone): the ``tl.dot`` products are per output element and the
reduction over ``V`` (for ``dH``) and over ``H`` (for ``z``) runs in the same steps whatever the chunk size,
the row's position or its neighbours. So a row's ``dH`` is the same bits alone or among other rows and for
any memory budget. ``dW`` and ``dbias`` are sums over rows: deterministic (chunk order, then row order).

Cost: ``6 C H V`` flops per chunk (``2 CHV`` each for ``z``, ``dH``, ``dW``) plus ``3 C V`` operand-dtype
elements of chunk-buffer traffic (one write, two reads; ~5% of the flop time at H = 4096 on an H100).
Chunks past ``count`` launch and exit at once (no host synchronisation means the host does not know
``count``).

Memory: the chunk buffers, ``C * V * (operand bytes) + ceil(C / BLOCK_N) * V * 4`` bytes, at most the
``memory_budget`` (default ``DEFAULT_MEMORY_BUDGET``, 1 GiB) but never less than one row tile; the fp32
``dW [V, H]`` and ``dbias [V]`` accumulators (not part of the budget; cast to the parameters' dtypes by
the caller); ``dH`` in the hidden dtype.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from gspo_kernels.backends.triton import device_guard
from gspo_kernels.backends.triton.addressing import grouped_tile, interpreter_active, row_offsets, row_strides
from gspo_kernels.backends.triton.linear_forward import logits_tile, upcast_dots

DEFAULT_MEMORY_BUDGET = 1 << 30

# Tuned against the static sm_90a report (0 spills, HGMMA in the SASS). Keys: dz (the logits-gradient
# epilogue), dh and dw (the two GEMMs). fp32 operands are multiplied exactly (no tensor cores).
CUDA_BWD_CONFIG: Dict[str, Dict[str, int]] = {
    "dz": {"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_H": 64, "GROUP": 8, "num_warps": 8, "num_stages": 3},
    "dh": {"BLOCK_N": 128, "BLOCK_H": 128, "BLOCK_V": 64, "GROUP": 8, "num_warps": 8, "num_stages": 4},
    "dw": {"BLOCK_V": 128, "BLOCK_H": 128, "BLOCK_K": 64, "GROUP": 8, "num_warps": 8, "num_stages": 4},
}
CUDA_BWD_CONFIG_FP32: Dict[str, Dict[str, int]] = {
    "dz": {"BLOCK_N": 64, "BLOCK_V": 64, "BLOCK_H": 32, "GROUP": 8, "num_warps": 4, "num_stages": 2},
    "dh": {"BLOCK_N": 64, "BLOCK_H": 64, "BLOCK_V": 32, "GROUP": 8, "num_warps": 4, "num_stages": 2},
    "dw": {"BLOCK_V": 64, "BLOCK_H": 64, "BLOCK_K": 32, "GROUP": 8, "num_warps": 4, "num_stages": 2},
}
INTERPRETER_BWD_CONFIG: Dict[str, Dict[str, int]] = {
    "dz": {"BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_H": 16, "GROUP": 2, "num_warps": 4, "num_stages": 1},
    "dh": {"BLOCK_N": 16, "BLOCK_H": 16, "BLOCK_V": 32, "GROUP": 2, "num_warps": 4, "num_stages": 1},
    "dw": {"BLOCK_V": 32, "BLOCK_H": 16, "BLOCK_K": 16, "GROUP": 2, "num_warps": 4, "num_stages": 1},
}


@triton.jit
def as_operand(x, like_ptr, UPCAST: tl.constexpr):
    """``x`` in the element type of ``like_ptr`` (the other ``tl.dot`` operand), or fp32 when upcasting."""
    if UPCAST:
        return x.to(tl.float32)
    else:
        return x.to(like_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["chunk_start", "C", "T"])
def linear_dz_kernel(
    hidden_ptr, weight_ptr, bias_ptr,
    order_ptr,  # [N] int64: compacted rows with a gradient; count_ptr: [1] int64
    count_ptr,
    labels_ptr, max_ptr, log_sum_ptr, ent_ptr, g_logp_ptr, g_ent_ptr,  # [N], indexed by row
    dz_ptr,  # [C, V] operand dtype (row stride V): q of the chunk's rows
    db_part_ptr,  # [ceil(C / BLOCK_N), V] fp32: column sums of q per row tile (COMPUTE_DB)
    chunk_start, C, V, H, T,
    stride_hb, stride_ht, stride_hh, stride_wv, stride_wh, stride_bv, inv_temperature,
    HAS_BIAS: tl.constexpr, HAS_LOGP_GRAD: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
    COMPUTE_DB: tl.constexpr, EVEN_H: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, GROUP: tl.constexpr,
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
            stride_hh, stride_wv, stride_wh, stride_bv, inv_temperature,
            HAS_BIAS, EVEN_H, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H,
        )
        m = tl.load(max_ptr + rows, mask=row_ok, other=0.0)
        log_sum = tl.load(log_sum_ptr + rows, mask=row_ok, other=0.0)
        label = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
        valid = row_ok[:, None] & v_ok[None, :]
        logp = (z - m[:, None]) - log_sum[:, None]
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


def pick_config(dtype: torch.dtype, config: Optional[Dict[str, Dict[str, int]]] = None) -> Dict[str, Dict[str, int]]:
    """The three kernels' launch configurations: ``config`` if given, else the interpreter's or CUDA's for ``dtype``."""
    if config is not None:
        return {k: dict(v) for k, v in config.items()}
    if interpreter_active():
        base = INTERPRETER_BWD_CONFIG
    else:
        base = CUDA_BWD_CONFIG_FP32 if dtype == torch.float32 else CUDA_BWD_CONFIG
    return {k: dict(v) for k, v in base.items()}


def chunk_rows(n_rows: int, V: int, operand: torch.dtype, block_n: int, memory_budget: Optional[int]) -> int:
    """Rows per chunk: the most whole row tiles whose buffers fit ``memory_budget`` bytes (at least one tile).

    Per row: ``V`` operand-dtype elements of ``dZ`` plus ``4 V / block_n`` bytes of bias partial sums.
    """
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else int(memory_budget)
    per_tile = block_n * V * torch.empty((), dtype=operand).element_size() + 4 * V
    tiles = max(1, budget // max(per_tile, 1))
    return int(min(tiles, triton.cdiv(max(n_rows, 1), block_n)) * block_n)


def linear_logprobs_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    order: torch.Tensor,
    count: torch.Tensor,
    temperature: float = 1.0,
    *,
    compute_dh: bool = True,
    compute_dw: bool = True,
    compute_db: bool = True,
    memory_budget: Optional[int] = None,
    config: Optional[Dict[str, Dict[str, int]]] = None,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients of ``sum(grad_logp * logp + grad_entropy * entropy)`` over the rows ``order[:count]``.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` (any strides), fp16/bf16/fp32. weight: ``[V, H]``, same dtype.
        bias: ``[V]`` (any stride, any float dtype) or None, exactly as given to the forward.
        labels, row_max, log_sum, entropy: ``[N]`` (int64 / fp32), as given to / returned by the forward.
        grad_logp, grad_entropy: ``[N]`` fp32 or None (None: no gradient through that output).
        order, count: the device-side compaction of the rows to visit (``linear_forward.compact_rows``).
        memory_budget: bytes for the chunk buffers (default ``DEFAULT_MEMORY_BUDGET``; see the module).
        config: the three kernels' launch configurations (default: :func:`pick_config`).

    Returns:
        ``(dh [N, H] in the hidden dtype or None, dw [V, H] fp32 or None, db [V] fp32 or None)``; rows of
        ``dh`` outside ``order[:count]`` are exactly 0.
    """
    N = labels.shape[0]
    V, H = weight.shape
    device = hidden.device
    compute_db = compute_db and bias is not None
    dh = torch.zeros((N, H), device=device, dtype=hidden.dtype) if compute_dh else None
    dw = torch.zeros((V, H), device=device, dtype=torch.float32) if compute_dw else None
    db = torch.zeros(V, device=device, dtype=torch.float32) if compute_db else None
    has_logp, has_ent = grad_logp is not None, grad_entropy is not None
    if N == 0 or V == 0 or not (compute_dh or compute_dw or compute_db) or not (has_logp or has_ent):
        return dh, dw, db
    cfg = pick_config(hidden.dtype, config)
    c_dz, c_dh, c_dw = cfg["dz"], cfg["dh"], cfg["dw"]
    C = chunk_rows(N, V, hidden.dtype, c_dz["BLOCK_N"], memory_budget)
    dz = torch.empty((C, V), device=device, dtype=hidden.dtype)
    db_part = torch.empty((triton.cdiv(C, c_dz["BLOCK_N"]), V), device=device, dtype=torch.float32) if compute_db else dz
    T, stride_hb, stride_ht, stride_hh = row_strides(hidden, "hidden")
    upcast = upcast_dots(hidden, weight)
    inv_t = 1.0 / float(temperature)
    dummy = row_max
    with device_guard(hidden):
        for chunk_start in range(0, N, C):
            rows_here = min(C, N - chunk_start)  # an upper bound: the kernels read count themselves
            linear_dz_kernel[(triton.cdiv(rows_here, c_dz["BLOCK_N"]) * triton.cdiv(V, c_dz["BLOCK_V"]),)](
                hidden, weight, bias if bias is not None else weight, order, count,
                labels, row_max, log_sum, entropy,
                grad_logp if has_logp else dummy, grad_entropy if has_ent else dummy, dz, db_part,
                chunk_start, rows_here, V, H, T, stride_hb, stride_ht, stride_hh,
                weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0, inv_t,
                HAS_BIAS=bias is not None, HAS_LOGP_GRAD=has_logp, HAS_ENTROPY_GRAD=has_ent,
                COMPUTE_DB=compute_db, EVEN_H=H % c_dz["BLOCK_H"] == 0, UPCAST=upcast,
                BLOCK_N=c_dz["BLOCK_N"], BLOCK_V=c_dz["BLOCK_V"], BLOCK_H=c_dz["BLOCK_H"], GROUP=c_dz["GROUP"],
                num_warps=c_dz["num_warps"], num_stages=c_dz["num_stages"],
            )
            if compute_dh:
                linear_dh_kernel[(triton.cdiv(rows_here, c_dh["BLOCK_N"]) * triton.cdiv(H, c_dh["BLOCK_H"]),)](
                    dz, weight, order, count, dh, chunk_start, rows_here, V, H,
                    weight.stride(0), weight.stride(1), inv_t,
                    UPCAST=upcast, BLOCK_N=c_dh["BLOCK_N"], BLOCK_H=c_dh["BLOCK_H"], BLOCK_V=c_dh["BLOCK_V"],
                    GROUP=c_dh["GROUP"], num_warps=c_dh["num_warps"], num_stages=c_dh["num_stages"],
                )
            if compute_dw or compute_db:
                h_tiles = triton.cdiv(H, c_dw["BLOCK_H"]) if compute_dw else 1
                linear_dw_kernel[(triton.cdiv(V, c_dw["BLOCK_V"]) * h_tiles,)](
                    dz, hidden, order, count, db_part, dw if compute_dw else dummy, db if compute_db else dummy,
                    chunk_start, rows_here, V, H, T, stride_hb, stride_ht, stride_hh, inv_t,
                    COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db, UPCAST=upcast,
                    BLOCK_V=c_dw["BLOCK_V"], BLOCK_H=c_dw["BLOCK_H"], BLOCK_K=c_dw["BLOCK_K"], GROUP=c_dw["GROUP"],
                    DZ_BLOCK_N=c_dz["BLOCK_N"], num_warps=c_dw["num_warps"], num_stages=c_dw["num_stages"],
                )
    return dh, dw, db


def _h100_configs() -> list:
    """Launch configurations used on CUDA (read by ``h100_report``, which derives each signature from the
    kernel's parameter names: only the non-fp32 pointers, the fp32 scalars and the 16-divisible sizes are
    written here).

    bf16 operands (the production case) must use HGMMA; fp32 operands are multiplied exactly
    (``input_precision="ieee"``: FMA, no tensor cores, by design), so their rows only check spills.
    """
    out = []
    for dtype, cfgs in (("bf16", CUDA_BWD_CONFIG), ("fp32", CUDA_BWD_CONFIG_FP32)):
        pointers = {"order_ptr": "i64", "count_ptr": "i64", "labels_ptr": "i64", "hidden_ptr": dtype,
                    "weight_ptr": dtype, "dz_ptr": dtype, "dh_ptr": dtype}
        c = cfgs["dz"]
        kernels = [
            ("linear_dz_bias_entropy", linear_dz_kernel, c, {
                "stride_hh": 1, "stride_wh": 1, "HAS_BIAS": True, "HAS_LOGP_GRAD": True, "HAS_ENTROPY_GRAD": True,
                "COMPUTE_DB": True, "EVEN_H": True, "UPCAST": False, "BLOCK_N": c["BLOCK_N"],
                "BLOCK_V": c["BLOCK_V"], "BLOCK_H": c["BLOCK_H"], "GROUP": c["GROUP"]}),
            ("linear_dz", linear_dz_kernel, c, {
                "stride_hh": 1, "stride_wh": 1, "HAS_BIAS": False, "HAS_LOGP_GRAD": True, "HAS_ENTROPY_GRAD": False,
                "COMPUTE_DB": False, "EVEN_H": True, "UPCAST": False, "BLOCK_N": c["BLOCK_N"],
                "BLOCK_V": c["BLOCK_V"], "BLOCK_H": c["BLOCK_H"], "GROUP": c["GROUP"]}),
        ]
        c = cfgs["dh"]
        kernels.append(("linear_dh", linear_dh_kernel, c, {
            "stride_wh": 1, "UPCAST": False, "BLOCK_N": c["BLOCK_N"], "BLOCK_H": c["BLOCK_H"],
            "BLOCK_V": c["BLOCK_V"], "GROUP": c["GROUP"]}))
        c = cfgs["dw"]
        kernels.append(("linear_dw_db", linear_dw_kernel, c, {
            "stride_hh": 1, "COMPUTE_DW": True, "COMPUTE_DB": True, "UPCAST": False, "BLOCK_V": c["BLOCK_V"],
            "BLOCK_H": c["BLOCK_H"], "BLOCK_K": c["BLOCK_K"], "GROUP": c["GROUP"],
            "DZ_BLOCK_N": cfgs["dz"]["BLOCK_N"]}))
        for name, fn, c, constexprs in kernels:
            params = fn.arg_names
            out.append({
                "name": f"{name}[{dtype}]", "fn": fn, "constexprs": constexprs,
                "pointers": {k: v for k, v in pointers.items() if k in params}, "floats": ["inv_temperature"],
                "num_warps": c["num_warps"], "num_stages": c["num_stages"], "uses_dot": dtype != "fp32",
                "aligned_ints": [k for k in ("H", "V", "stride_hb", "stride_ht", "stride_wv") if k in params],
            })
    return out


H100_CONFIGS = _h100_configs()
