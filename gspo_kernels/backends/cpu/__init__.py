"""``backend="cpu"``: the C++ heavy stage (``csrc/``, compiled on first use) for CPU tensors.

The extension registers the operators ``torch.ops.gspo_kernels.{logits_fwd, logits_bwd, logits_bwd_,
linear_fwd, linear_bwd}`` (schemas in ``csrc/module.cpp``). One module per job:

* ``build.py``: compiles the C++ sources on first use into a per-user cache and loads the library;
* ``ops.py``: loads it once and gives the operators fake (meta) implementations, so
  ``torch.compile(fullgraph=True)`` traces through them, and autograd formulas
  (``torch.library.register_autograd``); the operators' argument conventions and the fp64 route;
* ``logits.py``: ``logits -> (logp, entropy)`` (``logits_logprobs``) and ``release_buffers``;
* ``linear.py``: ``hidden @ weight.T (+ bias) -> (logp, entropy)`` (``linear_logprobs``), its block shapes
  (``blocks``) and the saved-logits budget (``saved_columns``).

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
The light sequence stage is the PyTorch one (:func:`gspo_kernels.objectives.stage.gspo_objective`).
"""

from __future__ import annotations

import torch

from gspo_kernels.backends.contract import Backend
from gspo_kernels.backends.cpu import build
from gspo_kernels.backends.cpu.linear import blocks, linear_logprobs, saved_columns
from gspo_kernels.backends.cpu.logits import logits_logprobs, release_buffers
from gspo_kernels.backends.cpu.ops import _load_extension

__all__ = ["blocks", "build", "linear_logprobs", "logits_logprobs", "make_backend", "release_buffers", "saved_columns",
           "supports"]


def supports(device: torch.device) -> bool:
    """CPU tensors only."""
    return torch.device(device).type == "cpu"


def make_backend() -> Backend:
    """The ``cpu`` backend; raises ``RuntimeError`` when the C++ extension is not built."""
    _load_extension()
    return Backend("cpu", logits_logprobs, linear_logprobs, supports=supports)
