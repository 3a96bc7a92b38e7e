"""The public functions and modules: validate once, run the chosen backend's stages."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from gspo_kernels import backends
from gspo_kernels.config import GSPOConfig
from gspo_kernels.objective import LossOutput, gspo_objective
from gspo_kernels.validation import (
    ValueChecks,
    check_finite_linear,
    check_finite_logits,
    check_labels,
    check_linear,
    check_logits,
    check_temperature,
    prepare_loss_inputs,
)

Scalar = Union[None, int, float, Tensor]


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    check_finite: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Differentiable per-token log-probs ``log softmax(logits / temperature)[labels]`` in fp32.

    Args:
        logits: ``[..., V]`` fp16/bf16/fp32/fp64, any strides (never copied to fp32 in full).
        labels: ``[...]`` integer, in ``[0, V)``.
        check_finite: raise ``ValueError`` naming ``logits`` when a row holds NaN or +inf or a non-finite
            logit at its label (default: NaN in, NaN out; see ``docs/policies.md``).
    Returns:
        ``logp`` shaped like ``labels`` (fp32; fp64 for fp64 logits), and the entropy ``H`` of each
        row's distribution when ``return_entropy``. First-order differentiable only.
    """
    check_logits(logits, labels, None)
    check_temperature(temperature)
    checks = ValueChecks()
    flat = check_labels(labels, logits.shape[-1], checks)
    checks.run()
    if check_finite:
        check_finite_logits(logits, flat, checks)
        checks.run()
    impl = backends.resolve(backend, logits.device)
    rows = logits if logits.dim() in (2, 3) else logits.reshape(-1, logits.shape[-1])
    logp, entropy = impl.logits_logprobs(
        rows, flat, active=None, temperature=temperature, return_entropy=return_entropy, inplace_backward=False
    )
    logp, entropy = first_order_only(logp, entropy)
    logp = logp.reshape(labels.shape)
    return (logp, entropy.reshape(labels.shape)) if return_entropy else logp


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    check_finite: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Per-token log-probs (and entropy) of ``hidden @ weight.T + bias``; the logits never exist.

    Args:
        hidden: ``[..., H]``; weight: ``[V, H]`` (the lm_head); bias: ``[V]`` or None;
        labels: ``[...]`` integer in ``[0, V)``.
        check_finite: raise ``ValueError`` naming ``hidden``, ``weight`` or ``bias`` when they hold NaN or
            inf (``-inf`` bias entries off the labels are allowed; see ``docs/policies.md``).
    Returns:
        fp32 tensors shaped like ``labels``; first-order differentiable for hidden, weight and bias.
    """
    check_linear(hidden, weight, bias, labels)
    check_temperature(temperature)
    checks = ValueChecks()
    flat = check_labels(labels, weight.shape[0], checks)
    checks.run()
    if check_finite:
        check_finite_linear(hidden, weight, bias, flat, checks)
        checks.run()
    impl = backends.resolve(backend, hidden.device)
    rows = hidden if hidden.dim() in (2, 3) else hidden.reshape(-1, hidden.shape[-1])
    logp, entropy = impl.linear_logprobs(
        rows, weight, bias, flat, active=None, temperature=temperature, return_entropy=return_entropy
    )
    logp, entropy = first_order_only(logp, entropy)
    logp = logp.reshape(labels.shape)
    return (logp, entropy.reshape(labels.shape)) if return_entropy else logp


def gspo_loss(
    logits: Tensor,
    labels: Tensor,
    advantages: Tensor,
    old_logprobs: Optional[Tensor] = None,
    *,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    is_ratio: Optional[Tensor] = None,
    num_items_in_batch: Scalar = None,
    config: Optional[GSPOConfig] = None,
    backend: str = "auto",
    inplace_backward: bool = False,
    check_finite: bool = False,
) -> LossOutput:
    """The GSPO / GRPO loss from logits (see ``docs/math.md``).

    Args:
        logits: ``[B, T, V]`` (padded layout) or ``[N, V]`` (packed), any float dtype, any strides;
            aligned so that position ``t`` predicts ``labels[t]``.
        labels: ``[B, T]`` or ``[N]`` integer; unmasked entries in ``[0, V)``.
        advantages: per response ``[S]`` or per token (labels' shape).
        old_logprobs: log-probs of the sampling policy (labels' shape); None means on-policy.
        mask: token mask (labels' shape), bool, integer or float holding only 0 and 1;
            cu_seqlens: ``[S + 1]`` int32/int64 (packed layout).
        ref_logprobs: reference-model log-probs, required when ``config.beta > 0``.
        is_ratio: inference-engine importance correction, per token or per response.
        num_items_in_batch: global token count for ``loss_type="dapo"``: a finite number > 0 (int, float or
            one-element tensor), used as given.
        inplace_backward: write the logits gradient into ``logits``' storage (the logits are consumed).
        check_finite: raise ``ValueError`` naming the argument when a float input holds NaN / inf at an
            unmasked position (``-inf`` logits off the label are allowed). Default: NaN in, NaN out.
    Returns:
        ``LossOutput(loss, metrics)``: 0-dim loss (first-order differentiable), detached 0-dim metrics.
    """
    config = _check_config(config)
    check_logits(logits, labels, cu_seqlens)
    inputs = prepare_loss_inputs(
        labels, advantages, logits.shape[-1], old_logprobs=old_logprobs, mask=mask, cu_seqlens=cu_seqlens,
        ref_logprobs=ref_logprobs, is_ratio=is_ratio, num_items_in_batch=num_items_in_batch, config=config,
        check_finite=check_finite,
    )
    if check_finite:
        checks = ValueChecks()
        check_finite_logits(logits, inputs.labels, checks, inputs.batch.mask > 0)
        checks.run()
    impl = backends.resolve(backend, logits.device)
    logp, entropy = impl.logits_logprobs(
        logits, inputs.labels, active=inputs.batch.mask > 0, temperature=config.temperature,
        return_entropy=True, inplace_backward=inplace_backward,
    )
    return _first_order_loss((impl.objective or gspo_objective)(logp, entropy, inputs, config))


def fused_linear_gspo_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    advantages: Tensor,
    old_logprobs: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    is_ratio: Optional[Tensor] = None,
    num_items_in_batch: Scalar = None,
    config: Optional[GSPOConfig] = None,
    backend: str = "auto",
    inplace_backward: bool = False,
    check_finite: bool = False,
) -> LossOutput:
    """:func:`gspo_loss` of ``hidden @ weight.T + bias`` without ever forming the logits.

    Args:
        hidden: ``[B, T, H]`` or ``[N, H]``; weight: ``[V, H]`` (the lm_head); bias: ``[V]`` or None.
        The other arguments are those of :func:`gspo_loss` (``inplace_backward`` has no effect here).
    """
    config = _check_config(config)
    check_linear(hidden, weight, bias, labels)
    inputs = prepare_loss_inputs(
        labels, advantages, weight.shape[0], old_logprobs=old_logprobs, mask=mask, cu_seqlens=cu_seqlens,
        ref_logprobs=ref_logprobs, is_ratio=is_ratio, num_items_in_batch=num_items_in_batch, config=config,
        check_finite=check_finite,
    )
    if check_finite:
        checks = ValueChecks()
        check_finite_linear(hidden, weight, bias, inputs.labels, checks, inputs.batch.mask > 0)
        checks.run()
    impl = backends.resolve(backend, hidden.device)
    logp, entropy = impl.linear_logprobs(
        hidden, weight, bias, inputs.labels, active=inputs.batch.mask > 0, temperature=config.temperature,
        return_entropy=True,
    )
    return _first_order_loss((impl.objective or gspo_objective)(logp, entropy, inputs, config))


class GSPOLoss(nn.Module):
    """Module form of :func:`gspo_loss`: ``GSPOLoss(config)(logits, labels, advantages, old, **kw)``."""

    def __init__(self, config: Optional[GSPOConfig] = None, *, backend: str = "auto", inplace_backward: bool = False,
                 check_finite: bool = False):
        super().__init__()
        self.config = _check_config(config)
        self.backend = backend
        self.inplace_backward = inplace_backward
        self.check_finite = check_finite

    def forward(self, logits: Tensor, labels: Tensor, advantages: Tensor, old_logprobs: Optional[Tensor] = None,
                **kwargs) -> LossOutput:
        kwargs.setdefault("check_finite", self.check_finite)
        return gspo_loss(logits, labels, advantages, old_logprobs, config=self.config, backend=self.backend,
                         inplace_backward=self.inplace_backward, **kwargs)


class FusedLinearGSPOLoss(nn.Module):
    """Module form of :func:`fused_linear_gspo_loss`: ``(hidden, weight, labels, advantages, old, **kw)``."""

    def __init__(self, config: Optional[GSPOConfig] = None, *, backend: str = "auto", check_finite: bool = False):
        super().__init__()
        self.config = _check_config(config)
        self.backend = backend
        self.check_finite = check_finite

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor, advantages: Tensor,
                old_logprobs: Optional[Tensor] = None, **kwargs) -> LossOutput:
        kwargs.setdefault("check_finite", self.check_finite)
        return fused_linear_gspo_loss(hidden, weight, labels, advantages, old_logprobs, config=self.config,
                                      backend=self.backend, **kwargs)


def _check_config(config: Optional[GSPOConfig]) -> GSPOConfig:
    if config is None:
        return GSPOConfig()
    if not isinstance(config, GSPOConfig):
        raise TypeError(f"config must be a GSPOConfig, got {type(config).__name__}")
    return config


DOUBLE_BACKWARD_ERROR = (
    "gspo_kernels does not support double backward: its losses and log-probs are differentiable once "
    "(torch.autograd.grad(..., create_graph=True) and higher-order gradients are refused on every backend)"
)


class _FirstOrderOnly(torch.autograd.Function):
    """Identity whose backward refuses to build a graph (``create_graph=True``): the one place where every
    backend's double backward is refused with :data:`DOUBLE_BACKWARD_ERROR`. First-order gradients pass
    through untouched (``None`` stays ``None``, so the backward stages still skip zero-gradient rows)."""

    @staticmethod
    def forward(ctx, *tensors: Tensor):
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        if torch.is_grad_enabled():  # the autograd engine enables grad mode exactly when create_graph=True
            raise RuntimeError(DOUBLE_BACKWARD_ERROR)
        return grads


def first_order_only(*tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """``tensors`` unchanged in value; a backward with ``create_graph=True`` through them raises
    ``RuntimeError`` (:data:`DOUBLE_BACKWARD_ERROR`). Tensors that need no gradient are returned as is."""
    index = [i for i, t in enumerate(tensors) if t is not None and t.requires_grad]
    if not index:
        return tensors
    wrapped = _FirstOrderOnly.apply(*(tensors[i] for i in index))
    out = list(tensors)
    for i, t in zip(index, wrapped):
        out[i] = t
    return tuple(out)


def _first_order_loss(output: LossOutput) -> LossOutput:
    (loss,) = first_order_only(output.loss)
    return LossOutput(loss, output.metrics)
