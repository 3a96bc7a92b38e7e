"""Forward of the hidden-state path: per-token log-probs and entropy from ``hidden @ weight.T`` (+ bias).

The ``[N, V]`` logits never exist. A program owns ``BLOCK_N`` rows and one contiguous *split* of the
vocabulary; it walks that split ``BLOCK_V`` columns at a time, builds each logits tile with ``tl.dot``
(fp32 accumulation over ``H`` in ``BLOCK_H`` steps), scales it by ``1 / temperature`` and folds it
into a running (online) log-sum-exp, the entropy sum and the label's logit. Only per-row partial
statistics leave the kernel: three fp32 values per (split, row) plus the label logit, ``O(N)`` memory.
The launcher combines the splits (a few ``[splits, M]`` elementwise ops).

Per row, with ``z = (h . W[v] + b[v]) / tau`` and a split's running maximum ``m``:
``s = sum_v exp(z_v - m)`` and ``t = sum_v exp(z_v - m) (z_v - m)``, so that
``lse = m + log s`` and ``entropy = log s - t / s`` (no cancellation against ``lse``).

Grid: 1-D, ``row_tiles * splits`` programs in a grouped order (``GROUP_N`` row tiles times every split
are consecutive), so the hidden rows of the tiles running at the same time stay in L2 while the
weight streams through. ``M`` (rows), ``V``, ``H`` and ``T`` are runtime arguments: a new ``N`` or
sequence length never recompiles.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch
import triton
import triton.language as tl

# Launch configuration used on CUDA for half-precision operands (tuned against the static sm_90a report:
# 0 spills, HGMMA in the SASS), and a small one for the CPU interpreter (small shapes, many tiles).
CUDA_FWD_CONFIG: Dict[str, int] = {"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_H": 64, "GROUP_N": 8, "num_warps": 8, "num_stages": 3}
CUDA_FWD_CONFIG_FP32: Dict[str, int] = {"BLOCK_N": 64, "BLOCK_V": 64, "BLOCK_H": 32, "GROUP_N": 8, "num_warps": 4, "num_stages": 2}
INTERPRETER_FWD_CONFIG: Dict[str, int] = {"BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_H": 16, "GROUP_N": 2, "num_warps": 4, "num_stages": 1}


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def logits_tile(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    h_row_off,
    offs_v,
    v_ok,
    V,
    H,
    stride_hh,
    stride_wv,
    stride_wh,
    inv_temperature,
    HAS_BIAS: tl.constexpr,
    EVEN_H: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``z [BLOCK_N, BLOCK_V]`` fp32 = ``(hidden[rows] @ weight[offs_v].T + bias[offs_v]) * inv_temperature``.

    ``h_row_off`` [BLOCK_N] int64: element offsets of the rows in ``hidden`` (every one a valid row).
    Columns ``>= V`` hold finite junk values that the caller must mask.
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
        acc += tl.load(bias_ptr + offs_v, mask=v_ok, other=0.0).to(tl.float32)[None, :]
    return acc * inv_temperature


@triton.jit
def hidden_row_offsets(rows, T, stride_hb, stride_ht):
    """Element offsets of token rows in a ``[B, T, H]`` (or ``[N, H]`` with ``T = N``) strided tensor."""
    return (rows // T) * stride_hb + (rows % T) * stride_ht


# Row and split counts vary per batch: never specialize on them (no recompile for M == 1 or M % 16 == 0).
@triton.jit(do_not_specialize=["M", "T", "cols_per_split", "num_splits"])
def linear_logprobs_fwd_kernel(
    hidden_ptr,  # [B, T, H] or [N, H], any strides, fp16/bf16/fp32
    weight_ptr,  # [V, H], same dtype
    bias_ptr,  # [V] or dummy
    rows_ptr,  # [M] int64: token index of each computed row
    labels_ptr,  # [M] int64: label of each computed row, in [0, V)
    part_max_ptr,  # [splits, M] fp32
    part_sum_ptr,  # [splits, M] fp32
    part_ent_ptr,  # [splits, M] fp32
    label_logit_ptr,  # [M] fp32 (written by the split that holds the label)
    M,
    V,
    H,
    T,
    stride_hb,
    stride_ht,
    stride_hh,
    stride_wv,
    stride_wh,
    inv_temperature,
    cols_per_split,
    num_splits,
    HAS_BIAS: tl.constexpr,
    EVEN_H: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    pid = tl.program_id(0)
    num_row_tiles = tl.cdiv(M, BLOCK_N)
    per_group = GROUP_N * num_splits
    first_tile = (pid // per_group) * GROUP_N
    group_size = tl.minimum(num_row_tiles - first_tile, GROUP_N)
    local = pid % per_group
    row_tile = first_tile + local % group_size
    split = local // group_size

    offs_n = row_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < M
    rows = tl.load(rows_ptr + offs_n, mask=row_ok, other=0)
    h_row_off = hidden_row_offsets(rows, T, stride_hb, stride_ht)
    label = tl.load(labels_ptr + offs_n, mask=row_ok, other=-1)

    v_begin = split * cols_per_split
    v_end = tl.minimum(v_begin + cols_per_split, V)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s_i = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t_i = tl.zeros((BLOCK_N,), dtype=tl.float32)
    lab = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        v_ok = offs_v < v_end
        z = logits_tile(
            hidden_ptr, weight_ptr, bias_ptr, h_row_off, offs_v, v_ok, V, H,
            stride_hh, stride_wv, stride_wh, inv_temperature,
            HAS_BIAS, EVEN_H, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H,
        )
        m_new = tl.maximum(m_i, tl.max(tl.where(v_ok[None, :], z, float("-inf")), axis=1))
        shift = tl.where(s_i > 0, m_i - m_new, 0.0)
        alpha = tl.exp(shift)
        zs = tl.where(v_ok[None, :], z - m_new[:, None], 0.0)
        e = tl.where(v_ok[None, :], tl.exp(zs), 0.0)
        t_i = alpha * (t_i + shift * s_i) + tl.sum(e * zs, axis=1)
        s_i = alpha * s_i + tl.sum(e, axis=1)
        m_i = m_new
        lab += tl.sum(tl.where(offs_v[None, :] == label[:, None], z, 0.0), axis=1)

    out = split * M + offs_n
    tl.store(part_max_ptr + out, m_i, mask=row_ok)
    tl.store(part_sum_ptr + out, s_i, mask=row_ok)
    tl.store(part_ent_ptr + out, t_i, mask=row_ok)
    tl.store(label_logit_ptr + offs_n, lab, mask=row_ok & (label >= v_begin) & (label < v_end))


def _pick_config(dtype: torch.dtype, config: Optional[Dict[str, int]]) -> Dict[str, int]:
    if config is not None:
        return dict(config)
    if interpreting():
        return dict(INTERPRETER_FWD_CONFIG)
    return dict(CUDA_FWD_CONFIG_FP32 if dtype == torch.float32 else CUDA_FWD_CONFIG)


def hidden_strides(hidden: torch.Tensor) -> tuple:
    """``(T, stride_b, stride_t, stride_h)`` addressing row ``r`` of ``hidden [N, H]`` / ``[B, T, H]``."""
    if hidden.dim() == 2:
        return max(hidden.shape[0], 1), 0, hidden.stride(0), hidden.stride(1)
    return max(hidden.shape[1], 1), hidden.stride(0), hidden.stride(1), hidden.stride(2)


def linear_logprobs_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    rows: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    num_splits: Optional[int] = None,
    config: Optional[Dict[str, int]] = None,
) -> tuple:
    """Log-probs, entropy and log-sum-exp of the rows ``rows`` of ``hidden @ weight.T + bias``.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` (any strides), fp16/bf16/fp32.
        weight: ``[V, H]``, same dtype as ``hidden``. bias: ``[V]`` or None.
        rows: ``[M]`` int64 token indices (into the flattened ``N = B * T``) to compute.
        labels: ``[M]`` int64 labels of those rows, in ``[0, V)``.
        temperature: logits are divided by it.
        num_splits: vocabulary splits (default: enough programs to fill the device).
        config: block sizes / warps / stages (default: ``CUDA_FWD_CONFIG`` or the interpreter's).

    Returns:
        ``(logp [M] fp32, entropy [M] fp32, lse [M] fp32)`` where ``lse`` is the log-sum-exp of the
        temperature-scaled logits (the backward recomputes the softmax from it).

    Extra device memory: ``3 * splits * M + M`` fp32 (the per-split partial statistics).
    """
    M = rows.shape[0]
    V, H = weight.shape
    device = hidden.device
    if M == 0:
        empty = torch.empty(0, device=device, dtype=torch.float32)
        return empty, empty.clone(), empty.clone()
    cfg = _pick_config(hidden.dtype, config)
    block_v = cfg["BLOCK_V"]
    vocab_tiles = triton.cdiv(V, block_v)
    row_tiles = triton.cdiv(M, cfg["BLOCK_N"])
    if num_splits is None:
        if device.type == "cuda":
            target = 8 * torch.cuda.get_device_properties(device).multi_processor_count
        else:
            target = 4
        num_splits = triton.cdiv(target, row_tiles)
    num_splits = max(1, min(int(num_splits), vocab_tiles))
    cols_per_split = triton.cdiv(vocab_tiles, num_splits) * block_v
    num_splits = triton.cdiv(V, cols_per_split)  # every split holds at least one column

    part = torch.empty((3, num_splits, M), device=device, dtype=torch.float32)
    label_logit = torch.zeros(M, device=device, dtype=torch.float32)
    T, stride_hb, stride_ht, stride_hh = hidden_strides(hidden)
    upcast = interpreting() and (hidden.dtype == torch.bfloat16 or weight.dtype == torch.bfloat16)
    grid = (row_tiles * num_splits,)
    linear_logprobs_fwd_kernel[grid](
        hidden, weight, bias if bias is not None else weight, rows, labels,
        part[0], part[1], part[2], label_logit,
        M, V, H, T, stride_hb, stride_ht, stride_hh, weight.stride(0), weight.stride(1),
        1.0 / float(temperature), cols_per_split, num_splits,
        HAS_BIAS=bias is not None, EVEN_H=H % cfg["BLOCK_H"] == 0, UPCAST=upcast,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_V=block_v, BLOCK_H=cfg["BLOCK_H"], GROUP_N=cfg["GROUP_N"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    part_max, part_sum, part_t = part[0], part[1], part[2]
    m = part_max.max(dim=0).values
    scale = torch.exp(part_max - m)
    s = (scale * part_sum).sum(dim=0)
    t = (scale * (part_t + (part_max - m) * part_sum)).sum(dim=0)
    log_s = torch.log(s)
    lse = m + log_s
    entropy = log_s - t / s
    return label_logit - lse, entropy, lse


def _h100_configs() -> list:
    """Launch configurations the library uses on CUDA (read by ``h100_report``).

    bf16 operands (the production case) must use HGMMA. fp32 operands are multiplied exactly
    (``input_precision="ieee"``: FMA, no tensor cores, by design), so their rows only check spills.
    """
    out = []
    for dtype, cfg, variants in (("bf16", CUDA_FWD_CONFIG, (False, True)), ("fp32", CUDA_FWD_CONFIG_FP32, (True,))):
        signature = {
            "hidden_ptr": f"*{dtype}", "weight_ptr": f"*{dtype}", "bias_ptr": f"*{dtype}", "rows_ptr": "*i64",
            "labels_ptr": "*i64", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "part_ent_ptr": "*fp32",
            "label_logit_ptr": "*fp32", "M": "i32", "V": "i32", "H": "i32", "T": "i32", "stride_hb": "i32",
            "stride_ht": "i32", "stride_hh": "constexpr", "stride_wv": "i32", "stride_wh": "constexpr",
            "inv_temperature": "fp32", "cols_per_split": "i32", "num_splits": "i32", "HAS_BIAS": "constexpr",
            "EVEN_H": "constexpr", "UPCAST": "constexpr", "BLOCK_N": "constexpr", "BLOCK_V": "constexpr",
            "BLOCK_H": "constexpr", "GROUP_N": "constexpr",
        }
        for has_bias in variants:
            constexprs = {
                "stride_hh": 1, "stride_wh": 1, "HAS_BIAS": has_bias, "EVEN_H": True, "UPCAST": False,
                "BLOCK_N": cfg["BLOCK_N"], "BLOCK_V": cfg["BLOCK_V"], "BLOCK_H": cfg["BLOCK_H"], "GROUP_N": cfg["GROUP_N"],
            }
            out.append({
                "name": f"linear_logprobs_fwd{'_bias' if has_bias else ''}[{dtype}]",
                "fn": linear_logprobs_fwd_kernel,
                "signature": signature,
                "constexprs": constexprs,
                "num_warps": cfg["num_warps"],
                "num_stages": cfg["num_stages"],
                "uses_dot": dtype != "fp32",
                # pointers, and the sizes/strides that are multiples of 16 for real models (H, H * T, H)
                "aligned": [k for k, v in signature.items() if v.startswith("*")] + ["H", "stride_hb", "stride_ht", "stride_wv"],
            })
    return out


H100_CONFIGS = _h100_configs()
