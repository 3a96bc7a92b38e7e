"""The C++ operators of ``backend="cpu"``: the extension loaded once (built on first use by
:mod:`gspo_kernels.backends.cpu.build`), their fake (meta) implementations and autograd formulas, the
arguments every call passes them (labels and flags, the optional ``softcap``), and the fp64 route through
the ``torch`` backend."""

from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.backends.cpu import build as cpu_build

logger = logging.getLogger("gspo_kernels")

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
# The operators' arguments, and the fp64 route.
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


def _cap_arg(softcap: Optional[float]) -> Tuple[float, ...]:
    """The ops' trailing ``softcap`` argument: omitted without a cap (the ops' default 0 = none)."""
    return () if softcap is None else (float(softcap),)
