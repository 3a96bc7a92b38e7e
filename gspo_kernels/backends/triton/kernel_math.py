"""The math the Triton kernel modules share: the fast base-2 exponential and the final-logit soft cap
(``@triton.jit`` helpers), and their host side: the bias the kernels add."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

# tanh, |u| < _TANH_SMALL: its odd Taylor series to u^13 (next term < 3e-10 relative there); otherwise
# (1 - t) / (1 + t), t = exp(-2 |u|) = exp2(-2 log2(e) |u|), whose rounding stays ~2e-7 relative for |u| >= 0.35.
_TANH_SMALL = tl.constexpr(0.35)
_TANH_C3 = tl.constexpr(-1.0 / 3.0)
_TANH_C5 = tl.constexpr(2.0 / 15.0)
_TANH_C7 = tl.constexpr(-17.0 / 315.0)
_TANH_C9 = tl.constexpr(62.0 / 2835.0)
_TANH_C11 = tl.constexpr(-1382.0 / 155925.0)
_TANH_C13 = tl.constexpr(21844.0 / 6081075.0)
_MINUS_2_LOG2E = tl.constexpr(-2.8853900817779268)


@triton.jit
def exp2(x, FAST_MATH: tl.constexpr):
    """``2 ** x``. ``FAST_MATH`` (CUDA): libdevice's ``exp2f``, one ``MUFU.EX2`` (``ex2.approx.ftz``: results
    below 2^-126 flush to 0, ~2 ulp); ``tl.exp2`` lowers to the same instruction wrapped in 3 more that keep
    denormal results. The interpreter (no libdevice) uses ``tl.exp2``."""
    if FAST_MATH:
        return libdevice.exp2(x)
    else:
        return tl.exp2(x)


@triton.jit
def soft_cap(z, inv_cap, cap, FAST_MATH: tl.constexpr, WITH_SLOPE: tl.constexpr):
    """``(cap * tanh(z / cap), 1 - tanh^2(z / cap))`` elementwise (the slope is 1.0, unused, without
    ``WITH_SLOPE``). One formula on every target (no libdevice ``tanh``, which the interpreter lacks): a Taylor
    polynomial near 0, ``(1 - t) / (1 + t)`` with ``t = e^{-2|u|}`` elsewhere (the slope as ``4 t / (1 + t)^2``,
    exact near saturation). ``z = -inf`` gives ``-cap`` (slope 0)."""
    u = z * inv_cap
    au = tl.abs(u)
    u2 = u * u
    poly = _TANH_C3 + u2 * (_TANH_C5 + u2 * (_TANH_C7 + u2 * (_TANH_C9 + u2 * (_TANH_C11 + u2 * _TANH_C13))))
    th_small = au + au * (u2 * poly)
    t = exp2(au * _MINUS_2_LOG2E, FAST_MATH)
    if FAST_MATH and t.dtype == tl.float32:  # 1 + t in [1, 2]: an approximate division (2 ulp), no range checks
        r = libdevice.fast_dividef(1.0, 1.0 + t)
    else:
        r = 1.0 / (1.0 + t)
    small = au < _TANH_SMALL
    th = tl.where(small, th_small, (1.0 - t) * r)
    capped = tl.where(u < 0, -th, th) * cap
    slope = 1.0
    if WITH_SLOPE:
        slope = tl.where(small, 1.0 - th_small * th_small, 4.0 * t * (r * r))
    return capped, slope


def kernel_bias(bias: Optional[Tensor], softcap: Optional[float], dtype: torch.dtype = torch.float32
                ) -> Optional[Tensor]:
    """The bias the kernels add: :func:`max_subtracted_bias` without a soft cap; with one, the bias itself in
    ``dtype`` (``tanh`` does not commute with a shift, and the capped logits are bounded by the cap anyway)."""
    if bias is None or softcap is None:
        return max_subtracted_bias(bias, dtype)
    return bias.to(dtype)


def max_subtracted_bias(bias: Optional[Tensor], dtype: torch.dtype = torch.float32) -> Optional[Tensor]:
    """``bias - max(finite bias)`` in ``dtype`` (fp32; fp64 for the vendor path's fp64 operands): the same
    softmax, small logits (``1e4`` offsets lose no bits)."""
    if bias is None:
        return None
    b = bias.to(dtype)
    finite = torch.where(torch.isfinite(b), b, torch.full_like(b, float("-inf")))
    top = finite.max() if b.numel() else torch.zeros((), dtype=b.dtype, device=b.device)
    return b - torch.where(torch.isfinite(top), top, torch.zeros_like(top))
