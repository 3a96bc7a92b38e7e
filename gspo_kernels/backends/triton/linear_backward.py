"""Backward of the hidden-state path: ``dH``, ``dW`` and ``dbias`` without the ``[N, V]`` logits.

Only the ``M`` rows whose incoming gradient is non-zero are given to these kernels (the autograd
Function compacts them), so masked, clipped and zero-advantage rows cost nothing. Each kernel
recomputes a logits tile ``z = (h W^T + b) / tau`` with ``tl.dot`` (fp32 accumulation), forms the
logits gradient in registers,

    dl[v] = (1/tau) * ( g_logp * (1[v = y] - p[v]) - g_ent * p[v] * (log p[v] + entropy) ),
    p = exp(z - lse),

and multiplies it back: ``dH = dl @ W``, ``dW = dl^T @ H_rows``, ``dbias = sum_rows dl``. ``dl`` is
rounded to the operand dtype (bf16/fp16) for the tensor-core products; every sum is in fp32.

Two schedules:

* default (``linear_logprobs_bwd_kernel``): one program per (row tile, vocab tile), 6 M H V flops,
  fp32 ``tl.atomic_add`` into ``dH``, ``dW``, ``dbias``; the summation order is not fixed.
* deterministic (``linear_logprobs_bwd_dh_kernel`` + ``linear_logprobs_bwd_dw_kernel``): one program
  per row tile for ``dH`` and one per vocab tile for ``dW``/``dbias``, each walking the other
  dimension in a fixed order with plain loads/stores of its own fp32 rows (no atomics; 8 M H V flops,
  the logits are recomputed twice).

Expected cost (not measured: no GPU was available when this was written). Each (row tile, vocab tile)
adds a ``[BLOCK_N, H]`` partial into ``dH`` and a ``[BLOCK_V, H]`` partial into ``dW``: ``2 M H V / 128``
fp32 reductions for 6 M H V flops, i.e. about 96 flops per reduced byte. The default schedule issues
them as ``red.global.add.v4.f32`` (checked in the PTX); if the H100 benchmark shows it reduction-bound,
larger tiles along ``V``/``M`` are the lever. The deterministic kernels read and write their fp32 rows
once per tile of the other dimension (the same byte count, as plain loads/stores, with only
``M / BLOCK_N`` programs for ``dH``): expect them to be slower than the default.

Optional gradient filtering (``filter_eps``, off by default, as in Cut Cross-Entropy): a tile whose
softmax entries are all below ``filter_eps`` and that holds none of its rows' labels adds nothing.
The dropped contributions are ``|dl| <= (|g_logp| + |g_ent| * (|log p| + entropy)) * filter_eps / tau``
per entry. Measured in ``tests/test_triton_linear.py`` (confident rows): relative dH/dW error of about
``4 * filter_eps`` (3e-3 at 2^-10, 5e-4 at 2^-13) against 3e-6 for the exact path. The test for
"holds a label" is per tile, so a tile holding any of its rows' labels is always kept.

Device memory beyond inputs and outputs: the fp32 accumulators ``dH [M, H]``, ``dW [V, H]``,
``dbias [V]`` (cast to the parameters' dtypes by the caller).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import triton
import triton.language as tl

from gspo_kernels.backends.triton.linear_forward import hidden_row_offsets, hidden_strides, interpreting, logits_tile

# Tuned against the static sm_90a report (0 spills, HGMMA); see the module docstring of h100_report.
# BLOCK_H: the K step of the logits recompute; BLOCK_HG: the width (wgmma N) of the dH / dW products.
# Also 0 spills, to compare on a GPU: BLOCK_H = BLOCK_HG = 64 with num_stages = 2 (wider wgmma, shallower
# pipeline). BLOCK_HG = 64 with num_stages >= 3 spills in the bias + entropy variant.
CUDA_BWD_CONFIG: Dict[str, int] = {
    "BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_H": 32, "BLOCK_HG": 32, "GROUP_N": 8, "num_warps": 8, "num_stages": 4,
}
CUDA_BWD_DH_CONFIG: Dict[str, int] = {"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_H": 64, "GROUP_N": 1, "num_warps": 8, "num_stages": 3}
CUDA_BWD_DW_CONFIG: Dict[str, int] = {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_H": 64, "GROUP_N": 1, "num_warps": 8, "num_stages": 3}
# fp32 operands (exact FMA products): 8 warps; with 4 warps ptxas spills kilobytes per thread.
CUDA_BWD_CONFIG_FP32: Dict[str, int] = {
    "BLOCK_N": 64, "BLOCK_V": 64, "BLOCK_H": 32, "BLOCK_HG": 32, "GROUP_N": 8, "num_warps": 8, "num_stages": 2,
}
INTERPRETER_BWD_CONFIG: Dict[str, int] = {
    "BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_H": 16, "BLOCK_HG": 32, "GROUP_N": 2, "num_warps": 4, "num_stages": 1,
}


@triton.jit
def logits_grad_tile(
    hidden_ptr, weight_ptr, bias_ptr, h_row_off, row_ok, offs_n, offs_v, v_ok,
    labels_ptr, lse_ptr, ent_ptr, g_logp_ptr, g_ent_ptr,
    V, H, stride_hh, stride_wv, stride_wh, inv_temperature, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, FILTER: tl.constexpr, EVEN_H: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``(dl [BLOCK_N, BLOCK_V] fp32, keep)``: the gradient w.r.t. the raw logits ``h W^T + b`` of a tile.

    Invalid rows/columns hold 0. ``keep`` is False when filtering drops the tile.
    """
    z = logits_tile(
        hidden_ptr, weight_ptr, bias_ptr, h_row_off, offs_v, v_ok, V, H,
        stride_hh, stride_wv, stride_wh, inv_temperature,
        HAS_BIAS, EVEN_H, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H,
    )
    lse = tl.load(lse_ptr + offs_n, mask=row_ok, other=0.0)
    g_logp = tl.load(g_logp_ptr + offs_n, mask=row_ok, other=0.0)
    label = tl.load(labels_ptr + offs_n, mask=row_ok, other=-1)
    valid = row_ok[:, None] & v_ok[None, :]
    logp = tl.where(valid, z - lse[:, None], float("-inf"))
    p = tl.exp(logp)
    is_label = offs_v[None, :] == label[:, None]
    dz = g_logp[:, None] * (tl.where(is_label, 1.0, 0.0) - p)
    if HAS_ENTROPY_GRAD:
        g_ent = tl.load(g_ent_ptr + offs_n, mask=row_ok, other=0.0)
        ent = tl.load(ent_ptr + offs_n, mask=row_ok, other=0.0)
        dz -= g_ent[:, None] * p * (tl.where(valid, logp, 0.0) + ent[:, None])
    dl = tl.where(valid, dz * inv_temperature, 0.0)
    keep = True
    if FILTER:
        keep = (tl.max(tl.max(p, axis=1), axis=0) >= filter_eps) | (tl.sum(tl.sum(is_label.to(tl.int32), axis=1), axis=0) > 0)
    return dl, keep


@triton.jit
def load_h_slab(base_ptr, row_off, offs_h, h_ok, stride_h, EVEN_H: tl.constexpr, UPCAST: tl.constexpr):
    """``[rows, BLOCK_H]`` operand slab at ``base + row_off[:, None] + offs_h * stride_h`` (masked unless EVEN_H)."""
    ptrs = base_ptr + row_off[:, None] + offs_h[None, :] * stride_h
    if EVEN_H:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=h_ok[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def as_dot_operand(dl, weight_ptr, UPCAST: tl.constexpr):
    """The logits-gradient tile in the dtype of the other ``tl.dot`` operand (fp32 when upcasting)."""
    if UPCAST:
        return dl
    else:
        return dl.to(weight_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["M", "T"])
def linear_logprobs_bwd_kernel(
    hidden_ptr, weight_ptr, bias_ptr, rows_ptr, labels_ptr, lse_ptr, ent_ptr, g_logp_ptr, g_ent_ptr,
    dh_ptr,  # [M, H] fp32, zero-initialised (compact rows)
    dw_ptr,  # [V, H] fp32, zero-initialised
    db_ptr,  # [V] fp32, zero-initialised
    M, V, H, T,
    stride_hb, stride_ht, stride_hh, stride_wv, stride_wh,
    inv_temperature, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, COMPUTE_DH: tl.constexpr,
    COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, FILTER: tl.constexpr, EVEN_H: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HG: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    pid = tl.program_id(0)
    num_row_tiles = tl.cdiv(M, BLOCK_N)
    num_vocab_tiles = tl.cdiv(V, BLOCK_V)
    per_group = GROUP_N * num_vocab_tiles
    first_tile = (pid // per_group) * GROUP_N
    group_size = tl.minimum(num_row_tiles - first_tile, GROUP_N)
    local = pid % per_group
    row_tile = first_tile + local % group_size
    vocab_tile = local // group_size

    offs_n = row_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < M
    rows = tl.load(rows_ptr + offs_n, mask=row_ok, other=0)
    h_row_off = hidden_row_offsets(rows, T, stride_hb, stride_ht)
    offs_v = vocab_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < V
    dl, keep = logits_grad_tile(
        hidden_ptr, weight_ptr, bias_ptr, h_row_off, row_ok, offs_n, offs_v, v_ok,
        labels_ptr, lse_ptr, ent_ptr, g_logp_ptr, g_ent_ptr,
        V, H, stride_hh, stride_wv, stride_wh, inv_temperature, filter_eps,
        HAS_BIAS, HAS_ENTROPY_GRAD, FILTER, EVEN_H, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H,
    )
    if keep:
        if COMPUTE_DB:
            tl.atomic_add(db_ptr + offs_v, tl.sum(dl, axis=0), mask=v_ok, sem="relaxed")
        dl_op = as_dot_operand(dl, weight_ptr, UPCAST)
        w_row_off = tl.minimum(offs_v, V - 1).to(tl.int64) * stride_wv
        dh_row_off = offs_n.to(tl.int64) * H
        dw_row_off = offs_v.to(tl.int64) * H
        for h0 in range(0, H, BLOCK_HG):  # BLOCK_HG: the N of the gradient products (wider wgmma)
            offs_h = h0 + tl.arange(0, BLOCK_HG)
            h_ok = offs_h < H
            if COMPUTE_DH:
                w = load_h_slab(weight_ptr, w_row_off, offs_h, h_ok, stride_wh, EVEN_H, UPCAST)
                part = tl.dot(dl_op, w, input_precision="ieee")
                tl.atomic_add(
                    dh_ptr + dh_row_off[:, None] + offs_h[None, :], part,
                    mask=row_ok[:, None] & h_ok[None, :], sem="relaxed",
                )
            if COMPUTE_DW:
                x = load_h_slab(hidden_ptr, h_row_off, offs_h, h_ok, stride_hh, EVEN_H, UPCAST)
                part = tl.dot(tl.trans(dl_op), x, input_precision="ieee")
                tl.atomic_add(
                    dw_ptr + dw_row_off[:, None] + offs_h[None, :], part,
                    mask=v_ok[:, None] & h_ok[None, :], sem="relaxed",
                )


@triton.jit(do_not_specialize=["M", "T"])
def linear_logprobs_bwd_dh_kernel(
    hidden_ptr, weight_ptr, bias_ptr, rows_ptr, labels_ptr, lse_ptr, ent_ptr, g_logp_ptr, g_ent_ptr,
    dh_ptr,  # [M, H] fp32, zero-initialised; each program owns BLOCK_N rows
    M, V, H, T,
    stride_hb, stride_ht, stride_hh, stride_wv, stride_wh,
    inv_temperature, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, FILTER: tl.constexpr, EVEN_H: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row_tile = tl.program_id(0)
    offs_n = row_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < M
    rows = tl.load(rows_ptr + offs_n, mask=row_ok, other=0)
    h_row_off = hidden_row_offsets(rows, T, stride_hb, stride_ht)
    dh_row_off = offs_n.to(tl.int64) * H
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        v_ok = offs_v < V
        dl, keep = logits_grad_tile(
            hidden_ptr, weight_ptr, bias_ptr, h_row_off, row_ok, offs_n, offs_v, v_ok,
            labels_ptr, lse_ptr, ent_ptr, g_logp_ptr, g_ent_ptr,
            V, H, stride_hh, stride_wv, stride_wh, inv_temperature, filter_eps,
            HAS_BIAS, HAS_ENTROPY_GRAD, FILTER, EVEN_H, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H,
        )
        if keep:
            dl_op = as_dot_operand(dl, weight_ptr, UPCAST)
            w_row_off = tl.minimum(offs_v, V - 1).to(tl.int64) * stride_wv
            for h0 in range(0, H, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                h_ok = offs_h < H
                w = load_h_slab(weight_ptr, w_row_off, offs_h, h_ok, stride_wh, EVEN_H, UPCAST)
                ptrs = dh_ptr + dh_row_off[:, None] + offs_h[None, :]
                io_mask = row_ok[:, None] & h_ok[None, :]
                acc = tl.load(ptrs, mask=io_mask, other=0.0)
                acc = tl.dot(dl_op, w, acc, input_precision="ieee")
                tl.store(ptrs, acc, mask=io_mask)


@triton.jit(do_not_specialize=["M", "T"])
def linear_logprobs_bwd_dw_kernel(
    hidden_ptr, weight_ptr, bias_ptr, rows_ptr, labels_ptr, lse_ptr, ent_ptr, g_logp_ptr, g_ent_ptr,
    dw_ptr,  # [V, H] fp32, zero-initialised; each program owns BLOCK_V vocabulary rows
    db_ptr,  # [V] fp32
    M, V, H, T,
    stride_hb, stride_ht, stride_hh, stride_wv, stride_wh,
    inv_temperature, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr, FILTER: tl.constexpr, EVEN_H: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    vocab_tile = tl.program_id(0)
    offs_v = vocab_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < V
    dw_row_off = offs_v.to(tl.int64) * H
    db = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for n0 in range(0, M, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        row_ok = offs_n < M
        rows = tl.load(rows_ptr + offs_n, mask=row_ok, other=0)
        h_row_off = hidden_row_offsets(rows, T, stride_hb, stride_ht)
        dl, keep = logits_grad_tile(
            hidden_ptr, weight_ptr, bias_ptr, h_row_off, row_ok, offs_n, offs_v, v_ok,
            labels_ptr, lse_ptr, ent_ptr, g_logp_ptr, g_ent_ptr,
            V, H, stride_hh, stride_wv, stride_wh, inv_temperature, filter_eps,
            HAS_BIAS, HAS_ENTROPY_GRAD, FILTER, EVEN_H, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H,
        )
        if keep:
            if COMPUTE_DB:
                db += tl.sum(dl, axis=0)
            if COMPUTE_DW:
                dl_t = tl.trans(as_dot_operand(dl, weight_ptr, UPCAST))
                for h0 in range(0, H, BLOCK_H):
                    offs_h = h0 + tl.arange(0, BLOCK_H)
                    h_ok = offs_h < H
                    x = load_h_slab(hidden_ptr, h_row_off, offs_h, h_ok, stride_hh, EVEN_H, UPCAST)
                    ptrs = dw_ptr + dw_row_off[:, None] + offs_h[None, :]
                    io_mask = v_ok[:, None] & h_ok[None, :]
                    acc = tl.load(ptrs, mask=io_mask, other=0.0)
                    acc = tl.dot(dl_t, x, acc, input_precision="ieee")
                    tl.store(ptrs, acc, mask=io_mask)
    if COMPUTE_DB:
        tl.store(db_ptr + offs_v, db, mask=v_ok)


def _pick_config(dtype: torch.dtype, default: Dict[str, int], config: Optional[Dict[str, int]]) -> Dict[str, int]:
    if config is not None:
        return dict(config)
    if interpreting():
        return dict(INTERPRETER_BWD_CONFIG)
    if dtype == torch.float32:
        return dict(CUDA_BWD_CONFIG_FP32)
    return dict(default)


def linear_logprobs_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    rows: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: Optional[torch.Tensor],
    temperature: float = 1.0,
    *,
    compute_dh: bool = True,
    compute_dw: bool = True,
    compute_db: bool = True,
    deterministic: bool = False,
    filter_eps: Optional[float] = None,
    config: Optional[Dict[str, int]] = None,
) -> tuple:
    """fp32 gradients of ``sum(grad_logp * logp + grad_entropy * entropy)`` over the rows ``rows``.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` (any strides). weight: ``[V, H]``. bias: ``[V]`` or None.
        rows: ``[M]`` int64 token indices (only rows with a non-zero gradient should be passed).
        labels, lse, entropy, grad_logp, grad_entropy: ``[M]`` (int64 / fp32) for those rows;
            ``lse`` and ``entropy`` as returned by the forward. ``grad_entropy`` may be None.
        deterministic: use the two atomic-free kernels (fixed summation order, bitwise repeatable).
        filter_eps: skip tiles whose softmax entries are all below it (None: exact).

    Returns:
        ``(dh [M, H] fp32 or None, dw [V, H] fp32 or None, db [V] fp32 or None)``.
    """
    M = rows.shape[0]
    V, H = weight.shape
    device = hidden.device
    dh = torch.zeros((M, H), device=device, dtype=torch.float32) if compute_dh else None
    dw = torch.zeros((V, H), device=device, dtype=torch.float32) if compute_dw else None
    compute_db = compute_db and bias is not None
    db = torch.zeros(V, device=device, dtype=torch.float32) if compute_db else None
    if M == 0 or not (compute_dh or compute_dw or compute_db):
        return dh, dw, db
    T, stride_hb, stride_ht, stride_hh = hidden_strides(hidden)
    upcast = interpreting() and (hidden.dtype == torch.bfloat16 or weight.dtype == torch.bfloat16)
    has_ent = grad_entropy is not None
    dummy = lse
    args = (
        hidden, weight, bias if bias is not None else weight, rows, labels, lse, entropy,
        grad_logp, grad_entropy if has_ent else dummy,
    )
    sizes = (M, V, H, T, stride_hb, stride_ht, stride_hh, weight.stride(0), weight.stride(1),
             1.0 / float(temperature), float(filter_eps or 0.0))

    def flags(cfg: Dict[str, int]) -> dict:
        return dict(
            HAS_BIAS=bias is not None, HAS_ENTROPY_GRAD=has_ent, FILTER=filter_eps is not None,
            EVEN_H=H % max(cfg["BLOCK_H"], cfg.get("BLOCK_HG", 1)) == 0, UPCAST=upcast,
            BLOCK_N=cfg["BLOCK_N"], BLOCK_V=cfg["BLOCK_V"], BLOCK_H=cfg["BLOCK_H"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )

    if not deterministic:
        cfg = _pick_config(hidden.dtype, CUDA_BWD_CONFIG, config)
        grid = (triton.cdiv(M, cfg["BLOCK_N"]) * triton.cdiv(V, cfg["BLOCK_V"]),)
        linear_logprobs_bwd_kernel[grid](
            *args,
            dh if dh is not None else dummy, dw if dw is not None else dummy, db if db is not None else dummy,
            *sizes, COMPUTE_DH=compute_dh, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
            BLOCK_HG=cfg.get("BLOCK_HG", cfg["BLOCK_H"]), GROUP_N=cfg["GROUP_N"], **flags(cfg),
        )
        return dh, dw, db
    if compute_dh:
        cfg = _pick_config(hidden.dtype, CUDA_BWD_DH_CONFIG, config)
        linear_logprobs_bwd_dh_kernel[(triton.cdiv(M, cfg["BLOCK_N"]),)](*args, dh, *sizes, **flags(cfg))
    if compute_dw or compute_db:
        cfg = _pick_config(hidden.dtype, CUDA_BWD_DW_CONFIG, config)
        linear_logprobs_bwd_dw_kernel[(triton.cdiv(V, cfg["BLOCK_V"]),)](
            *args, dw if dw is not None else dummy, db if db is not None else dummy, *sizes,
            COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db, **flags(cfg),
        )
    return dh, dw, db


_POINTERS = {
    "hidden_ptr": "*bf16", "weight_ptr": "*bf16", "bias_ptr": "*bf16", "rows_ptr": "*i64", "labels_ptr": "*i64",
    "lse_ptr": "*fp32", "ent_ptr": "*fp32", "g_logp_ptr": "*fp32", "g_ent_ptr": "*fp32",
}
_SIZES = {
    "M": "i32", "V": "i32", "H": "i32", "T": "i32", "stride_hb": "i32", "stride_ht": "i32",
    "stride_hh": "constexpr", "stride_wv": "i32", "stride_wh": "constexpr",
    "inv_temperature": "fp32", "filter_eps": "fp32",
}


def _h100_entry(name: str, fn, outputs: dict, cfg: Dict[str, int], constexprs: dict, dtype: str = "bf16") -> dict:
    blocks = {k: cfg[k] for k in ("BLOCK_N", "BLOCK_V", "BLOCK_H")}
    for extra in ("BLOCK_HG", "GROUP_N"):
        if extra in fn.arg_names:
            blocks[extra] = cfg[extra]
    constexprs = {"stride_hh": 1, "stride_wh": 1, "FILTER": False, "EVEN_H": True, "UPCAST": False,
                  **constexprs, **blocks}
    pointers = {k: v.replace("bf16", dtype) for k, v in _POINTERS.items()}
    types = {**pointers, **outputs, **_SIZES, **{k: "constexpr" for k in constexprs}}
    signature = {arg: types[arg] for arg in fn.arg_names}
    aligned = [k for k, v in signature.items() if v.startswith("*")] + ["H", "stride_hb", "stride_ht", "stride_wv"]
    return {"name": f"{name}[{dtype}]", "fn": fn, "signature": signature, "constexprs": constexprs,
            "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "uses_dot": dtype != "fp32",
            "aligned": aligned}


def _h100_configs() -> list:
    """Launch configurations used on CUDA (read by ``h100_report``).

    bf16 operands (the production case) must use HGMMA; fp32 operands are multiplied exactly
    (``input_precision="ieee"``: FMA, no tensor cores, by design), so their rows only check spills.
    """
    atomic_out = {"dh_ptr": "*fp32", "dw_ptr": "*fp32", "db_ptr": "*fp32"}
    full = {"HAS_BIAS": True, "HAS_ENTROPY_GRAD": True}
    out = []
    for has_bias, has_ent in ((False, False), (True, True)):
        out.append(_h100_entry(
            f"linear_logprobs_bwd{'_bias' if has_bias else ''}{'_entropy' if has_ent else ''}",
            linear_logprobs_bwd_kernel, atomic_out, CUDA_BWD_CONFIG,
            {"HAS_BIAS": has_bias, "HAS_ENTROPY_GRAD": has_ent, "COMPUTE_DH": True, "COMPUTE_DW": True,
             "COMPUTE_DB": has_bias},
        ))
    out.append(_h100_entry(
        "linear_logprobs_bwd_dh_deterministic", linear_logprobs_bwd_dh_kernel, {"dh_ptr": "*fp32"},
        CUDA_BWD_DH_CONFIG, full,
    ))
    dw_out = {"dw_ptr": "*fp32", "db_ptr": "*fp32"}
    dw_flags = {**full, "COMPUTE_DW": True, "COMPUTE_DB": True}
    out.append(_h100_entry(
        "linear_logprobs_bwd_dw_deterministic", linear_logprobs_bwd_dw_kernel, dw_out, CUDA_BWD_DW_CONFIG, dw_flags,
    ))
    fp32 = CUDA_BWD_CONFIG_FP32
    out.append(_h100_entry(
        "linear_logprobs_bwd_bias_entropy", linear_logprobs_bwd_kernel, atomic_out, fp32,
        {**full, "COMPUTE_DH": True, "COMPUTE_DW": True, "COMPUTE_DB": True}, dtype="fp32",
    ))
    out.append(_h100_entry("linear_logprobs_bwd_dh_deterministic", linear_logprobs_bwd_dh_kernel, {"dh_ptr": "*fp32"},
                           fp32, full, dtype="fp32"))
    out.append(_h100_entry("linear_logprobs_bwd_dw_deterministic", linear_logprobs_bwd_dw_kernel, dw_out, fp32,
                           dw_flags, dtype="fp32"))
    return out


H100_CONFIGS = _h100_configs()
