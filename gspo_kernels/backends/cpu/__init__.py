"""``backend="cpu"``: the C++ heavy stage (``gspo_kernels/csrc/``, compiled on first use) for CPU tensors.

The extension registers the operators ``torch.ops.gspo_kernels.{logits_fwd, logits_bwd, logits_bwd_,
linear_fwd, linear_bwd}`` (schemas in ``gspo_kernels/csrc/module.cpp``). This module gives them fake (meta)
implementations, so ``torch.compile(fullgraph=True)`` traces through them, and autograd formulas
(``torch.library.register_autograd``), then exposes the two backend functions.

* logits path: one pass over each row (OpenMP over rows), fp32 math from fp16/bf16/fp32 logits;
  the backward reads the logits once more from the saved row statistics and skips rows without
  gradient. A ``model_output[:, :-1]`` view gets the base's gradient directly (no ``slice_backward``);
  the out-of-place gradient reuses the previous one's memory once it is free (:func:`release_buffers`).
* hidden-state path: logits tiles produced by fp32 GEMMs and folded in one pass; the backward
  recomputes tiles for the rows with gradient only, dH/dW in fp32. By default the two threads share
  out the vocabulary tiles, each tile's GEMMs single-threaded through oneDNN (AVX-512 where the CPU
  has it) and shaped by the actual number of rows (:func:`blocks`); with ``batch_invariant=True``
  every GEMM is cut into tasks of a fixed, zero-padded shape, which the threads share out, each task
  single-threaded (the bits do not depend on the thread count). Memory for speed: the forward
  keeps up to ``memory_budget`` bytes of fp32 logits tiles (whole vocabulary tiles, from the first
  one on; default :data:`DEFAULT_MEMORY_BUDGET`, 1 GiB) and the backward reads them instead of
  recomputing them, saving one of the four ``N*H*V`` GEMMs for that share of the vocabulary.
  ``memory_budget=0`` recomputes everything (the least memory: one tile plus the fp32 ``dW``).

Precision: fp16/bf16 inputs are converted to fp32 exactly, so in the hidden-state path every
product ``h_k * w_k`` is exact in fp32 and the GEMMs accumulate in fp32; log-probs and entropies
are fp32, computed from the row max and ``log sum exp(x - max)`` kept apart (logits offset by 1e4,
or temperatures of 1e-6, keep fp32 accuracy). fp64 inputs run the portable ``torch`` backend (fp64
math: fp64 log-probs and entropies), and that is logged once.

Determinism and batch invariance: every result is the same bits on every run (same thread count).
On the logits path a row's log-prob, entropy and gradient row never depend on the other rows. On the
hidden-state path that holds (for the ``dH`` row) with ``batch_invariant=True``: the per-row
reductions run in a fixed order, and the row-dependent GEMMs have a fixed shape of ``GEMM_ROWS`` rows
(zero-padded), since BLAS picks its kernels by shape, and run single-threaded in fixed-shape tasks (a
multi-threaded BLAS call may sum in an order that follows its thread count); the row's bits then do not
depend on the batch, its position, ``memory_budget`` or the number of threads. In the default mode a row's last bits may change with the number
of rows (within the float64 tolerances). ``dW`` and ``dbias`` sum over rows in a fixed order.

Labels outside ``[0, V)`` (possible only when the public functions skip their value checks, under
``torch.compile``) are never read out of bounds: that row's log-prob is NaN.
The light sequence stage is the PyTorch one (:func:`gspo_kernels.objective.gspo_objective`).
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.backends import DEFAULT_MEMORY_BUDGET, Backend
from gspo_kernels.backends.cpu import build as cpu_build
from gspo_kernels.backends.tiling import as_rows, next_token_base

logger = logging.getLogger("gspo_kernels")

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

_registered = False
_fp64_announced = False


def _load_extension() -> None:
    """Load the C++ kernels (built on first use, :mod:`gspo_kernels.backends.cpu.build`) and register the fake
    and autograd implementations once. Raises ``RuntimeError`` (``cpu_build.ExtensionUnavailable``) with the
    reason when they cannot be built or loaded here."""
    global _registered
    if _registered:
        return
    cpu_build.load()  # registers torch.ops.gspo_kernels.*
    _register_fakes()
    _register_autograd()
    _registered = True


# ---------------------------------------------------------------------------------------------
# Fake (meta) implementations: output shapes and dtypes only.
# ---------------------------------------------------------------------------------------------


def _register_fakes() -> None:
    lib = "gspo_kernels::"

    @torch.library.register_fake(lib + "logits_fwd")
    def _(logits, labels, active, temperature, return_entropy, inplace_backward, softcap=0.0, extra_position=False):
        n = labels.shape[0]
        f32 = dict(dtype=torch.float32)
        return logits.new_empty((n,), **f32), logits.new_empty((n,), **f32), logits.new_empty((2, n), **f32)

    @torch.library.register_fake(lib + "logits_bwd")
    def _(grad_logp, grad_entropy, logits, labels, active, stats, entropy, temperature, softcap=0.0,
          extra_position=False):
        return logits.new_empty(logits.shape)  # the base's shape with extra_position

    @torch.library.register_fake(lib + "logits_bwd_")
    def _(logits, grad_logp, grad_entropy, labels, active, stats, entropy, temperature, softcap=0.0,
          extra_position=False):
        return None

    @torch.library.register_fake(lib + "linear_fwd")
    def _(hidden, weight, bias, labels, active, temperature, return_entropy, row_block, gemm_rows, vocab_block,
          save_cols, softcap=0.0):
        n = hidden.shape[0]
        f32 = dict(dtype=torch.float32)
        return (hidden.new_empty((n,), **f32), hidden.new_empty((n,), **f32), hidden.new_empty((2, n), **f32),
                hidden.new_empty((n * save_cols,), **f32))

    @torch.library.register_fake(lib + "linear_bwd")
    def _(grad_logp, grad_entropy, hidden, weight, bias, labels, active, stats, entropy, saved, temperature,
          row_block, gemm_rows, vocab_block, save_cols, weight_grad, softcap=0.0):
        grad_hidden = hidden.new_empty(hidden.shape)
        grad_weight = weight.new_empty(weight.shape if weight_grad else (0, weight.shape[1]))
        grad_bias = bias.new_empty(bias.shape) if bias is not None else hidden.new_empty((0,), dtype=torch.float32)
        return grad_hidden, grad_weight, grad_bias


# ---------------------------------------------------------------------------------------------
# Autograd formulas (the backward ops are not themselves differentiable).
# ---------------------------------------------------------------------------------------------


def _register_autograd() -> None:
    ops = torch.ops.gspo_kernels

    def logits_setup(ctx, inputs, output):
        # inputs carry every argument, defaults filled in (softcap, extra_position)
        logits, labels, active, temperature, _return_entropy, inplace_backward, softcap, extra_position = inputs
        _logp, entropy, stats = output
        ctx.set_materialize_grads(False)  # no zero-filled gradients for unused outputs
        ctx.save_for_backward(logits, labels, active, stats, entropy)
        ctx.temperature = temperature
        ctx.softcap = softcap if softcap > 0 else None
        ctx.inplace = inplace_backward
        ctx.extra_position = bool(extra_position)

    def logits_backward(ctx, grad_logp, grad_entropy, _grad_stats):
        logits, labels, active, stats, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(entropy)
        extra = dict(extra_position=True) if ctx.extra_position else {}
        if ctx.inplace and not torch.compiler.is_compiling():
            target = logits.detach()  # with extra_position the [B, T + 1, V] base: its last position is zeroed
            ops.logits_bwd_(target, grad_logp, grad_entropy, labels, active, stats, entropy, ctx.temperature,
                            *_cap_arg(ctx.softcap), **extra)
            grad = target
        else:
            grad = ops.logits_bwd(grad_logp, grad_entropy, logits, labels, active, stats, entropy, ctx.temperature,
                                  *_cap_arg(ctx.softcap), **extra)
        return grad, None, None, None, None, None, None, None

    torch.library.register_autograd(
        "gspo_kernels::logits_fwd", logits_backward, setup_context=logits_setup
    )

    def linear_setup(ctx, inputs, output):
        (hidden, weight, bias, labels, active, temperature, _return_entropy, row_block, gemm_rows, vocab_block,
         save_cols, *softcap) = inputs
        _logp, entropy, stats, saved = output
        ctx.set_materialize_grads(False)  # else the unused `saved` output gets an [N, save_cols] zero gradient
        ctx.save_for_backward(hidden, weight, bias, labels, active, stats, entropy, saved)
        ctx.temperature = temperature
        ctx.softcap = softcap[0] if softcap and softcap[0] > 0 else None
        ctx.blocks = (row_block, gemm_rows, vocab_block, save_cols)

    def linear_backward(ctx, grad_logp, grad_entropy, _grad_stats, _grad_saved):
        hidden, weight, bias, labels, active, stats, entropy, saved = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(entropy)
        weight_grad = bool(ctx.needs_input_grad[1])
        grad_hidden, grad_weight, grad_bias = ops.linear_bwd(
            grad_logp, grad_entropy, hidden, weight, bias, labels, active, stats, entropy, saved, ctx.temperature,
            *ctx.blocks, weight_grad, *_cap_arg(ctx.softcap),
        )
        return (
            grad_hidden if ctx.needs_input_grad[0] else None,
            grad_weight if weight_grad else None,
            grad_bias if bias is not None and ctx.needs_input_grad[2] else None,
            None, None, None, None, None, None, None, None, None,
        )

    torch.library.register_autograd(
        "gspo_kernels::linear_fwd", linear_backward, setup_context=linear_setup
    )


# ---------------------------------------------------------------------------------------------
# The backend functions (contract: gspo_kernels/backends/__init__.py).
# ---------------------------------------------------------------------------------------------


def _fp64_fallback(what: str):
    global _fp64_announced
    if not _fp64_announced:
        _fp64_announced = True
        logger.info("gspo_kernels: backend 'cpu' runs fp64 %s through the 'torch' backend (fp64 math)", what)
    from gspo_kernels.backends import torch as torch_backend

    return torch_backend


def _flags(labels: Tensor, active: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    labels = labels.reshape(-1).to(torch.int64).contiguous()
    if active is not None:
        active = active.reshape(-1).to(torch.bool).contiguous()
    return labels, active


def logits_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-token ``(logp [N], entropy [N] | None)`` from ``logits [N, V]`` / ``[B, T, V]``.

    fp16/bf16/fp32 logits give fp32 outputs (fp32 math); fp64 logits give fp64 outputs (the
    ``torch`` backend's fp64 math). Any strides with a unit last stride are read in place (e.g.
    ``logits[:, :-1]``); other layouts are copied once. With ``inplace_backward`` the gradient is
    written into the logits' storage. ``softcap``: see the backend contract (the cap is computed in fp32).

    A model's ``[B, T + 1, V]`` output read as ``logits[:, :-1]`` is recognised
    (:func:`gspo_kernels.backends.tiling.next_token_base`, as the Triton backend does): the operators take the
    base, read its first ``T`` positions, and the backward writes the base's gradient itself (zeros at the last
    position), so autograd's ``slice_backward`` never allocates and zero-fills a second ``[B, T + 1, V]``
    buffer: one logits-sized allocation out of place, none with ``inplace_backward``. Same bits either way.
    """
    if logits.dtype == torch.float64:
        return _fp64_fallback("logits").logits_logprobs(
            logits, labels, active=active, temperature=temperature, return_entropy=return_entropy,
            inplace_backward=inplace_backward, softcap=softcap,
        )
    if logits.dim() not in (2, 3):
        logits = logits.reshape(-1, logits.shape[-1])
    if logits.shape[-1] > 1 and logits.stride(-1) != 1:
        logits = logits.contiguous()
    labels, active = _flags(labels, active)
    base = next_token_base(logits) if torch.is_grad_enabled() and not torch.compiler.is_compiling() else None
    extra = dict(extra_position=True) if base is not None else {}
    logp, entropy, _lse = torch.ops.gspo_kernels.logits_fwd(
        logits if base is None else base, labels, active, float(temperature), bool(return_entropy),
        bool(inplace_backward), *_cap_arg(softcap), **extra,
    )
    return logp, (entropy if return_entropy else None)


def release_buffers() -> None:
    """Free the buffers the backend keeps between calls: the logits path's out-of-place gradient and the
    hidden-state path's saved logits (each reused by the next call once nothing holds it, like the gradient below).

    The backward of :func:`logits_logprobs` (``inplace_backward=False``) writes each gradient into the storage of
    the previous one once nothing else holds it (fresh memory on every step cost page faults, zero-filling and,
    in a VM that reports free pages to its host, host faults: steps of the same inputs varied up to 4x; see
    ``docs/cpu_backends.md``). That keeps one gradient-sized buffer (``[B, T, V]`` or ``[B, T + 1, V]`` in the
    logits' dtype) allocated between steps, and one saved-logits buffer (up to ``memory_budget`` bytes); this frees
    them. ``GSPO_KERNELS_CPU_KEEP_GRADIENT=0`` in the environment (read once per process) never keeps either.
    """
    _load_extension()
    torch.ops.gspo_kernels.release_buffers()


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


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    labels: Tensor,
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    memory_budget: Optional[int] = None,
    batch_invariant: bool = False,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-token ``(logp [N], entropy [N] | None)`` of ``hidden @ weight.T + bias``.

    ``softcap``: see the backend contract (fp32 math; with a cap the bias is not shifted by its max).

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
    if torch.float64 in (hidden.dtype, weight.dtype):
        if batch_invariant:
            raise ValueError("batch_invariant=True is not available for fp64 hidden states or weight on backend "
                             "'cpu': fp64 runs through the 'torch' backend, whose matmuls round a row depending on "
                             "the batch's shape; pass fp32/bf16/fp16 tensors or batch_invariant=False")
        return _fp64_fallback("hidden states").linear_logprobs(
            hidden, weight, bias, labels, active=active, temperature=temperature, return_entropy=return_entropy,
            memory_budget=memory_budget, softcap=softcap,
        )
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


def _cap_arg(softcap: Optional[float]) -> Tuple[float, ...]:
    """The ops' trailing ``softcap`` argument: omitted without a cap (the ops' default 0 = none)."""
    return () if softcap is None else (float(softcap),)


def saved_columns(rows: int, vocab: int, vocab_block: int, budget_bytes: int) -> int:
    """How many leading vocabulary columns of the ``[rows, vocab]`` fp32 logits fit in the budget
    (whole tiles of ``vocab_block`` columns, or the whole vocabulary)."""
    block = max(1, min(vocab_block, vocab))
    if rows == 0 or rows * vocab * 4 <= budget_bytes:
        return vocab if rows else 0
    return min(vocab, (budget_bytes // (rows * 4)) // block * block)


def make_backend() -> Backend:
    """The ``cpu`` backend; raises ``RuntimeError`` when the C++ extension is not built."""
    _load_extension()
    return Backend("cpu", logits_logprobs, linear_logprobs, supports=lambda device: torch.device(device).type == "cpu")
