"""Backward of the logits path: ``dlogits`` from the saved logsumexp, optionally in place.

For row ``t`` with ``x = logit / T``, ``p = exp(x - lse)``, label ``y``, incoming gradients
``g = dL/dlogp_t`` and ``h = dL/dH_t``::

    dL/dlogit[v] = (g / T) * (1[v = y] - p[v])  -  (h / T) * p[v] * (log p[v] + H_t)

(see docs/math.md, "Gradients"). One program per row, one streaming pass over the row. A row whose
``g`` and ``h`` are both zero (masked, clipped or zero-advantage tokens, or rows that were inactive in the
forward) is not read: the program only writes zeros. With the output pointing at the logits' own
storage (``inplace``), each tile is read before it is overwritten by the same program, so no extra
``[N, V]`` buffer is needed.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from gspo_kernels.backends.triton.logits_forward import MAX_BLOCK_V, NUM_WARPS, block_v, row_strides


@triton.jit
def _logprobs_bwd_kernel(
    logits_ptr,
    dlogits_ptr,
    labels_ptr,
    active_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    entropy_ptr,
    lse_ptr,
    rows_per_batch,
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
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    batch = row64 // rows_per_batch
    pos = row64 % rows_per_batch
    src = logits_ptr + batch * stride_b + pos * stride_t
    dst = dlogits_ptr + batch * dstride_b + pos * dstride_t
    cols = tl.arange(0, BLOCK_V)

    acc_dtype = lse_ptr.dtype.element_ty  # fp32 (fp64 for fp64 logits)
    g = 0.0
    h = 0.0
    if HAS_GRAD_LOGP:
        g = tl.load(grad_logp_ptr + row).to(acc_dtype) * inv_temperature
    if HAS_GRAD_ENTROPY:
        h = tl.load(grad_entropy_ptr + row).to(acc_dtype) * inv_temperature
    if HAS_ACTIVE:
        keep = tl.load(active_ptr + row) != 0
        g = tl.where(keep, g, 0.0)
        h = tl.where(keep, h, 0.0)

    if (g != 0.0) | (h != 0.0):
        lse = tl.load(lse_ptr + row)
        label = tl.load(labels_ptr + row)
        ent = 0.0
        if HAS_GRAD_ENTROPY:
            ent = tl.load(entropy_ptr + row)
        for start in range(0, vocab_size, BLOCK_V):
            idx = start + cols
            inside = idx < vocab_size
            x = tl.load(src + idx.to(tl.int64) * stride_v, mask=inside, other=0.0).to(acc_dtype)
            logp = x * inv_temperature - lse
            p = tl.exp(logp)
            grad = tl.where(idx == label, g, 0.0) - g * p
            if HAS_GRAD_ENTROPY:
                grad -= h * p * (logp + ent)
            tl.store(dst + idx.to(tl.int64) * dstride_v, grad.to(dlogits_ptr.dtype.element_ty), mask=inside)
    else:
        zeros = tl.zeros([BLOCK_V], dlogits_ptr.dtype.element_ty)
        for start in range(0, vocab_size, BLOCK_V):
            idx = start + cols
            tl.store(dst + idx.to(tl.int64) * dstride_v, zeros, mask=idx < vocab_size)


def logprobs_backward(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
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
        labels: ``[N]`` int64; ``lse``, ``entropy``: ``[N]`` from :func:`logprobs_forward` (their dtype, fp32 or
            fp64, is the compute dtype).
        grad_logp, grad_entropy: ``[N]`` incoming gradients (any float dtype) or None (= zero).
        active: ``[N]`` bool or None: rows with False get a zero gradient.
        inplace: write the gradient into ``logits`` itself (the caller's logits are consumed).
        out: optional preallocated gradient buffer shaped like ``logits`` (any strides).

    Returns:
        ``dlogits`` shaped like ``logits`` in its dtype: ``logits`` itself when ``inplace``.
    """
    if grad_entropy is not None and entropy is None:
        raise ValueError("grad_entropy needs the forward's entropy")
    if inplace:
        out = logits
    elif out is None:
        out = torch.empty(logits.shape, device=logits.device, dtype=logits.dtype)
    n_rows = labels.numel()
    if n_rows == 0 or logits.shape[-1] == 0:
        return out
    vocab_size = logits.shape[-1]
    rows_per_batch, stride_b, stride_t, stride_v = row_strides(logits)
    _, dstride_b, dstride_t, dstride_v = row_strides(out)
    _logprobs_bwd_kernel[(n_rows,)](
        logits,
        out,
        labels,
        active if active is not None else labels,
        grad_logp if grad_logp is not None else lse,
        grad_entropy if grad_entropy is not None else lse,
        entropy if entropy is not None else lse,
        lse,
        rows_per_batch,
        stride_b,
        stride_t,
        stride_v,
        dstride_b,
        dstride_t,
        dstride_v,
        vocab_size,
        1.0 / float(temperature),
        BLOCK_V=block_v(vocab_size),
        HAS_ACTIVE=active is not None,
        HAS_GRAD_LOGP=grad_logp is not None,
        HAS_GRAD_ENTROPY=grad_entropy is not None,
        num_warps=NUM_WARPS,
    )
    return out


def _config(dtype: str, has_grad_entropy: bool) -> dict:
    return {
        "name": f"logprobs_bwd[{dtype},{'dlogp+dH' if has_grad_entropy else 'dlogp'}]",
        "fn": _logprobs_bwd_kernel,
        "signature": {
            "logits_ptr": f"*{dtype}",
            "dlogits_ptr": f"*{dtype}",
            "labels_ptr": "*i64",
            "active_ptr": "*i1",
            "grad_logp_ptr": "*fp32",
            "grad_entropy_ptr": "*fp32",
            "entropy_ptr": "*fp32",
            "lse_ptr": "*fp32",
            "rows_per_batch": "i32",
            "stride_b": "i32",
            "stride_t": "i32",
            "stride_v": "constexpr",
            "dstride_b": "i32",
            "dstride_t": "i32",
            "dstride_v": "constexpr",
            "vocab_size": "i32",
            "inv_temperature": "fp32",
        },
        # Contiguous logits and gradient: the runtime specializes the unit vocabulary strides to constants.
        "constexprs": {
            "stride_v": 1,
            "dstride_v": 1,
            "BLOCK_V": MAX_BLOCK_V,
            "HAS_ACTIVE": True,
            "HAS_GRAD_LOGP": True,
            "HAS_GRAD_ENTROPY": has_grad_entropy,
        },
        # A fresh allocation with V % 16 == 0: 16-divisible pointers, row strides and vocabulary size.
        "aligned": ["logits_ptr", "dlogits_ptr", "labels_ptr", "active_ptr", "grad_logp_ptr", "grad_entropy_ptr",
                    "entropy_ptr", "lse_ptr", "stride_b", "stride_t", "dstride_b", "dstride_t", "vocab_size"],
        "vector_loads": True,
        "num_warps": NUM_WARPS,
        "num_stages": 3,
    }


# Launch configurations for the static H100 report (see gspo_kernels/tools/h100_report.py).
H100_CONFIGS = [_config("bf16", False), _config("bf16", True), _config("fp16", False), _config("fp32", True)]
