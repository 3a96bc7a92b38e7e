"""Forward of the logits path: per-token log-prob of the label, entropy and logsumexp in one read.

Each program owns one row (token) of the caller's logits, ``[N, V]`` or ``[B, T, V]`` with any strides
(e.g. ``logits[:, :-1]`` of a model output, never copied). It streams the row once in ``BLOCK_V`` tiles,
keeping running statistics of ``x = logit / temperature`` in fp32 (fp64 for fp64 logits):

* ``m``: the row's running max (one per row, so each element costs a single ``exp``);
* per lane: ``s = sum exp(x - m)`` and ``a = sum exp(x - m) * (x - m)``.

When a tile moves the max from ``m`` to ``m'`` the lanes' sums are rescaled:
``s' = e^(m - m') s`` and ``a' = e^(m - m') (a + (m - m') s)``. At the end ``S = sum_lanes s``,
``lse = m + log S``, ``H = log S - A / S`` (entropy without the cancellation of ``lse - E[x]``) and
``logp = x[label] - lse``. Rows whose ``active`` flag is False are not read; their outputs are 0.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

# A finite "minus infinity" for the running max: exp(_NEG_BIG - m) is 0 and (_NEG_BIG - m) * 0 is 0 (no NaN).
_NEG_BIG = tl.constexpr(-1.0e30)
MAX_BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr,
    labels_ptr,
    active_ptr,
    logp_ptr,
    entropy_ptr,
    lse_ptr,
    rows_per_batch,
    stride_b,
    stride_t,
    stride_v,
    vocab_size,
    inv_temperature,
    BLOCK_V: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0)
    if HAS_ACTIVE:
        is_active = tl.load(active_ptr + row) != 0
    else:
        is_active = True
    if is_active:
        row64 = row.to(tl.int64)
        base = logits_ptr + (row64 // rows_per_batch) * stride_b + (row64 % rows_per_batch) * stride_t
        cols = tl.arange(0, BLOCK_V)
        acc_dtype = logp_ptr.dtype.element_ty  # fp32 (fp64 for fp64 logits)
        m = tl.full([], _NEG_BIG, acc_dtype)  # one running max per row: one exp per element
        s = tl.zeros([BLOCK_V], acc_dtype)  # per-lane sums, reduced once at the end
        a = tl.zeros([BLOCK_V], acc_dtype)
        for start in range(0, vocab_size, BLOCK_V):
            idx = start + cols
            x = tl.load(base + idx.to(tl.int64) * stride_v, mask=idx < vocab_size, other=float("-inf"))
            x = x.to(acc_dtype) * inv_temperature
            m_new = tl.maximum(m, tl.max(x, axis=0))
            scale = tl.exp(m - m_new)
            e = tl.exp(x - m_new)
            if HAS_ENTROPY:
                # e == 0 where x = -inf (padding or a -inf logit): its p log p term is 0, not NaN.
                a = scale * (a + (m - m_new) * s) + e * tl.where(e > 0, x - m_new, 0.0)
            s = s * scale + e
            m = m_new
        s_row = tl.sum(s, axis=0)
        lse = m + tl.log(s_row)
        label = tl.load(labels_ptr + row)
        x_label = tl.load(base + label * stride_v).to(acc_dtype) * inv_temperature
        tl.store(logp_ptr + row, x_label - lse)
        tl.store(lse_ptr + row, lse)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, tl.log(s_row) - tl.sum(a, axis=0) / s_row)
    else:
        tl.store(logp_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)


def block_v(vocab_size: int) -> int:
    """Tile width over the vocabulary: the whole row up to ``MAX_BLOCK_V`` (a power of two)."""
    return min(MAX_BLOCK_V, triton.next_power_of_2(max(int(vocab_size), 1)))


def row_strides(logits: Tensor) -> Tuple[int, int, int, int]:
    """``(rows_per_batch, stride_b, stride_t, stride_v)`` addressing row ``r`` of ``[N, V]`` / ``[B, T, V]``.

    Row ``r`` starts at ``(r // rows_per_batch) * stride_b + (r % rows_per_batch) * stride_t``.
    """
    if logits.dim() == 2:
        return max(logits.shape[0], 1), 0, logits.stride(0), logits.stride(1)
    if logits.dim() == 3:
        return max(logits.shape[1], 1), logits.stride(0), logits.stride(1), logits.stride(2)
    raise ValueError(f"logits must be [N, V] or [B, T, V], got shape {tuple(logits.shape)}")


def logprobs_forward(
    logits: Tensor,
    labels: Tensor,
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = True,
    out: Optional[Tuple[Tensor, Optional[Tensor], Tensor]] = None,
) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """Launch the forward kernel.

    Args:
        logits: ``[N, V]`` or ``[B, T, V]``, fp16/bf16/fp32, any strides (read in place).
        labels: ``[N]`` int64 in ``[0, V)`` (``N = B * T`` for the 3-D form).
        active: ``[N]`` bool or None; rows with False are not read and get 0 outputs.
        temperature: logits are divided by it.
        return_entropy: also compute the entropy.
        out: optional preallocated ``(logp, entropy or None, lse)`` ``[N]`` fp32 buffers.

    Returns:
        ``(logp [N], entropy [N] or None, lse [N])``, fp32 (fp64 for fp64 logits; the temperature is an fp32
        scalar either way), where ``lse = logsumexp(logits / T)``.
    """
    vocab_size = logits.shape[-1]
    n_rows = labels.numel()
    if logits.numel() // max(vocab_size, 1) != n_rows and logits.numel() != 0:
        raise ValueError(f"logits {tuple(logits.shape)} do not hold one row per label ({n_rows} labels)")
    if out is None:
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logp = torch.empty(n_rows, device=logits.device, dtype=acc)
        entropy = torch.empty_like(logp) if return_entropy else None
        lse = torch.empty_like(logp)
    else:
        logp, entropy, lse = out
    if n_rows == 0:
        return logp, entropy, lse
    labels = labels.reshape(-1)
    if labels.dtype != torch.int64:
        labels = labels.to(torch.int64)
    rows_per_batch, stride_b, stride_t, stride_v = row_strides(logits)
    _logprobs_fwd_kernel[(n_rows,)](
        logits,
        labels,
        active if active is not None else labels,
        logp,
        entropy if return_entropy else logp,
        lse,
        rows_per_batch,
        stride_b,
        stride_t,
        stride_v,
        vocab_size,
        1.0 / float(temperature),
        BLOCK_V=block_v(vocab_size),
        HAS_ACTIVE=active is not None,
        HAS_ENTROPY=return_entropy,
        num_warps=NUM_WARPS,
    )
    return logp, entropy, lse


def _config(dtype: str, has_active: bool, has_entropy: bool) -> dict:
    return {
        "name": f"logprobs_fwd[{dtype},{'active' if has_active else 'all'},{'H' if has_entropy else 'noH'}]",
        "fn": _logprobs_fwd_kernel,
        "signature": {
            "logits_ptr": f"*{dtype}",
            "labels_ptr": "*i64",
            "active_ptr": "*i1",
            "logp_ptr": "*fp32",
            "entropy_ptr": "*fp32",
            "lse_ptr": "*fp32",
            "rows_per_batch": "i32",
            "stride_b": "i32",
            "stride_t": "i32",
            "stride_v": "constexpr",
            "vocab_size": "i32",
            "inv_temperature": "fp32",
        },
        # A contiguous [N, V] or [B, T, V] tensor: the runtime specializes stride_v == 1 to a constant.
        "constexprs": {"stride_v": 1, "BLOCK_V": MAX_BLOCK_V, "HAS_ACTIVE": has_active, "HAS_ENTROPY": has_entropy},
        # What the runtime sees for a fresh allocation with V % 16 == 0 (Qwen, Llama-3, Gemma-3 vocabularies):
        # 16-divisible pointers, row strides and vocabulary size, which is what lets the loads use 128 bits.
        "aligned": ["logits_ptr", "labels_ptr", "active_ptr", "logp_ptr", "entropy_ptr", "lse_ptr", "stride_b",
                    "stride_t", "vocab_size"],
        "vector_loads": True,
        "num_warps": NUM_WARPS,
        "num_stages": 3,
    }


# Launch configurations for the static H100 report (see gspo_kernels/tools/h100_report.py).
H100_CONFIGS = [
    _config("bf16", True, True),
    _config("bf16", False, False),
    _config("fp16", True, True),
    _config("fp32", True, True),
]
