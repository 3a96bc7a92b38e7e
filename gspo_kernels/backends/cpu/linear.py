"""``backend="cpu"``, hidden-state path: ``hidden @ weight.T (+ bias)`` -> ``(logp, entropy)`` through the C++
operators ``linear_fwd`` / ``linear_bwd`` without the logits in memory, the tile shapes of both modes
(:func:`blocks`) and how many logits columns the memory budget keeps (:func:`saved_columns`)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.backends.contract import DEFAULT_MEMORY_BUDGET
from gspo_kernels.backends.cpu.ops import _cap_arg, _flags, _fp64_fallback
from gspo_kernels.backends.tiling import as_rows
from gspo_kernels.options import DEFAULT_OPTIONS, CallOptions

# Hidden-state path, batch_invariant=True: fixed shapes (a row's bits must not depend on the batch).
ROW_BLOCK = 1024  # rows per logits tile (the weight is streamed once per block)
# Rows of every row-dependent GEMM, zero-padded (ROW_BLOCK is rounded up to a multiple of it). Fewer than
# 512 active rows cost as much as 512.
GEMM_ROWS = 512
VOCAB_BLOCK = 8192  # vocabulary entries per tile: a [1024, 8192] fp32 tile is 32 MiB

# Hidden-state path, default mode: GEMMs shaped by the actual row count, the threads sharing out the
# vocabulary tiles (single-threaded oneDNN GEMMs per tile). Measured on the 2-core development machine
# (docs/cpu_backends.md): 4096-wide tiles were fastest at V = 32768, 8192-wide at V = 151936 (more tiles
# than threads keeps both cores busy; wider tiles cost fewer calls); rows per block 512.
FAST_ROW_BLOCK = 512
FAST_VOCAB_BLOCK = 4096
FAST_VOCAB_BLOCK_LARGE = 8192  # for V >= LARGE_VOCAB
LARGE_VOCAB = 131072
FAST_MIN_ROW_BLOCK = 128
# The backward keeps one fp32 [rows, H] dH partial per vocabulary tile (summed in tile order: the result
# does not depend on which thread ran which tile); the row block shrinks to keep them under this size.
FAST_PARTIALS_BYTES = 64 << 20


def blocks(rows: int, hidden_size: int, vocab: int, batch_invariant: bool) -> Tuple[int, int, int]:
    """``(row_block, gemm_rows, vocab_block)`` of the hidden-state operators for ``rows`` x ``hidden_size``
    hidden states and a ``vocab``-entry head: the fixed shapes under ``batch_invariant``, else blocks
    chosen for the shape with ``gemm_rows = 0`` (GEMMs of the actual row count, no padding)."""
    if batch_invariant:
        return ROW_BLOCK, GEMM_ROWS, VOCAB_BLOCK
    vocab_block = max(1, min(FAST_VOCAB_BLOCK_LARGE if vocab >= LARGE_VOCAB else FAST_VOCAB_BLOCK, vocab))
    tiles = -(-vocab // vocab_block)
    row_block = min(FAST_ROW_BLOCK, FAST_PARTIALS_BYTES // (tiles * max(hidden_size, 1) * 4))
    return max(FAST_MIN_ROW_BLOCK, row_block, 1), 0, vocab_block


def linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                    active: Optional[Tensor] = None, options: CallOptions = DEFAULT_OPTIONS, *,
                    leaves: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-token ``(logp [N], entropy [N] | None)`` of ``hidden @ weight.T + bias``. ``leaves`` (the contract's):
    not used, the gradients reach the caller's tensors through the precision policy's casts.

    The options read (``options``, the call's :class:`~gspo_kernels.options.CallOptions`): ``temperature``,
    ``return_entropy``; ``softcap``: see the backend contract (fp32 math; with a cap the bias is not shifted by its
    max).

    ``batch_invariant``: ``True`` gives a row the same bits whatever the batch, its position and
    ``memory_budget`` (fixed-shape, zero-padded GEMMs; slower, most of all below 512 active rows);
    ``False`` (default) shapes the GEMMs by the actual row count (deterministic run to run, within the
    stated tolerances of float64, not bitwise batch invariant). Refused for fp64 inputs.
    ``hidden``: ``[N, H]`` or ``[B, T, H]``; ``weight``: ``[V, H]``; ``bias``: ``[V]`` or None.
    fp16/bf16/fp32 inputs: exact fp32 products, fp32 accumulation, fp32 outputs; fp64 inputs: the
    ``torch`` backend's fp64 math and fp64 outputs.
    ``memory_budget``: bytes of fp32 logits the forward may keep for the backward (whole vocabulary
    tiles; ``None``: :data:`DEFAULT_MEMORY_BUDGET` = 1 GiB; 0: recompute every tile). Results are
    the same bits whatever the budget.
    Extra memory: ``O(N)`` plus an fp32 copy of the active rows of ``hidden`` (zero-padded under
    ``batch_invariant``), one fp32 ``[row_block, vocab_block]`` tile (one per thread in the default mode),
    up to ``memory_budget`` bytes of saved logits between forward and backward, the fp32 ``dW`` in the
    backward, and in the default mode one fp32 ``[row_block, H]`` ``dH`` partial per vocabulary tile
    (at most ``FAST_PARTIALS_BYTES`` unless the row block is at its floor, ``FAST_MIN_ROW_BLOCK``).
    """
    temperature, return_entropy, softcap = options.temperature, options.return_entropy, options.softcap
    batch_invariant, memory_budget = options.batch_invariant, options.memory_budget
    if torch.float64 in (hidden.dtype, weight.dtype):
        if batch_invariant:
            raise ValueError("batch_invariant=True is not available for fp64 hidden states or weight on backend "
                             "'cpu': fp64 runs through the 'torch' backend, whose matmuls round a row depending on "
                             "the batch's shape; pass fp32/bf16/fp16 tensors or batch_invariant=False")
        return _fp64_fallback("hidden states").linear_logprobs(hidden, weight, bias, labels, active, options)
    rows = as_rows(hidden)
    labels, active = _flags(labels, active)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (rows, weight, bias))
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget  # validated by the public API
    row_block, gemm_rows, vocab_block = blocks(rows.shape[0], weight.shape[1], weight.shape[0], batch_invariant)
    save_cols = saved_columns(rows.shape[0], weight.shape[0], vocab_block, budget if needs_grad else 0)
    logp, entropy, _stats, _saved = torch.ops.gspo_kernels.linear_fwd(
        rows, weight, bias, labels, active, float(temperature), bool(return_entropy), row_block, gemm_rows,
        vocab_block, save_cols, *_cap_arg(softcap),
    )
    return logp, (entropy if return_entropy else None)


def saved_columns(rows: int, vocab: int, vocab_block: int, budget_bytes: int) -> int:
    """How many leading vocabulary columns of the ``[rows, vocab]`` fp32 logits fit in the budget
    (whole tiles of ``vocab_block`` columns, or the whole vocabulary)."""
    block = max(1, min(vocab_block, vocab))
    if rows == 0 or rows * vocab * 4 <= budget_bytes:
        return vocab if rows else 0
    return min(vocab, (budget_bytes // (rows * 4)) // block * block)
