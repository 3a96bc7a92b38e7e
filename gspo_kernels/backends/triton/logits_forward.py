"""Forward of the logits path: per-token log-prob of the label and entropy in one read.

Each program owns one row (token) of the caller's logits, ``[N, V]`` or ``[B, T, V]`` with any strides
(e.g. ``logits[:, :-1]`` of a model output, never copied). It streams the row once in ``BLOCK_V`` tiles and
keeps, in fp32 (fp64 for fp64 logits; the temperature is an fp32 scalar either way):

* ``m``: the running max of the *raw* logits ``z`` (one per row, so each element costs a single ``exp``);
* per lane, with ``x = (z - m) / T``: ``s = sum exp(x)`` and ``a = sum exp(x) * x``.

When a tile moves the max from ``m`` to ``m'`` (``d = (m - m') / T``) the lanes' sums are rescaled:
``s' = e^d s`` and ``a' = e^d (a + d s)``. At the end ``S = sum_lanes s``, ``log S``,
``H = log S - A / S`` (entropy without the cancellation of ``lse - E[x]``) and
``logp = (z_y - m) / T - log S``.

Two precision choices (see docs/gpu.md):

* the max is subtracted from the raw logit *before* the division by the temperature, so ``z - m`` is exact
  for logits close to the max (Sterbenz) however large their offset (``randn + 1e4``) and however small
  the temperature (``1e-6``);
* the row's max ``m`` and ``log S`` are kept apart (``stats [2, N]``) instead of one fp32
  ``lse = m / T + log S``: a single fp32 ``lse`` near ``1e4`` carries an absolute rounding error of
  ``~5e-4``, which every ``p = exp(x - lse)`` of the backward would inherit.

The kernel issues the load of tile ``k + 1`` before the block reductions of tile ``k`` (a software
prefetch held in registers), so a row always has a tile of reads in flight while it reduces.

Labels are bounds-checked in the kernel: a label outside ``[0, V)`` (e.g. an unmasked ``-100`` when the
eager check is skipped under ``torch.compile``) is never read; that row's log-prob is NaN. Rows whose
``active`` flag is False are not read; their outputs are 0.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from gspo_kernels.backends.triton import device_guard
from gspo_kernels.backends.triton.addressing import row_strides

# A finite "minus infinity" for the running max: exp((_NEG_BIG - m) / T) is 0 (no NaN from -inf - -inf).
_NEG_BIG = tl.constexpr(-1.0e30)
MAX_BLOCK_V = 4096
# One tile is at most 8 KiB of logits (4096 bf16/fp16, 2048 fp32, 1024 fp64 values): with the prefetched next
# tile in registers, fp32 rows at 4096 would take 98 registers per thread (2 blocks of 8 warps per SM instead
# of 3); at 2048 they stay near the bf16 kernel's count.
MAX_TILE_BYTES = 8192
NUM_WARPS = 8
NUM_STAGES = 3


@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr,
    labels_ptr,
    active_ptr,
    logp_ptr,
    entropy_ptr,
    stats_ptr,
    n_rows,
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
        m = tl.full([], _NEG_BIG, acc_dtype)  # running max of the raw logits: one exp per element
        s = tl.zeros([BLOCK_V], acc_dtype)  # per-lane sums, reduced once at the end
        a = tl.zeros([BLOCK_V], acc_dtype)
        z_next = tl.load(base + cols.to(tl.int64) * stride_v, mask=cols < vocab_size, other=float("-inf"))
        for start in range(0, vocab_size, BLOCK_V):
            z = z_next.to(acc_dtype)
            # Prefetch: the next tile's load is issued before this tile's reductions (masked off past V).
            nxt = start + BLOCK_V + cols
            z_next = tl.load(base + nxt.to(tl.int64) * stride_v, mask=nxt < vocab_size, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            d = (m - m_new) * inv_temperature  # <= 0
            scale = tl.exp(d)
            x = (z - m_new) * inv_temperature  # exact difference, then one rounding by the temperature
            e = tl.exp(x)
            if HAS_ENTROPY:
                # e == 0 where z = -inf (padding or a -inf logit): its p log p term is 0, not NaN; a rescale
                # by e^d == 0 (d = -inf at tiny temperatures) empties the old sums instead of 0 * -inf.
                a = tl.where(scale > 0, scale * (a + d * s), 0.0) + e * tl.where(e > 0, x, 0.0)
            s = s * scale + e
            m = m_new
        log_s = tl.log(tl.sum(s, axis=0))
        label = tl.load(labels_ptr + row)
        valid = (label >= 0) & (label < vocab_size)
        z_label = tl.load(base + tl.where(valid, label, 0) * stride_v, mask=valid, other=0.0).to(acc_dtype)
        logp = (z_label - m) * inv_temperature - log_s
        tl.store(logp_ptr + row, tl.where(valid, logp, float("nan")))
        tl.store(stats_ptr + row, m)
        tl.store(stats_ptr + n_rows + row, log_s)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, log_s - tl.sum(a, axis=0) / tl.sum(s, axis=0))
    else:
        tl.store(logp_ptr + row, 0.0)
        tl.store(stats_ptr + row, 0.0)
        tl.store(stats_ptr + n_rows + row, 0.0)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)


def block_v(vocab_size: int, element_size: int = 2) -> int:
    """Tile width over the vocabulary: the whole row up to ``MAX_TILE_BYTES`` of ``element_size``-byte logits
    (a power of two, at most ``MAX_BLOCK_V``)."""
    widest = min(MAX_BLOCK_V, MAX_TILE_BYTES // max(int(element_size), 1))
    return min(widest, triton.next_power_of_2(max(int(vocab_size), 1)))


def logsumexp_from_stats(stats: Tensor, temperature: float = 1.0) -> Tensor:
    """``logsumexp(logits / T)`` per row from the forward's ``stats [2, N]`` (``m / T + log S``)."""
    return stats[0] / temperature + stats[1]


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
        logits: ``[N, V]`` or ``[B, T, V]``, fp16/bf16/fp32/fp64, any strides (read in place).
        labels: ``[N]`` int64; a label outside ``[0, V)`` is not read and gives a NaN log-prob.
        active: ``[N]`` bool or None; rows with False are not read and get 0 outputs.
        temperature: logits are divided by it (> 0).
        return_entropy: also compute the entropy.
        out: optional preallocated ``(logp [N], entropy [N] or None, stats [2, N])`` buffers.

    Returns:
        ``(logp [N], entropy [N] or None, stats [2, N])``, fp32 (fp64 for fp64 logits, computed in fp64; the
        temperature is an fp32 scalar either way). ``stats[0]`` is the row's max raw logit ``m`` and
        ``stats[1]`` is ``log S = log sum exp((z - m) / T)``: the backward's ``log p = (z - m) / T - log S``.
    """
    vocab_size = logits.shape[-1]
    n_rows = labels.numel()
    if logits.numel() // max(vocab_size, 1) != n_rows and logits.numel() != 0:
        raise ValueError(f"logits {tuple(logits.shape)} do not hold one row per label ({n_rows} labels)")
    if out is None:
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logp = torch.empty(n_rows, device=logits.device, dtype=acc)
        entropy = torch.empty_like(logp) if return_entropy else None
        stats = torch.empty((2, n_rows), device=logits.device, dtype=acc)
    else:
        logp, entropy, stats = out
    if n_rows == 0:
        return logp, entropy, stats
    labels = labels.reshape(-1)
    if labels.dtype != torch.int64:
        labels = labels.to(torch.int64)
    rows_per_batch, stride_b, stride_t, stride_v = row_strides(logits, "logits")
    with device_guard(logits):
        _logprobs_fwd_kernel[(n_rows,)](
            logits,
            labels,
            active if active is not None else labels,
            logp,
            entropy if return_entropy else logp,
            stats,
            n_rows,
            rows_per_batch,
            stride_b,
            stride_t,
            stride_v,
            vocab_size,
            1.0 / float(temperature),
            BLOCK_V=block_v(vocab_size, logits.element_size()),
            HAS_ACTIVE=active is not None,
            HAS_ENTROPY=return_entropy,
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )
    return logp, entropy, stats


_ELEMENT_SIZES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}


def _config(dtype: str, has_active: bool, has_entropy: bool) -> dict:
    return {
        "name": f"logprobs_fwd[{dtype},{'active' if has_active else 'all'},{'H' if has_entropy else 'noH'}]",
        "fn": _logprobs_fwd_kernel,
        # Everything else is derived from the kernel's argument names (h100_report.derive_signature):
        # *_ptr -> "*fp32" unless listed here, the other arguments i32 unless listed in "floats".
        "pointers": {"logits_ptr": dtype, "labels_ptr": "i64", "active_ptr": "i1"},
        "floats": ["inv_temperature"],
        # A contiguous [N, V] or [B, T, V] tensor: the runtime specializes stride_v == 1 to a constant.
        "constexprs": {"stride_v": 1, "BLOCK_V": block_v(1 << 20, _ELEMENT_SIZES[dtype]), "HAS_ACTIVE": has_active,
                       "HAS_ENTROPY": has_entropy},
        # What the runtime sees for a fresh allocation with V % 16 == 0 (Qwen, Llama-3, Gemma-3 vocabularies):
        # 16-divisible pointers, row strides and vocabulary size, which is what lets the loads use 128 bits.
        "aligned_ints": ["stride_b", "stride_t", "vocab_size"],
        "vector_loads": True,
        "num_warps": NUM_WARPS,
        "num_stages": NUM_STAGES,
    }


# Launch configurations for the static H100 report (see gspo_kernels/tools/h100_report.py).
H100_CONFIGS = [
    _config("bf16", True, True),
    _config("bf16", False, False),
    _config("fp16", True, True),
    _config("fp32", True, True),
]
