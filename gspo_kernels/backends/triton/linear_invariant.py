"""The hidden-state path: ``hidden @ weight.T (+ bias) -> (logp [N], entropy [N])`` and its gradient,
without the ``[N, V]`` logits and without atomics.

Forward (:func:`linear_logprobs_fwd_kernel` + :func:`linear_logprobs_combine_kernel`, launched by
:func:`linear_logprobs_forward`). A program owns ``BLOCK_N`` rows and one *split* of the vocabulary
(``cols_per_split`` consecutive columns); it walks that split ``BLOCK_V`` columns at a time, builds each
logits tile with ``tl.dot`` (fp32 accumulation over ``H`` in ``BLOCK_H`` steps, :func:`logits_tile`), scales
it by ``1 / temperature`` and folds it into a running (online) log-sum-exp, the entropy sum and the label's
logit. Only per-row partial statistics leave the kernel (three fp32 values per (split, row) plus the label
logit); the combine kernel merges the splits of each row in split order.

Per row, with ``z = (h . W[v] + b[v]) / tau`` and a split's running maximum ``row_max``:
``s = sum_v exp(z_v - row_max)`` and ``t = sum_v exp(z_v - row_max) (z_v - row_max)``, so that
``log-sum-exp = row_max + log s`` and ``entropy = log s - t / s`` (no cancellation against the log-sum-exp).
``row_max`` and ``log_sum = log s`` are returned separately (not summed into one fp32 log-sum-exp), so that
``log p = (z - row_max) - log_sum`` keeps its precision when the logits are large (``1e4`` offsets):
``z - row_max`` is exact there, while ``row_max + log_sum`` would be rounded to the spacing of ``row_max``.
A bias is replaced by :func:`.kernel_math.max_subtracted_bias` before the kernels (the softmax does not change;
the logits stay small), except under a soft cap (``softcap = c``: ``z = c tanh((h . W[v] + b[v]) / c) / tau``,
which a shift would change; :func:`.kernel_math.kernel_bias`). With the cap, the ``dz`` kernel multiplies ``q`` by
the cap's slope ``1 - tanh^2``, ``tanh`` recovered from ``log p`` so that no second logits-sized tile stays in
registers.

Backward (:func:`linear_logprobs_backward`). Only the rows whose incoming gradient is non-zero are visited:
the autograd Function compacts them on the device (``order[:count]``, :func:`compact_rows`; ``count`` stays
on the device, so nothing synchronises with the host). The rows are processed in fixed-size **chunks** of
``C`` compacted rows (``C`` from the memory budget, ``configs.chunk_rows``); each chunk runs three kernels:

1. :func:`linear_dz_kernel` (grid: row tiles x vocabulary tiles of the chunk, grouped order): recomputes the
   logits tile and forms

       q[r, v] = g_logp[r] * (1[v = y_r] - p[r, v]) - g_ent[r] * p[r, v] * (log p[r, v] + entropy[r]),
       log p = (z - row_max) - log_sum,

   the gradient with respect to ``z`` (the raw logits' gradient is ``q / tau``; ``1 / tau`` is applied in
   fp32 by the next kernels, so a tiny temperature cannot overflow a half-precision ``q``). ``q`` is written
   to the chunk buffer ``dZ [C, V]`` in the operand dtype, and, with a bias, the fp32 column sums of each
   row tile to ``dB_part [C / BLOCK_N, V]``.
2. :func:`linear_dh_kernel` (grid: row tiles x ``H`` tiles): ``dH[rows] = (dZ @ W) / tau``, fp32
   accumulation, the reduction over ``V`` in ``BLOCK_V`` steps from 0 upwards for every row.
3. :func:`linear_dw_kernel` (grid: vocabulary tiles x ``H`` tiles): ``dW += (dZ^T @ H[rows]) / tau`` into an
   fp32 ``[V, H]`` accumulator that each program owns for its tile (plain load, add, store: no atomics), and
   ``dbias += sum of the chunk's dB_part rows / tau`` in row-tile order.

Steps 2 and 3 are plain GEMMs on the chunk buffer, each launched by its own function (:func:`_launch_dh`,
:func:`_launch_dw`), so that another GEMM implementation can replace either without touching the rest.

Batch invariance and determinism: a row's results depend only on that row and on the launch configuration,
which depends on the dtype alone (``configs.py``): the split width is a constant, the ``tl.dot`` products
are per output element, the reductions over ``H`` (for ``z``) and ``V`` (for ``dH``) run in the same steps
whatever the chunk, the row's position or its neighbours, and the splits are combined in a fixed order. So a
row gives the same bits alone or among any other rows and for any memory budget. ``dW`` and ``dbias`` are
sums over rows: deterministic (chunk order, then row order). Nothing is summed by atomics.

Rows: all ``N`` rows, or the first ``count`` entries of ``order`` (read by the kernels: no host
synchronisation). Programs past ``count`` exit at once. Out-of-range labels are never used as addresses;
such a row's log-prob (and gradient) is NaN. Sizes are runtime arguments: a new ``N`` or sequence length
never recompiles.

Memory: forward ``(3 * splits + 1) * N`` fp32 of partial statistics (``splits = ceil(V / SPLIT_COLS)``);
backward the chunk buffers, ``C * V * (operand bytes) + ceil(C / BLOCK_N) * V * 4`` bytes, at most the
``memory_budget`` (default ``configs.DEFAULT_MEMORY_BUDGET``) but never less than one row tile, plus the fp32
``dW [V, H]`` and ``dbias [V]`` accumulators. Cost: ``6 C H V`` flops per chunk plus ``3 C V`` operand-dtype
elements of chunk-buffer traffic (~5% of the flop time at H = 4096 on an H100).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import triton
from torch import Tensor

from gspo_kernels.backends.triton import configs
from gspo_kernels.backends.triton.kernel_math import kernel_bias
from gspo_kernels.backends.triton.launch import device_guard, interpreter_active, row_strides
from gspo_kernels.backends.triton.linear_invariant_kernels import (
    linear_dh_kernel,
    linear_dw_kernel,
    linear_dz_kernel,
    linear_logprobs_combine_kernel,
    linear_logprobs_fwd_kernel,
)
from gspo_kernels.options import DEFAULT_OPTIONS, CallOptions
from gspo_kernels.precision import kernel_operand_dtype


def upcast_dots(*tensors: Tensor) -> bool:
    """True when the kernels must multiply bf16 operands in fp32 (the interpreter's bf16 ``tl.dot`` is wrong)."""
    return interpreter_active() and any(t.dtype == torch.bfloat16 for t in tensors)


def compact_rows(mask: Tensor) -> Tuple[Tensor, Tensor]:
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


def linear_logprobs_forward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    labels: Tensor,
    temperature: float = 1.0,
    *,
    order: Optional[Tensor] = None,
    count: Optional[Tensor] = None,
    config: Optional[Dict[str, int]] = None,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Log-probs and entropy of every row (or of the rows ``order[:count]``) of ``hidden @ weight.T + bias``.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` (any strides), fp16/bf16/fp32.
        weight: ``[V, H]``, same dtype as ``hidden``. bias: ``[V]`` (any stride and float dtype) or None;
            used as given (callers pass :func:`.kernel_math.max_subtracted_bias` for precision).
        labels: ``[N]`` int64. Out-of-range labels give a NaN log-prob (they are never used as addresses).
        temperature: logits are divided by it.
        order, count: a compaction of the rows to compute (see :func:`compact_rows`), or None for all rows.
        config: block sizes / warps / stages / ``SPLIT_COLS`` (default: ``configs.linear_fwd_config``).

    Returns:
        ``(logp, entropy, row_max, log_sum)``, each ``[N]`` fp32; rows not computed hold 0. ``row_max`` is the
        row's largest temperature-scaled logit and ``log_sum = log sum_v exp(z_v - row_max)`` (the
        log-sum-exp is ``row_max + log_sum``, kept apart for precision).
    """
    N = labels.shape[0]
    V, H = weight.shape
    device = hidden.device
    out = torch.zeros((4, N), device=device, dtype=torch.float32)
    if N == 0:
        return out[0], out[1], out[2], out[3]
    cfg = configs.linear_fwd_config(hidden.dtype, config)
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
            1.0 / float(temperature), cols_per_split, num_splits, 1.0 if softcap is None else float(softcap),
            HAS_BIAS=bias is not None, HAS_ORDER=has_order, EVEN_H=H % cfg["BLOCK_H"] == 0,
            UPCAST=upcast_dots(hidden, weight),
            BLOCK_N=cfg["BLOCK_N"], BLOCK_V=block_v, BLOCK_H=cfg["BLOCK_H"], GROUP_N=cfg["GROUP_N"],
            HAS_SOFTCAP=softcap is not None, FAST_MATH=not interpreter_active(),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        linear_logprobs_combine_kernel[(triton.cdiv(N, configs.COMBINE_BLOCK),)](
            *index, labels, part[0], part[1], part[2], label_logit, out[0], out[1], out[2], out[3],
            N, V, num_splits, HAS_ORDER=has_order, BLOCK=configs.COMBINE_BLOCK, num_warps=configs.COMBINE_NUM_WARPS,
        )
    return out[0], out[1], out[2], out[3]


@dataclass(frozen=True)
class BackwardChunk:
    """One chunk of the backward, what its two GEMMs read besides the operands.

    ``dz``: ``[C, V]`` operand dtype (row stride ``V``), ``q`` of the chunk's rows. ``db_part``: ``[ceil(C /
    dz_block_n), V]`` fp32, the column sums of ``dz`` per row tile of the dZ kernel (``dz_block_n`` rows each), or
    None without a bias gradient. ``order`` ``[N]`` int64 and ``count`` ``[1]`` int64: the compacted rows, on the
    device (:func:`compact_rows`). ``start``: the chunk's first position in ``order``; ``rows``: an upper bound of
    its rows (the kernels read ``count`` themselves). ``inv_temperature``: ``1 / tau``, applied in fp32 by the GEMMs.
    ``upcast``: multiply in fp32 (:func:`upcast_dots`).
    """

    dz: Tensor
    db_part: Optional[Tensor]
    dz_block_n: int
    order: Tensor
    count: Tensor
    start: int
    rows: int
    inv_temperature: float
    upcast: bool


def _launch_dh(chunk: BackwardChunk, weight: Tensor, dh: Tensor, cfg: Dict[str, int]) -> None:
    """``dh[order[chunk.start:...]] = (dZ @ W) / tau`` for one chunk (a GEMM); ``dh`` ``[N, H]`` contiguous."""
    V, H = weight.shape
    linear_dh_kernel[(triton.cdiv(chunk.rows, cfg["BLOCK_N"]) * triton.cdiv(H, cfg["BLOCK_H"]),)](
        chunk.dz, weight, chunk.order, chunk.count, dh, chunk.start, chunk.rows, V, H,
        weight.stride(0), weight.stride(1), chunk.inv_temperature,
        UPCAST=chunk.upcast, BLOCK_N=cfg["BLOCK_N"], BLOCK_H=cfg["BLOCK_H"], BLOCK_V=cfg["BLOCK_V"],
        GROUP=cfg["GROUP"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _launch_dw(chunk: BackwardChunk, hidden: Tensor, dw: Optional[Tensor], db: Optional[Tensor],
               cfg: Dict[str, int]) -> None:
    """``dw += (dZ^T @ H[rows]) / tau`` (a GEMM) and ``db += sum(dB_part) / tau`` for one chunk; ``dw`` ``[V, H]``
    and ``db`` ``[V]`` are fp32 accumulators, None when not computed (at least one is given; ``db`` needs
    ``chunk.db_part``)."""
    compute_dw, compute_db = dw is not None, db is not None
    T, stride_hb, stride_ht, stride_hh = row_strides(hidden, "hidden")
    H = hidden.shape[-1]
    V = chunk.dz.shape[1]
    h_tiles = triton.cdiv(H, cfg["BLOCK_H"]) if compute_dw else 1
    linear_dw_kernel[(triton.cdiv(V, cfg["BLOCK_V"]) * h_tiles,)](
        # an absent accumulator's pointer is never read (COMPUTE_DW / COMPUTE_DB): the other fp32 one stands in
        chunk.dz, hidden, chunk.order, chunk.count, chunk.db_part if compute_db else chunk.dz,
        dw if compute_dw else db, db if compute_db else dw,
        chunk.start, chunk.rows, V, H, T, stride_hb, stride_ht, stride_hh, chunk.inv_temperature,
        COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db, UPCAST=chunk.upcast,
        BLOCK_V=cfg["BLOCK_V"], BLOCK_H=cfg["BLOCK_H"], BLOCK_K=cfg["BLOCK_K"], GROUP=cfg["GROUP"],
        DZ_BLOCK_N=chunk.dz_block_n, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


@dataclass(frozen=True)
class BackwardInputs:
    """What :func:`linear_logprobs_backward` reads of a forward and of its incoming gradient.

    ``hidden``: ``[N, H]`` or ``[B, T, H]`` (any strides), fp16/bf16/fp32. ``weight``: ``[V, H]``, same dtype.
    ``bias``: ``[V]`` (any stride, any float dtype) or None, exactly as given to the forward. ``labels``,
    ``row_max``, ``log_sum``, ``entropy``: ``[N]`` (int64 / fp32), as given to / returned by the forward.
    ``grad_logp``, ``grad_entropy``: ``[N]`` fp32 or None (None: no gradient through that output). ``order``,
    ``count``: the device-side compaction of the rows to visit (:func:`compact_rows`).
    """

    hidden: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    labels: Tensor
    row_max: Tensor
    log_sum: Tensor
    entropy: Tensor
    grad_logp: Optional[Tensor]
    grad_entropy: Optional[Tensor]
    order: Tensor
    count: Tensor


def linear_logprobs_backward(
    inputs: BackwardInputs,
    options: CallOptions = DEFAULT_OPTIONS,
    *,
    compute_dh: bool = True,
    compute_dw: bool = True,
    compute_db: bool = True,
    config: Optional[Dict[str, Dict[str, int]]] = None,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients of ``sum(grad_logp * logp + grad_entropy * entropy)`` over the rows ``order[:count]``.

    Args:
        inputs: the forward's operands, statistics and rows, and the incoming gradients (:class:`BackwardInputs`).
        options: the call's :class:`~gspo_kernels.options.CallOptions`; read: ``temperature``, ``softcap`` and
            ``memory_budget`` (bytes for the chunk buffers; None: ``configs.DEFAULT_MEMORY_BUDGET``).
        config: the three kernels' launch configurations (default: ``configs.linear_bwd_config``).

    Returns:
        ``(dh [N, H] in the hidden dtype or None, dw [V, H] fp32 or None, db [V] fp32 or None)``; rows of
        ``dh`` outside ``order[:count]`` are exactly 0.
    """
    hidden, weight, bias, labels = inputs.hidden, inputs.weight, inputs.bias, inputs.labels
    grad_logp, grad_entropy, softcap = inputs.grad_logp, inputs.grad_entropy, options.softcap
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
    cfg = configs.linear_bwd_config(hidden.dtype, config)
    c_dz = cfg["dz"]
    C = configs.chunk_rows(N, V, hidden.dtype, c_dz["BLOCK_N"], options.memory_budget)
    dz = torch.empty((C, V), device=device, dtype=hidden.dtype)
    db_part = torch.empty((triton.cdiv(C, c_dz["BLOCK_N"]), V), device=device, dtype=torch.float32) if compute_db else dz
    T, stride_hb, stride_ht, stride_hh = row_strides(hidden, "hidden")
    upcast = upcast_dots(hidden, weight)
    inv_t = 1.0 / float(options.temperature)
    dummy = inputs.row_max
    with device_guard(hidden):
        for chunk_start in range(0, N, C):
            rows_here = min(C, N - chunk_start)  # an upper bound: the kernels read count themselves
            linear_dz_kernel[(triton.cdiv(rows_here, c_dz["BLOCK_N"]) * triton.cdiv(V, c_dz["BLOCK_V"]),)](
                hidden, weight, bias if bias is not None else weight, inputs.order, inputs.count,
                labels, inputs.row_max, inputs.log_sum, inputs.entropy,
                grad_logp if has_logp else dummy, grad_entropy if has_ent else dummy, dz, db_part,
                chunk_start, rows_here, V, H, T, stride_hb, stride_ht, stride_hh,
                weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0, inv_t,
                1.0 if softcap is None else float(softcap),
                HAS_BIAS=bias is not None, HAS_LOGP_GRAD=has_logp, HAS_ENTROPY_GRAD=has_ent,
                COMPUTE_DB=compute_db, EVEN_H=H % c_dz["BLOCK_H"] == 0, UPCAST=upcast,
                BLOCK_N=c_dz["BLOCK_N"], BLOCK_V=c_dz["BLOCK_V"], BLOCK_H=c_dz["BLOCK_H"], GROUP=c_dz["GROUP"],
                HAS_SOFTCAP=softcap is not None, FAST_MATH=not interpreter_active(),
                num_warps=c_dz["num_warps"], num_stages=c_dz["num_stages"],
            )
            chunk = BackwardChunk(dz=dz, db_part=db_part if compute_db else None, dz_block_n=c_dz["BLOCK_N"],
                                  order=inputs.order, count=inputs.count, start=chunk_start, rows=rows_here,
                                  inv_temperature=inv_t, upcast=upcast)
            if compute_dh:
                _launch_dh(chunk, weight, dh, cfg["dh"])
            if compute_dw or compute_db:
                _launch_dw(chunk, hidden, dw, db, cfg["dw"])
    return dh, dw, db


def kernel_operands(hidden: Tensor, weight: Tensor) -> Tuple[Tensor, Tensor]:
    """``hidden`` and ``weight`` (unit last stride) in ``precision.kernel_operand_dtype`` (fp64 -> fp32)."""
    dtype = kernel_operand_dtype(hidden.dtype, weight.dtype)
    h = hidden if hidden.dtype == dtype else hidden.to(dtype)
    w = weight if weight.dtype == dtype else weight.to(dtype)
    return h, (w if w.stride(-1) == 1 else w.contiguous())


class LinearLogprobsFunction(torch.autograd.Function):
    """``(hidden, weight, bias, labels, active, options) -> (logp, entropy)``; ``options``: the call's
    :class:`~gspo_kernels.options.CallOptions` (``temperature``, ``memory_budget`` and ``softcap`` read), kept whole
    on ``ctx`` for the backward.

    Saves the caller's ``hidden``, ``weight``, ``bias`` (no copies: fp64 operands are cast to fp32 again in
    the backward) and five ``[N]`` tensors. No host synchronisation in either direction (the active rows
    are compacted on the device), so the Function can be captured in a CUDA graph.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        labels: Tensor,
        active: Optional[Tensor],
        options: CallOptions,
    ) -> Tuple[Tensor, Tensor]:
        h, w = kernel_operands(hidden.detach(), weight.detach())
        b = kernel_bias(None if bias is None else bias.detach(), options.softcap)
        labels = labels.reshape(-1).to(torch.int64)
        if active is None:
            order = count = None
            computed = torch.ones(labels.shape[0], device=hidden.device, dtype=torch.bool)
        else:
            computed = active.reshape(-1).to(torch.bool)
            order, count = compact_rows(computed)
        logp, entropy, row_max, log_sum = linear_logprobs_forward(
            h, w, b, labels, float(options.temperature), order=order, count=count, softcap=options.softcap
        )
        ctx.save_for_backward(hidden, weight, bias, labels, computed, row_max, log_sum, entropy)
        ctx.options = options
        ctx.set_materialize_grads(False)
        out_dtype = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
        return logp.to(out_dtype), entropy.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor]):
        hidden, weight, bias, labels, computed, row_max, log_sum, entropy = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        carries = torch.zeros_like(computed)
        if grad_logp is not None:
            grad_logp = grad_logp.reshape(-1).to(torch.float32).contiguous()
            carries |= grad_logp != 0
        if grad_entropy is not None:
            grad_entropy = grad_entropy.reshape(-1).to(torch.float32).contiguous()
            carries |= grad_entropy != 0
        order, count = compact_rows(carries & computed)
        h, w = kernel_operands(hidden.detach(), weight.detach())
        options = ctx.options
        inputs = BackwardInputs(hidden=h, weight=w, bias=kernel_bias(None if bias is None else bias.detach(), options.softcap),
                                labels=labels, row_max=row_max, log_sum=log_sum, entropy=entropy,
                                grad_logp=grad_logp, grad_entropy=grad_entropy, order=order, count=count)
        dh, dw, db = linear_logprobs_backward(inputs, options, compute_dh=need_dh, compute_dw=need_dw,
                                              compute_db=need_db)
        dh = dh.reshape(hidden.shape).to(hidden.dtype) if dh is not None else None
        dw = dw.to(weight.dtype) if dw is not None else None
        db = db.to(bias.dtype) if db is not None else None
        return dh, dw, db, None, None, None


def linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                    active: Optional[Tensor] = None,
                    options: CallOptions = DEFAULT_OPTIONS) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-token log-probs (and entropy) of ``labels`` under ``softmax((hidden @ weight.T + bias) / temperature)``
    (with ``softcap = c``: ``softmax(c tanh((hidden @ weight.T + bias) / c) / temperature)``).

    The backend contract's ``linear_logprobs`` (:class:`gspo_kernels.backends.contract.LinearLogprobs`).

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` (any strides), fp16/bf16/fp32/fp64.
        weight: ``[V, H]`` in the dtype of ``hidden`` (the public functions apply ``gspo_kernels.precision``
            first; a pair that still differs raises ``TypeError``); fp64 operands are computed in fp32.
            bias: ``[V]`` (any stride) or None.
        labels: ``[N]`` (or ``[B, T]``) int64. Values outside ``[0, V)`` are never used as addresses:
            such a row's log-prob (and gradient) is NaN.
        active: ``[N]`` bool or None; rows where False are not computed (their outputs are 0).
        options: the call's :class:`~gspo_kernels.options.CallOptions`; read: ``temperature`` (the logits are
            divided by it), ``return_entropy`` (also return the entropy of each row's distribution), ``softcap``
            and ``memory_budget``: bytes for the backward's chunk buffers, validated by the public functions
            (None: ``configs.DEFAULT_MEMORY_BUDGET``; at least one row tile is always used). It changes the speed
            and the memory, never the bits of any output.

    Returns:
        ``(logp [N], entropy [N] or None)``: fp32 (fp64, computed in fp32, for fp64 inputs),
        differentiable w.r.t. hidden, weight and bias. The backward is deterministic (no atomics) and
        batch-invariant (a row's results do not depend on the other rows); see the module docstring.
    """
    logp, entropy = LinearLogprobsFunction.apply(hidden, weight, bias, labels, active, options)
    return logp, (entropy if options.return_entropy else None)
