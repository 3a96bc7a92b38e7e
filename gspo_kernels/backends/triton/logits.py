"""The logits path: ``(logits [N, V] | [B, T, V], labels [N]) -> (logp [N], entropy [N])`` and its gradient.

Forward (:func:`logprobs_fwd_kernel`, launched by :func:`logprobs_forward`). Each program owns one row
(token) of the caller's logits, any strides (e.g. ``logits[:, :-1]`` of a model output, never copied). It
streams the row once in ``BLOCK_V`` tiles and keeps, in fp32 (fp64 for fp64 logits; the temperature is an
fp32 scalar either way):

* ``row_max``: the running max of the *raw* logits ``z`` (one per row, so each element costs a single ``exp``);
* per lane, with ``x = (z - row_max) / T``: ``s = sum exp(x)`` and ``a = sum exp(x) * x``.

When a tile moves the max from ``m`` to ``m'`` (``d = (m - m') / T``) the lanes' sums are rescaled:
``s' = e^d s`` and ``a' = e^d (a + d s)``. At the end ``S = sum_lanes s``, ``log S``,
``H = log S - A / S`` (entropy without the cancellation of ``lse - E[x]``) and
``logp = (z_y - row_max) / T - log S``.

Two precision choices (see docs/gpu.md):

* the max is subtracted from the raw logit *before* the division by the temperature, so ``z - row_max`` is
  exact for logits close to the max (Sterbenz) however large their offset (``randn + 1e4``) and however
  small the temperature (``1e-6``);
* the row's max and ``log S`` are kept apart (``row_stats [2, N]``) instead of one fp32
  ``lse = row_max / T + log S``: a single fp32 ``lse`` near ``1e4`` carries an absolute rounding error of
  ``~5e-4``, which every ``p = exp(x - lse)`` of the backward would inherit.

The kernel issues the load of tile ``k + 1`` before the block reductions of tile ``k`` (a software
prefetch held in registers), so a row always has a tile of reads in flight while it reduces.

Backward (:func:`logprobs_bwd_kernel`, launched by :func:`logprobs_backward`). For row ``t`` with
``log p = (z - row_max) / T - log S``, label ``y``, incoming gradients ``g = dL/dlogp_t`` and ``h = dL/dH_t``::

    dL/dz[v] = (g / T) * (1[v = y] - p[v])  -  (h / T) * p[v] * (log p[v] + H_t)

(see docs/math.md, "Gradients"). The entropy term is 0 where ``p[v] == 0`` (a ``-inf`` logit: ``0 * -inf``
would be NaN). One program per *output* row, one streaming pass over the row. A row whose ``g`` and ``h``
are both zero (masked, clipped or zero-advantage tokens, or rows that were inactive in the forward) is not
read: the program only writes zeros.

Extra position: the gradient may have one more position per sequence than the logits
(``out_rows_per_batch = rows_per_batch + 1``): a model's ``[B, T + 1, V]`` output read as ``logits[:, :-1]``
gets its gradient for all ``T + 1`` positions in one launch, zeros at the last one, so autograd's
``slice_backward`` never allocates a second ``[B, T + 1, V]`` buffer (:func:`next_token_base`). With the
output pointing at the logits' own storage (``inplace``), each tile is read before it is overwritten by the
same program: no extra buffer at all.

Labels are bounds-checked in the kernels: a label outside ``[0, V)`` (e.g. an unmasked ``-100`` when the
eager check is skipped under ``torch.compile``) is never used as an address; that row's log-prob (and its
gradient, when it carries one) is NaN. Rows whose ``active`` flag is False are not read; their outputs are 0.

:class:`TritonLogitsLogprobs` (autograd) saves only ``[N]`` tensors (labels, active, ``row_stats``,
entropy) plus a reference to the logits; ``inplace_backward=True`` writes the gradient into the logits'
storage (the caller's logits are consumed).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from gspo_kernels.backends.triton.configs import LOGITS_NUM_STAGES, LOGITS_NUM_WARPS, logits_block_v
from gspo_kernels.backends.triton.launch import device_guard, row_strides

# A finite "minus infinity" for the running max: exp((_NEG_BIG - m) / T) is 0 (no NaN from -inf - -inf).
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def logprobs_fwd_kernel(
    logits_ptr, labels_ptr, active_ptr, logp_ptr, entropy_ptr,
    row_stats_ptr,  # [2, N]: the row's max raw logit, then log S
    n_rows, rows_per_batch, stride_b, stride_t, stride_v, vocab_size, inv_temperature,
    BLOCK_V: tl.constexpr, HAS_ACTIVE: tl.constexpr, HAS_ENTROPY: tl.constexpr,
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
        row_max = tl.full([], _NEG_BIG, acc_dtype)  # running max of the raw logits: one exp per element
        s = tl.zeros([BLOCK_V], acc_dtype)  # per-lane sums, reduced once at the end
        a = tl.zeros([BLOCK_V], acc_dtype)
        z_next = tl.load(base + cols.to(tl.int64) * stride_v, mask=cols < vocab_size, other=float("-inf"))
        for start in range(0, vocab_size, BLOCK_V):
            z = z_next.to(acc_dtype)
            # Prefetch: the next tile's load is issued before this tile's reductions (masked off past V).
            nxt = start + BLOCK_V + cols
            z_next = tl.load(base + nxt.to(tl.int64) * stride_v, mask=nxt < vocab_size, other=float("-inf"))
            new_max = tl.maximum(row_max, tl.max(z, axis=0))
            d = (row_max - new_max) * inv_temperature  # <= 0
            scale = tl.exp(d)
            x = (z - new_max) * inv_temperature  # exact difference, then one rounding by the temperature
            e = tl.exp(x)
            if HAS_ENTROPY:
                # e == 0 where z = -inf (padding or a -inf logit): its p log p term is 0, not NaN; a rescale
                # by e^d == 0 (d = -inf at tiny temperatures) empties the old sums instead of 0 * -inf.
                a = tl.where(scale > 0, scale * (a + d * s), 0.0) + e * tl.where(e > 0, x, 0.0)
            s = s * scale + e
            row_max = new_max
        log_s = tl.log(tl.sum(s, axis=0))
        label = tl.load(labels_ptr + row)
        valid = (label >= 0) & (label < vocab_size)
        z_label = tl.load(base + tl.where(valid, label, 0) * stride_v, mask=valid, other=0.0).to(acc_dtype)
        logp = (z_label - row_max) * inv_temperature - log_s
        tl.store(logp_ptr + row, tl.where(valid, logp, float("nan")))
        tl.store(row_stats_ptr + row, row_max)
        tl.store(row_stats_ptr + n_rows + row, log_s)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, log_s - tl.sum(a, axis=0) / tl.sum(s, axis=0))
    else:
        tl.store(logp_ptr + row, 0.0)
        tl.store(row_stats_ptr + row, 0.0)
        tl.store(row_stats_ptr + n_rows + row, 0.0)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)


@triton.jit
def logprobs_bwd_kernel(
    logits_ptr, dlogits_ptr, labels_ptr, active_ptr, grad_logp_ptr, grad_entropy_ptr, entropy_ptr,
    row_stats_ptr,  # [2, N] from the forward
    n_rows, rows_per_batch, out_rows_per_batch, stride_b, stride_t, stride_v, dstride_b, dstride_t, dstride_v,
    vocab_size, inv_temperature,
    BLOCK_V: tl.constexpr, HAS_ACTIVE: tl.constexpr, HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
):
    out_row = tl.program_id(0).to(tl.int64)
    batch = out_row // out_rows_per_batch
    pos = out_row % out_rows_per_batch
    in_range = pos < rows_per_batch  # False only at the extra position of a [B, T + 1, V] gradient
    row = tl.where(in_range, batch * rows_per_batch + pos, 0)  # the token's index in [N]
    src = logits_ptr + batch * stride_b + pos * stride_t
    dst = dlogits_ptr + batch * dstride_b + pos * dstride_t
    cols = tl.arange(0, BLOCK_V)

    acc_dtype = row_stats_ptr.dtype.element_ty  # fp32 (fp64 for fp64 logits)
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
        row_max = tl.load(row_stats_ptr + row)
        log_s = tl.load(row_stats_ptr + n_rows + row)
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
            logp = (z - row_max) * inv_temperature - log_s
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


def logsumexp_from_row_stats(row_stats: Tensor, temperature: float = 1.0) -> Tensor:
    """``logsumexp(logits / T)`` per row from the forward's ``row_stats [2, N]`` (``row_max / T + log S``)."""
    return row_stats[0] / temperature + row_stats[1]


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
        out: optional preallocated ``(logp [N], entropy [N] or None, row_stats [2, N])`` buffers.

    Returns:
        ``(logp [N], entropy [N] or None, row_stats [2, N])``, fp32 (fp64 for fp64 logits, computed in fp64;
        the temperature is an fp32 scalar either way). ``row_stats[0]`` is the row's max raw logit and
        ``row_stats[1]`` is ``log S = log sum exp((z - row_max) / T)``: the backward's
        ``log p = (z - row_max) / T - log S``.
    """
    vocab_size = logits.shape[-1]
    n_rows = labels.numel()
    if logits.numel() // max(vocab_size, 1) != n_rows and logits.numel() != 0:
        raise ValueError(f"logits {tuple(logits.shape)} do not hold one row per label ({n_rows} labels)")
    if out is None:
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logp = torch.empty(n_rows, device=logits.device, dtype=acc)
        entropy = torch.empty_like(logp) if return_entropy else None
        row_stats = torch.empty((2, n_rows), device=logits.device, dtype=acc)
    else:
        logp, entropy, row_stats = out
    if n_rows == 0:
        return logp, entropy, row_stats
    labels = labels.reshape(-1)
    if labels.dtype != torch.int64:
        labels = labels.to(torch.int64)
    rows_per_batch, stride_b, stride_t, stride_v = row_strides(logits, "logits")
    with device_guard(logits):
        logprobs_fwd_kernel[(n_rows,)](
            logits,
            labels,
            active if active is not None else labels,
            logp,
            entropy if return_entropy else logp,
            row_stats,
            n_rows,
            rows_per_batch,
            stride_b,
            stride_t,
            stride_v,
            vocab_size,
            1.0 / float(temperature),
            BLOCK_V=logits_block_v(vocab_size, logits.element_size()),
            HAS_ACTIVE=active is not None,
            HAS_ENTROPY=return_entropy,
            num_warps=LOGITS_NUM_WARPS,
            num_stages=LOGITS_NUM_STAGES,
        )
    return logp, entropy, row_stats


def logprobs_backward(
    logits: Tensor,
    labels: Tensor,
    row_stats: Tensor,
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
        labels: ``[N]`` int64; ``row_stats [2, N]``, ``entropy [N]``: from :func:`logprobs_forward` (their
            dtype, fp32 or fp64, is the compute dtype).
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
    extra_position = logits.dim() == 3 and tuple(out.shape) == (logits.shape[0], logits.shape[1] + 1, vocab_size)
    if tuple(out.shape) != tuple(logits.shape) and not extra_position:
        raise ValueError(f"out must be shaped like logits {tuple(logits.shape)} (or [B, T + 1, V]), "
                         f"got {tuple(out.shape)}")
    if not extra_position:
        out_rows_per_batch = rows_per_batch
    n_out_rows = out.numel() // vocab_size
    if n_rows == 0:  # every out row is an extra position, or there is none
        out.zero_()
        return out
    with device_guard(out):
        logprobs_bwd_kernel[(n_out_rows,)](
            logits,
            out,
            labels,
            active if active is not None else labels,
            grad_logp if grad_logp is not None else row_stats,
            grad_entropy if grad_entropy is not None else row_stats,
            entropy if entropy is not None else row_stats,
            row_stats,
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
            BLOCK_V=logits_block_v(vocab_size, logits.element_size()),
            HAS_ACTIVE=active is not None,
            HAS_GRAD_LOGP=grad_logp is not None,
            HAS_GRAD_ENTROPY=grad_entropy is not None,
            num_warps=LOGITS_NUM_WARPS,
            num_stages=LOGITS_NUM_STAGES,
        )
    return out


def next_token_base(logits: Tensor) -> Optional[Tensor]:
    """The ``[B, T + 1, V]`` tensor ``base`` when ``logits`` is exactly ``base[:, :-1]`` in autograd's eyes.

    True when ``logits`` requires grad, is a 3-D view of a 3-D ``base`` with the same strides and start, and
    was produced from ``base`` by one slice (its ``grad_fn`` is a ``SliceBackward0`` whose input is
    ``base``'s own node). The logits Function then takes ``base`` as its input and writes the gradient for all
    ``T + 1`` positions (zeros at the last), so autograd's ``slice_backward`` does not allocate a second
    ``[B, T + 1, V]`` buffer. Returns None in every other case (the view is then used as it is).
    """
    base = getattr(logits, "_base", None)
    if base is None or not logits.requires_grad or logits.dim() != 3 or base.dim() != 3:
        return None
    if tuple(base.shape) != (logits.shape[0], logits.shape[1] + 1, logits.shape[2]):
        return None
    if base.stride() != logits.stride() or base.storage_offset() != logits.storage_offset():
        return None
    node = logits.grad_fn
    if node is None or type(node).__name__ != "SliceBackward0" or not node.next_functions:
        return None
    parent = node.next_functions[0][0]
    if base.grad_fn is not None:
        return base if parent is base.grad_fn else None
    return base if getattr(parent, "variable", None) is base else None


class TritonLogitsLogprobs(torch.autograd.Function):
    """``(logits [N, V] | [B, T, V], labels [N]) -> (logp [N], entropy [N])``, fp32 (fp64 for fp64 logits).

    With ``extra_position=True`` the first input is the ``[B, T + 1, V]`` base of ``logits[:, :-1]`` (see
    :func:`next_token_base`): the kernels read its first ``T`` positions and the gradient covers all ``T + 1``.
    """

    @staticmethod
    def forward(ctx, logits, labels, active, temperature, return_entropy, inplace_backward, extra_position=False):
        labels = labels.reshape(-1)
        if labels.dtype != torch.int64:
            labels = labels.to(torch.int64)
        active = None if active is None else active.reshape(-1).to(torch.bool).contiguous()
        rows = logits.detach()[:, :-1] if extra_position else logits.detach()
        logp, entropy, row_stats = logprobs_forward(
            rows, labels, active=active, temperature=temperature, return_entropy=return_entropy
        )
        if entropy is None:
            entropy = torch.zeros_like(logp)
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, labels, row_stats, entropy, active if active is not None else torch.empty(0))
        ctx.has_active = active is not None
        ctx.has_entropy = return_entropy
        ctx.temperature = temperature
        ctx.inplace = inplace_backward
        ctx.extra_position = extra_position
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, row_stats, entropy, active = ctx.saved_tensors
        if not ctx.has_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        full = logits.detach()
        rows = full[:, :-1] if ctx.extra_position else full
        if ctx.inplace:
            out = full
        elif ctx.extra_position:
            out = torch.empty(full.shape, device=full.device, dtype=full.dtype)
        else:
            out = None
        dlogits = logprobs_backward(
            rows,
            labels,
            row_stats,
            entropy if grad_entropy is not None else None,
            None if grad_logp is None else grad_logp.to(row_stats.dtype).contiguous(),
            None if grad_entropy is None else grad_entropy.to(row_stats.dtype).contiguous(),
            active=active if ctx.has_active else None,
            temperature=ctx.temperature,
            out=out,
        )
        return dlogits, None, None, None, None, None, None


def logits_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    inplace_backward: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The backend contract's ``logits_logprobs`` (see ``gspo_kernels/backends/__init__.py``).

    Args:
        logits: ``[N, V]`` or ``[B, T, V]`` fp16/bf16/fp32/fp64, any strides. A ``model_output[:, :-1]`` view
            is recognised (:func:`next_token_base`): its gradient goes straight to ``model_output``, with zeros
            at the last position, and no second logits-sized buffer is allocated (none at all with
            ``inplace_backward``).
        labels: ``[N]`` int64 in ``[0, V)`` (out of range: never read, NaN log-prob); active: ``[N]`` bool or
            None (False rows are not read, output 0).
    Returns:
        ``(logp [N], entropy [N] or None)`` in fp32 (fp64 for fp64 logits, like the torch backend),
        differentiable with respect to ``logits``.
    """
    base = next_token_base(logits) if torch.is_grad_enabled() else None
    logp, entropy = TritonLogitsLogprobs.apply(
        logits if base is None else base, labels, active, float(temperature), bool(return_entropy),
        bool(inplace_backward), base is not None,
    )
    return logp, (entropy if return_entropy else None)
