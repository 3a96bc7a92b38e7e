"""``backend="cpu"``: the C++ heavy stage (``csrc/``, built as ``gspo_kernels.backends._C``) for CPU tensors.

The extension registers the operators ``torch.ops.gspo_kernels.{logits_fwd, logits_bwd, logits_bwd_,
linear_fwd, linear_bwd}`` (schemas in ``csrc/module.cpp``). This module gives them fake (meta)
implementations, so ``torch.compile(fullgraph=True)`` traces through them, and autograd formulas
(``torch.library.register_autograd``), then exposes the two backend functions.

* logits path: one pass over each row (OpenMP over rows), fp32 math from fp16/bf16/fp32 logits;
  the backward reads the logits once more from the saved logsumexp and skips rows without gradient.
* hidden-state path: ``[ROW_BLOCK, VOCAB_BLOCK]`` logits tiles produced by ATen's matmul and folded
  in one pass; the backward recomputes tiles for the rows with gradient only, dH/dW in fp32.
  Memory for speed: the forward keeps up to ``SAVE_LOGITS_BYTES`` of fp32 logits tiles (whole
  vocabulary tiles, from the first one on) and the backward reads them instead of recomputing them,
  saving one of the four ``N*H*V`` GEMMs for that share of the vocabulary. ``SAVE_LOGITS_BYTES = 0``
  recomputes everything (the least memory: one tile plus the fp32 ``dW``).

fp64 inputs run the portable ``torch`` backend (fp64 math), and that is logged once.
The light sequence stage is the PyTorch one (:func:`gspo_kernels.objective.gspo_objective`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.backends import Backend
from gspo_kernels.backends.tiling import as_rows

logger = logging.getLogger("gspo_kernels")

ROW_BLOCK = 1024  # rows per logits tile of the hidden-state path (the weight is streamed once per block)
VOCAB_BLOCK = 8192  # vocabulary entries per tile: a [1024, 8192] fp32 tile is 32 MiB
SAVE_LOGITS_BYTES = 1 << 30  # logits kept from the forward for the backward (1 GiB; 0: recompute all)

_registered = False
_fp64_announced = False


def _load_extension() -> None:
    """Import ``gspo_kernels.backends._C`` and register the fake and autograd implementations once."""
    global _registered
    if _registered:
        return
    try:
        importlib.import_module("gspo_kernels.backends._C")  # registers torch.ops.gspo_kernels.*
    except ImportError as exc:
        raise RuntimeError(
            "the C++ extension gspo_kernels.backends._C is not built (run `pip install --no-build-isolation -e .` "
            f"or `python setup.py build_ext --inplace` in the repository): {exc}"
        ) from exc
    _register_fakes()
    _register_autograd()
    _registered = True


# ---------------------------------------------------------------------------------------------
# Fake (meta) implementations: output shapes and dtypes only.
# ---------------------------------------------------------------------------------------------


def _register_fakes() -> None:
    lib = "gspo_kernels::"

    @torch.library.register_fake(lib + "logits_fwd")
    def _(logits, labels, active, temperature, return_entropy, inplace_backward):
        n = labels.shape[0]
        return tuple(logits.new_empty((n,), dtype=torch.float32) for _ in range(3))

    @torch.library.register_fake(lib + "logits_bwd")
    def _(grad_logp, grad_entropy, logits, labels, active, lse, entropy, temperature):
        return logits.new_empty(logits.shape)

    @torch.library.register_fake(lib + "logits_bwd_")
    def _(logits, grad_logp, grad_entropy, labels, active, lse, entropy, temperature):
        return None

    @torch.library.register_fake(lib + "linear_fwd")
    def _(hidden, weight, bias, labels, active, temperature, return_entropy, row_block, vocab_block, save_cols):
        n = hidden.shape[0]
        stats = tuple(hidden.new_empty((n,), dtype=torch.float32) for _ in range(3))
        return (*stats, hidden.new_empty((n * save_cols,), dtype=torch.float32))

    @torch.library.register_fake(lib + "linear_bwd")
    def _(grad_logp, grad_entropy, hidden, weight, bias, labels, active, lse, entropy, saved, temperature,
          row_block, vocab_block, save_cols, weight_grad):
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
        logits, labels, active, temperature, _return_entropy, inplace_backward = inputs
        _logp, entropy, lse = output
        ctx.set_materialize_grads(False)  # no zero-filled gradients for unused outputs
        ctx.save_for_backward(logits, labels, active, lse, entropy)
        ctx.temperature = temperature
        ctx.inplace = inplace_backward

    def logits_backward(ctx, grad_logp, grad_entropy, _grad_lse):
        logits, labels, active, lse, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        if ctx.inplace and not torch.compiler.is_compiling():
            target = logits.detach()
            ops.logits_bwd_(target, grad_logp, grad_entropy, labels, active, lse, entropy, ctx.temperature)
            grad = target
        else:
            grad = ops.logits_bwd(grad_logp, grad_entropy, logits, labels, active, lse, entropy, ctx.temperature)
        return grad, None, None, None, None, None

    torch.library.register_autograd(
        "gspo_kernels::logits_fwd", logits_backward, setup_context=logits_setup
    )

    def linear_setup(ctx, inputs, output):
        hidden, weight, bias, labels, active, temperature, _return_entropy, row_block, vocab_block, save_cols = inputs
        _logp, entropy, lse, saved = output
        ctx.set_materialize_grads(False)  # else the unused `saved` output gets an [N, save_cols] zero gradient
        ctx.save_for_backward(hidden, weight, bias, labels, active, lse, entropy, saved)
        ctx.temperature = temperature
        ctx.blocks = (row_block, vocab_block, save_cols)

    def linear_backward(ctx, grad_logp, grad_entropy, _grad_lse, _grad_saved):
        hidden, weight, bias, labels, active, lse, entropy, saved = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        weight_grad = bool(ctx.needs_input_grad[1])
        grad_hidden, grad_weight, grad_bias = ops.linear_bwd(
            grad_logp, grad_entropy, hidden, weight, bias, labels, active, lse, entropy, saved, ctx.temperature,
            *ctx.blocks, weight_grad,
        )
        return (
            grad_hidden if ctx.needs_input_grad[0] else None,
            grad_weight if weight_grad else None,
            grad_bias if bias is not None and ctx.needs_input_grad[2] else None,
            None, None, None, None, None, None, None,
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
    from gspo_kernels.backends import pytorch as torch_backend

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
) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-token ``(logp [N] fp32, entropy [N] fp32 | None)`` from ``logits [N, V]`` / ``[B, T, V]``.

    Any strides with a unit last stride are read in place (e.g. ``logits[:, :-1]``); other layouts
    are copied once. With ``inplace_backward`` the gradient is written into the logits' storage.
    """
    if logits.dtype == torch.float64:
        return _fp64_fallback("logits").logits_logprobs(
            logits, labels, active=active, temperature=temperature, return_entropy=return_entropy,
            inplace_backward=inplace_backward,
        )
    if logits.dim() not in (2, 3):
        logits = logits.reshape(-1, logits.shape[-1])
    if logits.shape[-1] > 1 and logits.stride(-1) != 1:
        logits = logits.contiguous()
    labels, active = _flags(labels, active)
    logp, entropy, _lse = torch.ops.gspo_kernels.logits_fwd(
        logits, labels, active, float(temperature), bool(return_entropy), bool(inplace_backward)
    )
    return logp, (entropy if return_entropy else None)


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    labels: Tensor,
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-token ``(logp [N] fp32, entropy [N] fp32 | None)`` of ``hidden @ weight.T + bias``.

    ``hidden``: ``[N, H]`` or ``[B, T, H]``; ``weight``: ``[V, H]``; ``bias``: ``[V]`` or None.
    Extra memory: ``O(N)`` plus one ``[ROW_BLOCK, VOCAB_BLOCK]`` fp32 tile (and an fp32 copy of the
    active rows of ``hidden`` when it is not fp32), up to ``SAVE_LOGITS_BYTES`` of saved logits
    between forward and backward, and the fp32 ``dW`` accumulator in the backward.
    """
    if torch.float64 in (hidden.dtype, weight.dtype):
        return _fp64_fallback("hidden states").linear_logprobs(
            hidden, weight, bias, labels, active=active, temperature=temperature, return_entropy=return_entropy
        )
    rows = as_rows(hidden)
    labels, active = _flags(labels, active)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (rows, weight, bias))
    budget = SAVE_LOGITS_BYTES if needs_grad else 0  # no backward will read them
    save_cols = saved_columns(rows.shape[0], weight.shape[0], VOCAB_BLOCK, budget)
    logp, entropy, _lse, _saved = torch.ops.gspo_kernels.linear_fwd(
        rows, weight, bias, labels, active, float(temperature), bool(return_entropy), ROW_BLOCK, VOCAB_BLOCK,
        save_cols,
    )
    return logp, (entropy if return_entropy else None)


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
