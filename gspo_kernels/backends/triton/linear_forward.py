"""Forward of the hidden-state path: per-token log-probs and entropy from ``hidden @ weight.T`` (+ bias).

The ``[N, V]`` logits never exist. A program owns ``BLOCK_N`` rows and one *split* of the vocabulary
(``cols_per_split`` consecutive columns); it walks that split ``BLOCK_V`` columns at a time, builds each
logits tile with ``tl.dot`` (fp32 accumulation over ``H`` in ``BLOCK_H`` steps), scales it by
``1 / temperature`` and folds it into a running (online) log-sum-exp, the entropy sum and the label's
logit. Only per-row partial statistics leave the kernel (three fp32 values per (split, row) plus the
label logit); a second small kernel combines the splits of each row in split order.

Per row, with ``z = (h . W[v] + b[v]) / tau`` and a split's running maximum ``m``:
``s = sum_v exp(z_v - m)`` and ``t = sum_v exp(z_v - m) (z_v - m)``, so that
``log-sum-exp = m + log s`` and ``entropy = log s - t / s`` (no cancellation against the log-sum-exp).
``m`` and ``log s`` are returned separately (not summed into one fp32 log-sum-exp), so that
``log p = (z - m) - log s`` keeps its precision when the logits are large (``1e4`` offsets): ``z - m`` is
exact there, while ``m + log s`` would be rounded to the spacing of ``m``. A bias is shifted by its
largest finite entry before the kernel (the softmax does not change; the logits stay small).

Batch invariance: a row's results depend only on that row (its hidden state, its label) and on the
launch configuration, which depends on the dtype alone: the split width is a constant (not a function
of the number of rows), the products of a ``tl.dot`` tile are per output element, and the splits are
combined in a fixed order. So a row gives the same bits alone or among any other rows, at any position.

Rows: either all ``N`` rows, or the first ``count`` entries of a device-side compaction ``order`` of the
active rows (``count`` is read by the kernels: no host synchronisation). Programs past ``count`` exit
at once. Out-of-range labels are never used as addresses; such a row's log-prob is NaN.

Grid: 1-D, ``row_tiles * splits`` programs in a grouped order (``GROUP_N`` row tiles times every split
are consecutive), so the hidden rows of the tiles running at the same time stay in L2 while the
weight streams through. Sizes are runtime arguments: a new ``N`` or sequence length never recompiles.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from gspo_kernels.backends.triton import device_guard
from gspo_kernels.backends.triton.addressing import grouped_tile, interpreter_active, row_offsets, row_strides

# Launch configurations. CUDA, half-precision operands: tuned against the static sm_90a report (0 spills,
# HGMMA in the SASS). fp32 operands: exact products (``input_precision="ieee"``, no tensor cores).
# SPLIT_COLS: columns per vocabulary split, a constant so that a row's bits do not depend on the batch.
CUDA_FWD_CONFIG: Dict[str, int] = {
    "BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_H": 64, "GROUP_N": 8, "SPLIT_COLS": 4096, "num_warps": 8, "num_stages": 3,
}
CUDA_FWD_CONFIG_FP32: Dict[str, int] = {
    "BLOCK_N": 64, "BLOCK_V": 64, "BLOCK_H": 32, "GROUP_N": 8, "SPLIT_COLS": 4096, "num_warps": 4, "num_stages": 2,
}
INTERPRETER_FWD_CONFIG: Dict[str, int] = {
    "BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_H": 16, "GROUP_N": 2, "SPLIT_COLS": 64, "num_warps": 4, "num_stages": 1,
}
COMBINE_BLOCK = 128

# A finite "minus infinity" for the running max: exp(_NEG_BIG - m) is 0 and (_NEG_BIG - m) * 0 is 0 (no NaN
# when a whole tile or split is -inf, e.g. a -inf bias over a vocabulary range).
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def logits_tile(
    hidden_ptr, weight_ptr, bias_ptr, h_row_off, offs_v, v_ok, V, H,
    stride_hh, stride_wv, stride_wh, stride_bv, inv_temperature,
    HAS_BIAS: tl.constexpr, EVEN_H: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``z [BLOCK_N, BLOCK_V]`` fp32 = ``(hidden[rows] @ weight[offs_v].T + bias[offs_v]) * inv_temperature``.

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
    return acc * inv_temperature


# Row and split counts vary per batch: never specialize on them (no recompile for N == 1 or N % 16 == 0).
@triton.jit(do_not_specialize=["M", "T", "cols_per_split", "num_splits"])
def linear_logprobs_fwd_kernel(
    hidden_ptr,  # [B, T, H] or [N, H], any strides, fp16/bf16/fp32
    weight_ptr,  # [V, H], same dtype
    bias_ptr,  # [V] (any stride, any float dtype) or dummy
    order_ptr,  # [M] int64: the computed rows, compacted (read only when HAS_ORDER)
    count_ptr,  # [1] int64: how many entries of order are valid (read only when HAS_ORDER)
    labels_ptr,  # [N] int64 (any values: compared, never used as an address)
    part_max_ptr,  # [splits, M] fp32, indexed by position in order
    part_sum_ptr,  # [splits, M] fp32
    part_ent_ptr,  # [splits, M] fp32
    label_logit_ptr,  # [M] fp32 (written by the split that holds the label)
    M, V, H, T,
    stride_hb, stride_ht, stride_hh, stride_wv, stride_wh, stride_bv,
    inv_temperature, cols_per_split, num_splits,
    HAS_BIAS: tl.constexpr, HAS_ORDER: tl.constexpr, EVEN_H: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, GROUP_N: tl.constexpr,
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
        m_i = tl.full((BLOCK_N,), _NEG_BIG, dtype=tl.float32)
        s_i = tl.zeros((BLOCK_N,), dtype=tl.float32)
        t_i = tl.zeros((BLOCK_N,), dtype=tl.float32)
        lab = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for v0 in range(v_begin, v_end, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            v_ok = offs_v < v_end
            z = logits_tile(
                hidden_ptr, weight_ptr, bias_ptr, h_row_off, offs_v, v_ok, V, H,
                stride_hh, stride_wv, stride_wh, stride_bv, inv_temperature,
                HAS_BIAS, EVEN_H, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H,
            )
            lab += tl.sum(tl.where(offs_v[None, :] == label[:, None], z, 0.0), axis=1)
            z = tl.where(v_ok[None, :], z, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(z, axis=1))
            shift = m_i - m_new
            alpha = tl.exp(shift)
            zs = z - m_new[:, None]
            e = tl.exp(zs)
            # e == 0 where z = -inf (padding, a -inf bias entry): its p log p term is 0, not 0 * -inf = NaN.
            t_i = alpha * (t_i + shift * s_i) + tl.sum(tl.where(e > 0, e * zs, 0.0), axis=1)
            s_i = alpha * s_i + tl.sum(e, axis=1)
            m_i = m_new

        out = split * M + offs_n
        tl.store(part_max_ptr + out, m_i, mask=row_ok)
        tl.store(part_sum_ptr + out, s_i, mask=row_ok)
        tl.store(part_ent_ptr + out, t_i, mask=row_ok)
        tl.store(label_logit_ptr + offs_n, lab, mask=row_ok & (label >= v_begin) & (label < v_end))


@triton.jit(do_not_specialize=["M", "num_splits"])
def linear_logprobs_combine_kernel(
    order_ptr, count_ptr, labels_ptr, part_max_ptr, part_sum_ptr, part_ent_ptr, label_logit_ptr,
    logp_ptr,  # [N] fp32 outputs, indexed by row
    entropy_ptr,
    max_ptr,  # [N] fp32: the row's logit maximum m
    log_sum_ptr,  # [N] fp32: log sum exp(z - m)
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
    m = tl.full((BLOCK,), _NEG_BIG, dtype=tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(part_max_ptr + s * M + offs, mask=ok, other=_NEG_BIG))
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    t = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, num_splits):
        pm = tl.load(part_max_ptr + s * M + offs, mask=ok, other=_NEG_BIG)
        ps = tl.load(part_sum_ptr + s * M + offs, mask=ok, other=0.0)
        pt = tl.load(part_ent_ptr + s * M + offs, mask=ok, other=0.0)
        scale = tl.exp(pm - m)
        total += scale * ps
        t += scale * (pt + (pm - m) * ps)
    total = tl.where(ok, total, 1.0)  # lanes past the rows: no log(0) on junk
    log_sum = tl.log(total)
    label = tl.load(labels_ptr + rows, mask=ok, other=0)
    label_ok = (label >= 0) & (label < V)
    logp = (tl.load(label_logit_ptr + offs, mask=ok, other=0.0) - m) - log_sum
    logp = tl.where(label_ok, logp, float("nan"))  # an out-of-range label gives NaN, never an address
    tl.store(logp_ptr + rows, logp, mask=ok)
    tl.store(entropy_ptr + rows, log_sum - t / total, mask=ok)
    tl.store(max_ptr + rows, m, mask=ok)
    tl.store(log_sum_ptr + rows, log_sum, mask=ok)


def pick_config(dtype: torch.dtype, config: Optional[Dict[str, int]] = None) -> Dict[str, int]:
    """The forward's launch configuration: ``config`` if given, else the interpreter's or the CUDA one for ``dtype``."""
    if config is not None:
        return dict(config)
    if interpreter_active():
        return dict(INTERPRETER_FWD_CONFIG)
    return dict(CUDA_FWD_CONFIG_FP32 if dtype == torch.float32 else CUDA_FWD_CONFIG)


def upcast_dots(*tensors: torch.Tensor) -> bool:
    """True when the kernels must multiply bf16 operands in fp32 (the interpreter's bf16 ``tl.dot`` is wrong)."""
    return interpreter_active() and any(t.dtype == torch.bfloat16 for t in tensors)


def compact_rows(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Device-side stable compaction: ``(order [N] int64, count [1] int64)``, no host synchronisation.

    ``order`` is a permutation of ``0 .. N-1``: the indices of the True entries of ``mask [N]`` in increasing
    order (the first ``count``), then those of the False entries. Built from an inclusive ``cumsum`` (the
    number of True entries up to each index) and a scatter without collisions (deterministic in every mode).
    """
    mask = mask.reshape(-1).to(torch.bool)
    n = mask.numel()
    if n == 0:
        return torch.zeros(0, device=mask.device, dtype=torch.int64), torch.zeros(1, device=mask.device,
                                                                                  dtype=torch.int64)
    seen = torch.cumsum(mask, 0)  # True entries in [0, i]
    count = seen[-1:]
    index = torch.arange(n, device=mask.device, dtype=torch.int64)
    slot = torch.where(mask, seen - 1, count + index - seen)
    order = torch.empty(n, device=mask.device, dtype=torch.int64).scatter_(0, slot, index)
    return order, count.clone()


def shifted_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """fp32 ``bias - max(finite bias)``: the same softmax, small logits (``1e4`` offsets lose no bits)."""
    if bias is None:
        return None
    b = bias.to(torch.float32)
    finite = torch.where(torch.isfinite(b), b, torch.full_like(b, float("-inf")))
    top = finite.max() if b.numel() else torch.zeros((), dtype=b.dtype, device=b.device)
    return b - torch.where(torch.isfinite(top), top, torch.zeros_like(top))


def linear_logprobs_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    order: Optional[torch.Tensor] = None,
    count: Optional[torch.Tensor] = None,
    config: Optional[Dict[str, int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of every row (or of the rows ``order[:count]``) of ``hidden @ weight.T + bias``.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` (any strides), fp16/bf16/fp32.
        weight: ``[V, H]``, same dtype as ``hidden``. bias: ``[V]`` (any stride and float dtype) or None;
            used as given (callers shift it with :func:`shifted_bias` for precision).
        labels: ``[N]`` int64. Out-of-range labels give a NaN log-prob (they are never used as addresses).
        temperature: logits are divided by it.
        order, count: a compaction of the rows to compute (see :func:`compact_rows`), or None for all rows.
        config: block sizes / warps / stages / ``SPLIT_COLS`` (default: :func:`pick_config`).

    Returns:
        ``(logp, entropy, m, log_sum)``, each ``[N]`` fp32; rows not computed hold 0. ``m`` is the row's
        largest temperature-scaled logit and ``log_sum = log sum_v exp(z_v - m)`` (the log-sum-exp is
        ``m + log_sum``, kept apart for precision).

    Extra device memory: ``(3 * splits + 1) * N`` fp32 for the per-split partial statistics, with
    ``splits = ceil(V / SPLIT_COLS)``.
    """
    N = labels.shape[0]
    V, H = weight.shape
    device = hidden.device
    out = torch.zeros((4, N), device=device, dtype=torch.float32)
    if N == 0:
        return out[0], out[1], out[2], out[3]
    cfg = pick_config(hidden.dtype, config)
    block_v = cfg["BLOCK_V"]
    cols_per_split = triton.cdiv(cfg["SPLIT_COLS"], block_v) * block_v
    num_splits = triton.cdiv(V, cols_per_split)
    part = torch.empty((3, num_splits, N), device=device, dtype=torch.float32)
    label_logit = torch.zeros(N, device=device, dtype=torch.float32)
    T, stride_hb, stride_ht, stride_hh = row_strides(hidden, "hidden")
    has_order = order is not None
    index = (order, count) if has_order else (labels, labels)
    with device_guard(hidden):
        linear_logprobs_fwd_kernel[(triton.cdiv(N, cfg["BLOCK_N"]) * num_splits,)](
            hidden, weight, bias if bias is not None else weight, *index, labels,
            part[0], part[1], part[2], label_logit,
            N, V, H, T, stride_hb, stride_ht, stride_hh, weight.stride(0), weight.stride(1),
            bias.stride(0) if bias is not None else 0,
            1.0 / float(temperature), cols_per_split, num_splits,
            HAS_BIAS=bias is not None, HAS_ORDER=has_order, EVEN_H=H % cfg["BLOCK_H"] == 0,
            UPCAST=upcast_dots(hidden, weight),
            BLOCK_N=cfg["BLOCK_N"], BLOCK_V=block_v, BLOCK_H=cfg["BLOCK_H"], GROUP_N=cfg["GROUP_N"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        linear_logprobs_combine_kernel[(triton.cdiv(N, COMBINE_BLOCK),)](
            *index, labels, part[0], part[1], part[2], label_logit, out[0], out[1], out[2], out[3],
            N, V, num_splits, HAS_ORDER=has_order, BLOCK=COMBINE_BLOCK, num_warps=4,
        )
    return out[0], out[1], out[2], out[3]


def _h100_configs() -> list:
    """Launch configurations the library uses on CUDA (read by ``h100_report``, which derives each signature
    from the kernel's parameter names: only the non-fp32 pointers, the fp32 scalars and the 16-divisible
    sizes are written here).

    bf16 operands (the production case) must use HGMMA. fp32 operands are multiplied exactly
    (``input_precision="ieee"``: FMA, no tensor cores, by design), so their rows only check spills.
    """
    out = []
    indices = {"order_ptr": "i64", "count_ptr": "i64", "labels_ptr": "i64"}
    for dtype, cfg, variants in (("bf16", CUDA_FWD_CONFIG, (False, True)), ("fp32", CUDA_FWD_CONFIG_FP32, (True,))):
        for has_bias in variants:
            out.append({
                "name": f"linear_logprobs_fwd{'_bias' if has_bias else ''}[{dtype}]",
                "fn": linear_logprobs_fwd_kernel,
                "pointers": {"hidden_ptr": dtype, "weight_ptr": dtype, **indices},
                "floats": ["inv_temperature"],
                "constexprs": {
                    "stride_hh": 1, "stride_wh": 1, "HAS_BIAS": has_bias, "HAS_ORDER": True, "EVEN_H": True,
                    "UPCAST": False, "BLOCK_N": cfg["BLOCK_N"], "BLOCK_V": cfg["BLOCK_V"], "BLOCK_H": cfg["BLOCK_H"],
                    "GROUP_N": cfg["GROUP_N"],
                },
                "num_warps": cfg["num_warps"],
                "num_stages": cfg["num_stages"],
                "uses_dot": dtype != "fp32",
                # the sizes/strides that are multiples of 16 for real models (H, H * T, H)
                "aligned_ints": ["H", "stride_hb", "stride_ht", "stride_wv"],
            })
    out.append({"name": "linear_logprobs_combine", "fn": linear_logprobs_combine_kernel, "pointers": indices,
                "constexprs": {"HAS_ORDER": True, "BLOCK": COMBINE_BLOCK}, "num_warps": 4, "num_stages": 1})
    return out


H100_CONFIGS = _h100_configs()
