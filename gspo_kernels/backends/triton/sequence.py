"""The fused sequence stage's launcher: :class:`SequenceParams` (the launch's options from the config, once per
config object), :func:`sequence_stage` (the two launches of ``sequence_kernels.py``), the autograd Function
:class:`TritonSequenceObjective` and the backend's objective, :func:`fused_objective` (docs/kernels.md).

:class:`TritonSequenceObjective` turns the kernels' coefficients into gradients with
``dL/dlogp = c * (grad_out * out[O_SCALE_LOGP])`` and ``dL/dH = mask * (grad_out * out[O_SCALE_ENTROPY])``:
it saves the per-token coefficients ``[N]``, so its backward is two ``[N]`` multiplications.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels import objectives
from gspo_kernels.backends.triton.configs import (  # noqa: F401 (LOSS_TYPE_CODES: part of the table, read by tests)
    AGGREGATION_CODES,
    LEVEL_CODES,
    LOSS_TYPE_CODES,
    ROLLOUT_CODES,
    SEQUENCE_BLOCK_S,
    SEQUENCE_BLOCK_T,
    SEQUENCE_NUM_WARPS,
)
from gspo_kernels.backends.triton.launch import device_guard
from gspo_kernels.backends.triton.objectives import HELPERS
from gspo_kernels.backends.triton.sequence_kernels import gspo_reduce_kernel, gspo_sequence_kernel
from gspo_kernels.backends.triton.sequence_slots import (  # noqa: F401 (the slots, read by tests)
    METRICS,
    NUM_OUTPUTS,
    O_LOSS,
    O_SCALE_ENTROPY,
    O_SCALE_LOGP,
    O_W_MEAN,
    OBJECTIVE_SLOTS,
    PARTIALS_STRIDE,
)
from gspo_kernels.config import GSPOConfig
from gspo_kernels.layout import LossInputs
from gspo_kernels.objectives.stage import LossOutput, gspo_objective


def _f32(x: Optional[Tensor]) -> Optional[Tensor]:
    """``x`` as a flat contiguous fp32 tensor; ``x`` itself when it already is one (the usual case: the layout
    has flattened and upcast every per-token input), so a call dispatches no op for it."""
    if x is None:
        return None
    if x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous():
        return x
    return x.detach().reshape(-1).to(torch.float32).contiguous()


@dataclass(frozen=True)
class SequenceParams:
    """What the two launches take from the config: the sequence kernel's float options and constexpr codes (its
    keyword arguments, one field each, named as the kernel names them), the reduction's aggregation code and
    its two config scalars. Built once per (config object, per-token advantages) by :func:`sequence_params`;
    the inputs themselves (present, or None) are the launches' positional arguments."""

    eps_low: float
    eps_high: float
    delta: float  # 0 without a delta (HAS_DELTA False)
    beta: float
    log_ratio_clamp: float  # 0 without a clamp (HAS_CLAMP False)
    clip_ratio_c: float
    obj_a: float  # the objective's float options (Objective.triton_floats), 0 past its own
    obj_b: float
    obj_c: float
    obj_d: float
    rc_lo: float
    rc_hi: float
    opsm_threshold: float
    LEVEL: int
    HELPERS: tuple  # the objective's Triton helpers (its module's TRITON, backends/triton/objectives)
    ROLLOUT: int
    BIAS_CORRECTION_KL: bool
    HAS_DELTA: bool
    HAS_CLAMP: bool
    HAS_DUAL: bool
    OBJ_OPTION: bool  # the objective's constexpr option (Objective.triton_option)
    FOLD: bool  # it folds the correction factor into its weight
    THROUGH_WEIGHT: bool  # its loss depends on the weight
    HAS_OPSM: bool
    ADV_PER_TOKEN: bool
    SEQ_MEAN: bool
    SEQ_UNITS: bool
    loss_type: int  # the reduction's LOSS_TYPE (AGGREGATION_CODES)
    dr_grpo_factor: float  # max_completion_length (dr_grpo's denominator is S times this)
    entropy_coef: float

    @classmethod
    def of(cls, config: GSPOConfig, per_token_adv: bool) -> "SequenceParams":
        lo, hi = config.rollout_bounds
        spec = objectives.objective(config.objective)
        if not has_kernels(config):  # the backend's entries check has_kernels and take PyTorch's stage instead
            raise ValueError(f"config: the objective {spec.name!r} has no Triton helpers (backends/triton/objectives); "
                             f"the sequence kernels cannot compute it (has_kernels(config) is False)")
        floats = tuple(float(x) for x in spec.triton_floats(config)) + (0.0,) * 4
        return cls(
            eps_low=float(config.epsilon_low),
            eps_high=float(config.epsilon_high),
            delta=float(config.delta) if config.delta is not None else 0.0,
            beta=float(config.beta),
            log_ratio_clamp=float(config.log_ratio_clamp) if config.log_ratio_clamp is not None else 0.0,
            clip_ratio_c=float(config.clip_ratio_c or 0.0),
            obj_a=floats[0],
            obj_b=floats[1],
            obj_c=floats[2],
            obj_d=floats[3],
            rc_lo=float("-inf") if lo is None else float(lo),
            rc_hi=float("inf") if hi is None else float(hi),
            opsm_threshold=float(config.off_policy_mask_threshold or 0.0),
            LEVEL=LEVEL_CODES[config.importance_sampling_level],
            HELPERS=HELPERS[spec.name],
            ROLLOUT=ROLLOUT_CODES[config.rollout_correction],
            BIAS_CORRECTION_KL=bool(config.use_bias_correction_kl),
            HAS_DELTA=config.delta is not None,
            HAS_CLAMP=config.log_ratio_clamp is not None,
            HAS_DUAL=config.clip_ratio_c is not None,
            OBJ_OPTION=bool(spec.triton_option(config)),
            FOLD=spec.folds_correction,
            THROUGH_WEIGHT=spec.loss_through_weight,
            HAS_OPSM=config.off_policy_mask_threshold is not None,
            ADV_PER_TOKEN=per_token_adv,
            SEQ_MEAN=config.effective_aggregation == "grpo",
            SEQ_UNITS=spec.one_weight_per_response or (config.importance_sampling_level == "sequence"
                                                       and not per_token_adv),
            loss_type=AGGREGATION_CODES[config.effective_aggregation],
            dr_grpo_factor=float(config.max_completion_length or 1),
            entropy_coef=float(config.entropy_coef),
        )

    @functools.cached_property
    def sequence_kwargs(self) -> dict:
        """The sequence kernel's keyword arguments: every field but the reduction's (kept: built once)."""
        return {name: getattr(self, name) for name in _SEQUENCE_KERNEL_FIELDS}  # not asdict: it copies the helpers


_SEQUENCE_KERNEL_FIELDS = tuple(f.name for f in dataclasses.fields(SequenceParams)
                                if f.name not in ("loss_type", "dr_grpo_factor", "entropy_coef"))

# The launch parameters per config object: ``{id(config): (config, {per_token_adv: SequenceParams})}``. The
# entry holds the config itself, so an id found here is the same live object (a frozen dataclass: its fields
# cannot have changed); never keyed by equality, so two equal configs whose floats differ in the sign of a zero
# never share parameters. Bounded: cleared when full.
_PARAMS: dict = {}
_PARAMS_MAX = 64


def sequence_params(config: GSPOConfig, per_token_adv: bool) -> SequenceParams:
    """The :class:`SequenceParams` of ``config`` (computed once per config object and advantage layout)."""
    entry = _PARAMS.get(id(config))
    if entry is None or entry[0] is not config:
        if len(_PARAMS) >= _PARAMS_MAX:
            _PARAMS.clear()
        entry = (config, {})
        _PARAMS[id(config)] = entry
    params = entry[1].get(per_token_adv)
    if params is None:
        params = entry[1][per_token_adv] = SequenceParams.of(config, per_token_adv)
    return params


def sequence_stage(
    logp: Tensor, entropy: Optional[Tensor], inputs: LossInputs, config: GSPOConfig
) -> Tuple[Tensor, Tensor]:
    """Launch both kernels.

    Args:
        logp, entropy: ``[N]`` (converted to contiguous fp32); ``entropy`` None when it is not needed.
        inputs: the validated per-token inputs (mask, ``cu_seqlens``, advantages ``[S]`` or ``[N]``, optional
            old / reference / rollout log-probs, ``is_ratio``, ``num_items_in_batch``).
        config: the loss options (``beta > 0`` needs ``inputs.ref_logprobs``, ``rollout_correction`` needs
            ``inputs.rollout_logprobs``: :func:`gspo_kernels.layout.prepare_loss_inputs` checked both).

    Returns:
        ``coef [N]`` fp32, ``dL/dlogp_t = coef_t * out[O_SCALE_LOGP]``, and ``out [NUM_OUTPUTS]`` fp32
        (loss, gradient scales and metrics at the ``O_*`` slots).
    """
    coef, out, _ = _sequence_stage(logp, entropy, inputs, config)
    return coef, out


def _sequence_stage(logp: Tensor, entropy: Optional[Tensor], inputs: LossInputs, config: GSPOConfig):
    """:func:`sequence_stage`, also returning the loss as a 0-dim fp32 tensor of its own (written by the
    reduction kernel next to ``out[O_LOSS]``). Per call: three allocations, two launches, no other op when the
    inputs are already flat fp32 (what the layout gives); everything taken from the config is computed once per
    config object (:func:`sequence_params`). An input the options do not need goes to the kernel as None."""
    batch = inputs.batch
    device = logp.device
    n_tokens = logp.numel()
    num_seqs = batch.cu_seqlens.numel() - 1
    params = sequence_params(config, bool(inputs.advantages_per_token))
    items = inputs.num_items_in_batch
    if items is not None:
        items = items.detach().reshape(1).to(device=device, dtype=torch.float32)
    coef = torch.empty(n_tokens, device=device, dtype=torch.float32)
    partials = torch.empty((max(num_seqs, 1), PARTIALS_STRIDE.value), device=device, dtype=torch.float32)
    out = torch.empty(NUM_OUTPUTS, device=device, dtype=torch.float32)
    loss = torch.empty((), device=device, dtype=torch.float32)
    with device_guard(logp):
        if num_seqs > 0:
            gspo_sequence_kernel[(num_seqs,)](
                _f32(logp),
                _f32(entropy),
                _f32(inputs.old_logprobs),
                _f32(inputs.ref_logprobs) if config.beta > 0 else None,
                _f32(inputs.advantages),
                _f32(inputs.is_ratio),
                _f32(inputs.rollout_logprobs),
                _f32(batch.mask),
                batch.cu_seqlens.contiguous(),
                coef,
                partials,
                BLOCK_T=SEQUENCE_BLOCK_T,
                num_warps=SEQUENCE_NUM_WARPS,
                **params.sequence_kwargs,
            )
        grpo_denominator = float(max(num_seqs, 1))
        gspo_reduce_kernel[(1,)](
            partials,
            items,
            out,
            loss,
            num_seqs,
            grpo_denominator,
            grpo_denominator * params.dr_grpo_factor,
            params.entropy_coef,
            LOSS_TYPE=params.loss_type,
            HAS_NUM_ITEMS=items is not None,
            BLOCK_S=SEQUENCE_BLOCK_S,
            num_warps=SEQUENCE_NUM_WARPS,
        )
    return coef, out, loss


def metric_slots(config: GSPOConfig, has_rollout: bool, has_entropy: bool = False):
    """``(name, O_* slot as an int)`` of the metrics the objective of ``config`` reports (those of
    :func:`gspo_kernels.objectives.stage.gspo_objective`), read from ``METRICS``: with ``has_rollout`` the
    ``rollout/*`` ones, with ``has_entropy`` the ``entropy``, with ``config.beta > 0`` the ``kl``; first the
    objective's own (``Objective.metrics``, its slots named in ``OBJECTIVE_SLOTS``)."""
    present = {"objective": True, "rollout": has_rollout, "entropy": has_entropy, "kl": config.beta > 0}
    own = [(name, OBJECTIVE_SLOTS[slot].value) for name, slot in objectives.objective(config.objective).metrics]
    return own + [(name, slot.value) for name, slot, when in METRICS if present[when]]


class TritonSequenceObjective(torch.autograd.Function):
    """``(logp [N], entropy [N] | None) -> (loss 0-dim, out [NUM_OUTPUTS])``; ``out`` holds the metrics."""

    @staticmethod
    def forward(ctx, logp, entropy, inputs: LossInputs, config: GSPOConfig):
        # Grad mode is off inside forward: nothing below is recorded, so logp / entropy need no detach.
        coef, out, loss = _sequence_stage(logp, entropy, inputs, config)
        ctx.save_for_backward(coef, out, inputs.batch.mask)
        ctx.logp_dtype = logp.dtype
        ctx.entropy_dtype = None if entropy is None else entropy.dtype
        ctx.entropy_coef = config.entropy_coef
        ctx.mark_non_differentiable(out)
        ctx.set_materialize_grads(False)
        return loss, out

    @staticmethod
    def backward(ctx, grad_loss, _grad_out):
        coef, out, mask = ctx.saved_tensors
        if grad_loss is None:
            return None, None, None, None
        grad_loss = grad_loss.to(torch.float32)
        grad_logp = None
        grad_entropy = None
        if ctx.needs_input_grad[0]:
            grad_logp = (coef * (grad_loss * out[O_SCALE_LOGP.value])).to(ctx.logp_dtype)
        if ctx.needs_input_grad[1] and ctx.entropy_coef != 0:
            grad_entropy = (mask * (grad_loss * out[O_SCALE_ENTROPY.value])).to(ctx.entropy_dtype)
        return grad_logp, grad_entropy, None, None


def has_kernels(config: GSPOConfig) -> bool:
    """Whether the sequence kernels compute ``config``'s objective (it has Triton helpers,
    ``backends/triton/objectives``). An objective registered without them runs PyTorch's sequence stage on this
    backend too: :func:`fused_objective` then calls it, and the composite losses (``logits_loss``, ``linear_loss``)
    take their two-stage form, so that every route of the backend computes what that stage computes."""
    return config.objective in HELPERS


def fused_objective(logp: Tensor, entropy: Optional[Tensor], inputs: LossInputs, config: GSPOConfig) -> LossOutput:
    """The backend's ``objective``: :func:`gspo_kernels.objectives.stage.gspo_objective` computed by the fused kernels.

    ``logp``, ``entropy``: ``[N]`` (fp32). ``entropy`` may be None only when ``config.entropy_coef == 0``
    (the ``entropy`` metric is then omitted; the loss pipeline checked it). Metrics are detached 0-dim fp32 tensors.
    """
    if not has_kernels(config):  # an objective without Triton helpers: PyTorch's
        return gspo_objective(logp, entropy, inputs, config)
    loss, out = TritonSequenceObjective.apply(logp, entropy, inputs, config)
    slots = metric_slots(config, inputs.rollout_logprobs is not None, entropy is not None)
    metrics = {name: out[index] for name, index in slots}
    return LossOutput(loss.to(logp.dtype), metrics)


def fused_objective_gradient(logp: Tensor, entropy: Optional[Tensor], inputs: LossInputs,
                             config: GSPOConfig) -> Tuple[Tensor, Optional[Tensor]]:
    """``(dL/dlogp [N], dL/dentropy [N] or None)`` of :func:`fused_objective`'s loss at ``(logp, entropy)``, for
    an incoming loss gradient of 1: bit for bit what ``torch.autograd.grad(fused_objective(...).loss, ...)``
    returns (``coef * (1 * scale) == coef * scale``), without the autograd engine: no graph, no ``ones_like``,
    no 0-dim product, no hop to the engine's device thread; the two launches and one multiplication per
    gradient. For callers that need the gradient inside a forward (the hidden-state path's per-chunk
    gradients). ``dL/dentropy`` is None when ``config.entropy_coef == 0`` (the loss does not depend on the
    entropy then). Dtypes: those of ``logp`` / ``entropy`` (fp32, or fp64 for fp64 inputs). Only for a ``config``
    the kernels compute (:func:`has_kernels`).
    """
    coef, out, _ = _sequence_stage(logp, entropy, inputs, config)
    grad_logp = (coef * out[O_SCALE_LOGP.value]).to(logp.dtype)
    grad_entropy = None
    if config.entropy_coef != 0:
        grad_entropy = (inputs.batch.mask * out[O_SCALE_ENTROPY.value]).to(entropy.dtype)
    return grad_logp, grad_entropy
