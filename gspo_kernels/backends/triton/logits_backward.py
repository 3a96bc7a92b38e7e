"""Backward of the logits path: ``dlogits`` from the forward's saved row statistics, optionally in place.

For row ``t`` with raw logits ``z``, ``log p = (z - m) / T - log S`` (``m``, ``log S``: the forward's
``stats``), label ``y``, incoming gradients ``g = dL/dlogp_t`` and ``h = dL/dH_t``::

    dL/dz[v] = (g / T) * (1[v = y] - p[v])  -  (h / T) * p[v] * (log p[v] + H_t)

(see docs/math.md, "Gradients"). The entropy term is 0 where ``p[v] == 0`` (a ``-inf`` logit: ``0 * -inf``
would be NaN). One program per *output* row, one streaming pass over the row. A row whose ``g`` and ``h``
are both zero (masked, clipped or zero-advantage tokens, or rows that were inactive in the forward) is not
read: the program only writes zeros.

Shifted logits: the gradient may have more positions per sequence than the logits (``out_rows_per_batch =
rows_per_batch + 1``): a model's ``[B, T + 1, V]`` output read as ``logits[:, :-1]`` gets its gradient for
all ``T + 1`` positions in one launch, zeros at the last one, so autograd's ``slice_backward`` never
allocates a second ``[B, T + 1, V]`` buffer. With the output pointing at the logits' own storage
(``inplace``), each tile is read before it is overwritten by the same program: no extra buffer at all.

A label outside ``[0, V)`` (possible only when the eager check was skipped, e.g. under ``torch.compile``)
is never used as an address; such a row's gradient is NaN when its log-prob carries gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from gspo_kernels.backends.triton import device_guard
from gspo_kernels.backends.triton.addressing import row_strides
from gspo_kernels.backends.triton.logits_forward import (
    _ELEMENT_SIZES,
    NUM_STAGES,
    NUM_WARPS,
    block_v,
)


@triton.jit
def _logprobs_bwd_kernel(
    logits_ptr,
    dlogits_ptr,
    labels_ptr,
    active_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    entropy_ptr,
    stats_ptr,
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
    inv_temperature,
    BLOCK_V: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
):
    out_row = tl.program_id(0).to(tl.int64)
    batch = out_row // out_rows_per_batch
    pos = out_row % out_rows_per_batch
    in_range = pos < rows_per_batch  # False only at the extra position of shifted logits
    row = tl.where(in_range, batch * rows_per_batch + pos, 0)  # the token's index in [N]
    src = logits_ptr + batch * stride_b + pos * stride_t
    dst = dlogits_ptr + batch * dstride_b + pos * dstride_t
    cols = tl.arange(0, BLOCK_V)

    acc_dtype = stats_ptr.dtype.element_ty  # fp32 (fp64 for fp64 logits)
    g = 0.0
    h = 0.0
    if HAS_GRAD_LOGP:
        g = tl.load(grad_logp_ptr + row).to(acc_dtype) * inv_temperature
    if HAS_GRAD_ENTROPY:
        h = tl.load(grad_entropy_ptr + row).to(acc_dtype) * inv_temperature
    keep = in_range
    if HAS_ACTIVE:
        keep = keep & (tl.load(active_ptr + row) != 0)
    g = tl.where(keep, g, 0.0)
    h = tl.where(keep, h, 0.0)

    if (g != 0.0) | (h != 0.0):
        m = tl.load(stats_ptr + row)
        log_s = tl.load(stats_ptr + n_rows + row)
        label = tl.load(labels_ptr + row)
        # An out-of-range label never matches a column; the row is poisoned instead (its logp is NaN).
        g_bad = tl.where((g != 0.0) & ((label < 0) | (label >= vocab_size)), float("nan"), 0.0)
        ent = 0.0
        if HAS_GRAD_ENTROPY:
            ent = tl.load(entropy_ptr + row)
        for start in range(0, vocab_size, BLOCK_V):
            idx = start + cols
            inside = idx < vocab_size
            z = tl.load(src + idx.to(tl.int64) * stride_v, mask=inside, other=0.0).to(acc_dtype)
            logp = (z - m) * inv_temperature - log_s
            p = tl.exp(logp)
            grad = tl.where(idx == label, g, 0.0) - g * p + g_bad
            if HAS_GRAD_ENTROPY:
                grad -= tl.where(p > 0, h * p * (logp + ent), 0.0)
            tl.store(dst + idx.to(tl.int64) * dstride_v, grad.to(dlogits_ptr.dtype.element_ty), mask=inside)
    else:
        zeros = tl.zeros([BLOCK_V], dlogits_ptr.dtype.element_ty)
        for start in range(0, vocab_size, BLOCK_V):
            idx = start + cols
            tl.store(dst + idx.to(tl.int64) * dstride_v, zeros, mask=idx < vocab_size)


def logprobs_backward(
    logits: Tensor,
    labels: Tensor,
    stats: Tensor,
    entropy: Optional[Tensor],
    grad_logp: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    inplace: bool = False,
    out: Optional[Tensor] = None,
) -> Tensor:
    """Launch the backward kernel.

    Args:
        logits: the forward's logits, ``[N, V]`` or ``[B, T, V]``, any strides.
        labels: ``[N]`` int64; ``stats [2, N]``, ``entropy [N]``: from :func:`logprobs_forward` (their dtype,
            fp32 or fp64, is the compute dtype).
        grad_logp, grad_entropy: ``[N]`` incoming gradients (any float dtype) or None (= zero).
        active: ``[N]`` bool or None: rows with False get a zero gradient.
        inplace: write the gradient into ``out`` when given (a tensor whose storage holds ``logits``, e.g. the
            ``[B, T + 1, V]`` base of a ``[:, :-1]`` view), else into ``logits`` itself; the caller's logits are
            consumed.
        out: the gradient buffer (any strides): shaped like ``logits``, or ``[B, T + 1, V]`` for 3-D
            ``[B, T, V]`` logits, in which case position ``T`` of every sequence gets zeros. Default: a new
            tensor shaped like ``logits`` (or ``logits`` itself when ``inplace``).

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
    shifted = logits.dim() == 3 and tuple(out.shape) == (logits.shape[0], logits.shape[1] + 1, vocab_size)
    if tuple(out.shape) != tuple(logits.shape) and not shifted:
        raise ValueError(f"out must be shaped like logits {tuple(logits.shape)} (or [B, T + 1, V]), "
                         f"got {tuple(out.shape)}")
    if not shifted:
        out_rows_per_batch = rows_per_batch
    n_out_rows = out.numel() // vocab_size
    if n_rows == 0:  # every out row is an extra (shifted) position, or there is none
        out.zero_()
        return out
    with device_guard(out):
        _logprobs_bwd_kernel[(n_out_rows,)](
            logits,
            out,
            labels,
            active if active is not None else labels,
            grad_logp if grad_logp is not None else stats,
            grad_entropy if grad_entropy is not None else stats,
            entropy if entropy is not None else stats,
            stats,
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
            1.0 / float(temperature),
            BLOCK_V=block_v(vocab_size, logits.element_size()),
            HAS_ACTIVE=active is not None,
            HAS_GRAD_LOGP=grad_logp is not None,
            HAS_GRAD_ENTROPY=grad_entropy is not None,
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )
    return out


def _config(dtype: str, has_grad_entropy: bool) -> dict:
    return {
        "name": f"logprobs_bwd[{dtype},{'dlogp+dH' if has_grad_entropy else 'dlogp'}]",
        "fn": _logprobs_bwd_kernel,
        # Everything else is derived from the kernel's argument names (h100_report.derive_signature):
        # *_ptr -> "*fp32" unless listed here, the other arguments i32 unless listed in "floats".
        "pointers": {"logits_ptr": dtype, "dlogits_ptr": dtype, "labels_ptr": "i64", "active_ptr": "i1"},
        "floats": ["inv_temperature"],
        # Contiguous logits and gradient: the runtime specializes the unit vocabulary strides to constants.
        "constexprs": {
            "stride_v": 1,
            "dstride_v": 1,
            "BLOCK_V": block_v(1 << 20, _ELEMENT_SIZES[dtype]),
            "HAS_ACTIVE": True,
            "HAS_GRAD_LOGP": True,
            "HAS_GRAD_ENTROPY": has_grad_entropy,
        },
        # A fresh allocation with V % 16 == 0: 16-divisible pointers, row strides and vocabulary size.
        "aligned_ints": ["stride_b", "stride_t", "dstride_b", "dstride_t", "vocab_size"],
        "vector_loads": True,
        "num_warps": NUM_WARPS,
        "num_stages": NUM_STAGES,
    }


# Launch configurations for the static H100 report (see gspo_kernels/tools/h100_report.py).
H100_CONFIGS = [_config("bf16", False), _config("bf16", True), _config("fp16", False), _config("fp32", True)]
