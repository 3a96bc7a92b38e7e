"""What the tests share: random loss inputs (fresh per call; seeded by conftest), comparisons with the
float64 reference at the library's stated tolerances, and the ``gpu`` marker's rule."""

from __future__ import annotations

import itertools
import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gspo_kernels import GSPOConfig
from gspo_kernels.config import IMPORTANCE_SAMPLING_LEVELS as LEVELS
from gspo_kernels.config import LOSS_TYPES
from gspo_kernels.testing import FP32_RTOL as RTOL
from gspo_kernels.testing import rel_err

__all__ = ["LEVELS", "LOSS_TYPES", "RTOL", "rel_err", "Case", "Designed", "RESPONSES", "CASE_LENGTHS", "CASE_T",
           "make_case",
           "assert_case_covers", "matrix_budget", "configs", "objective_configs",
           "objective_id", "check_against_reference",
           "logits_loss_vs_reference", "linear_loss_vs_reference", "assert_zero_rows_get_zero_dh",
           "assert_bf16_within_fp32_math_plus_rounding", "assert_bf16_no_worse_than_plain_bf16", "skip_gpu_items_without_cuda",
           "device_for", "TRITON_DEVICE", "triton_test_device", "on_device", "capture_cuda_graph",
           "save_tiny_policy"]


def device_for(backend: str) -> str:
    """The one place the tests choose a device: where ``backend``'s tests put their tensors.

    ``"cuda"`` on a machine with CUDA for every backend but ``"cpu"`` (the Triton backend then runs compiled:
    ``setup_triton_interpreter`` leaves the interpreter off there, and it refuses CPU tensors); ``"cpu"``
    otherwise (the Triton backend then runs in the interpreter on CPU tensors). The C++ ``cpu`` backend is
    for CPU tensors everywhere.
    """
    return "cuda" if torch.cuda.is_available() and backend != "cpu" else "cpu"


# The device of every test of the Triton kernels (the compiled kernels on CUDA, the interpreter on CPU).
TRITON_DEVICE = device_for("triton")


def triton_test_device() -> str:
    """:data:`TRITON_DEVICE` for a module of Triton kernel tests; skips the module where there is no GPU and the
    Triton interpreter is off."""
    from gspo_kernels.backends.triton.launch import interpreter_active

    if TRITON_DEVICE == "cpu" and not interpreter_active():
        pytest.skip("no GPU and the Triton interpreter is off (TRITON_INTERPRET=1 must be set before importing triton)",
                    allow_module_level=True)
    return TRITON_DEVICE


def on_device(tensors, backend: str):
    """``tensors`` (a dict, list or tuple; None entries and non-tensors kept) moved to :func:`device_for` ``(backend)``."""
    device = device_for(backend)
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    if isinstance(tensors, dict):
        return {k: move(v) for k, v in tensors.items()}
    return type(tensors)(move(v) for v in tensors)


# ---------------------------------------------------------------------------------------------------------------
# The responses of every loss case, each there on purpose (the same responses padded and packed). A log-ratio is
# ``logp - old`` of one counted token; a response's mean log-ratio is its GSPO log-weight. Every value lies at least
# 5e-5 from every clip edge of the configs below (log-space edges -3e-4, -1e-4, 1e-4, 2e-4, 4e-4: epsilon_low /
# high, GMPO's and CISPO's bands, delta, the dual clip's c), so fp32 and float64 clip the same tokens.
# ---------------------------------------------------------------------------------------------------------------
E = 1e-4


@dataclass(frozen=True)
class Designed:
    """One response of :func:`make_case`: the log-ratios of its counted tokens (in order), its advantage, the
    positions of its masked tokens (their inputs are garbage that must not reach a result), and the engine-vs-trainer
    log-ratios ``old - rollout`` of its counted tokens (the rollout correction's input)."""

    role: str
    log_ratios: tuple
    adv: float
    masked: tuple = ()
    rollout: tuple = ()

    @property
    def length(self) -> int:
        return len(self.log_ratios) + len(self.masked)


RESPONSES = (
    # Under the guarded interpreter (tests/conftest.py) even programs run after their odd neighbours: the responses
    # that carry a gradient are even, and each odd response starts with a token inside every band, so that a write
    # past an even response's end changes a result whatever the sign of that response's advantage.
    Designed("inside every band at the sequence level; its tokens leave both token-level edges (A > 0)",
             (7 * E, -6 * E, 1.5 * E, -0.5 * E), 1.0, masked=(2,), rollout=(4.0, -0.3, 4.0, 0.2)),
    Designed("clipped high at the sequence level (A > 0, w above every band)", (0.5 * E, 13.5 * E), 0.8,
             rollout=(0.3, 0.35)),
    Designed("above every band with A < 0: not clipped (the dual clip and delta bite)",
             (15 * E, 3 * E, 7 * E, -6 * E, 16 * E), -1.2, masked=(1,), rollout=(-0.5, 0.2, -0.1, 0.3, 0.1)),
    Designed("clipped low at the sequence level (A < 0, w below every band)", (0.5 * E, -12.5 * E), -0.7,
             rollout=(-0.45, -0.3)),
    Designed("below every band with A > 0: not clipped; the engine agrees", (-6 * E, -6 * E), 0.6, rollout=(0.0, 0.0)),
    Designed("length 1, zero advantage (no gradient without KL or entropy terms)", (0.5 * E,), 0.0, rollout=(-0.5,)),
    Designed("every token masked", (), 1.1, masked=(0, 1)),
    Designed("empty", (), 0.5),
)
CASE_LENGTHS = tuple(r.length for r in RESPONSES)
CASE_T = max(CASE_LENGTHS)  # the padded layout's T (the longest response has no padding, every other one has)


@dataclass
class Case:
    labels: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    is_ratio: torch.Tensor
    mask: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    vocab: int
    rollout_logprobs: Optional[torch.Tensor] = None
    current: Optional[torch.Tensor] = None  # the float64 log-probs the case was built against (token shape)
    log_ratio: Optional[torch.Tensor] = None  # the designed logp - old (float64, NaN at masked tokens)

    def kwargs(self, with_ref: bool = True, config=None) -> dict:
        """The keyword arguments of the loss; with a ``config`` that asks for the rollout correction, the
        rollout log-probs replace ``is_ratio``."""
        kw = dict(mask=self.mask, cu_seqlens=self.cu_seqlens, is_ratio=self.is_ratio)
        if with_ref:
            kw["ref_logprobs"] = self.ref_logprobs
        if config is not None and (config.rollout_correction is not None or config.off_policy_mask_threshold):
            kw["rollout_logprobs"] = self.rollout_logprobs
            if config.rollout_correction is not None:
                kw["is_ratio"] = None
        return kw


def _designed_tokens(packed: bool):
    """``(counted, values, rollout, response)`` of :data:`RESPONSES` in the token layout (flattened ``[S, CASE_T]``
    when padded): which tokens count, their designed log-ratio and ``old - rollout`` (0 where not counted), and the
    response of each token (its row at padding)."""
    S = len(RESPONSES)
    n = sum(CASE_LENGTHS) if packed else S * CASE_T
    counted = torch.zeros(n, dtype=torch.bool)
    values, rollout = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    response = torch.full((n,), -1)
    start = 0
    for i, r in enumerate(RESPONSES):
        base = start if packed else i * CASE_T
        ratios, shifts = iter(r.log_ratios), iter(r.rollout or (0.0,) * len(r.log_ratios))
        for t in range(r.length):
            response[base + t] = i
            if t not in r.masked:
                counted[base + t] = True
                values[base + t], rollout[base + t] = next(ratios), next(shifts)
        if not packed:
            response[base + r.length:base + CASE_T] = i  # padding: the response's row, never counted
        start += r.length
    return counted, values, rollout, response


def make_case(logp_of, vocab: int, *, packed: bool, per_token_adv: bool = False) -> Case:
    """Loss inputs for :data:`RESPONSES` around the current policy's log-probs ``logp_of(labels)`` (float64).

    The old log-probs are ``current - log_ratio`` with the designed log-ratios, so which responses and tokens clip
    does not depend on the seed (:func:`assert_case_covers` checks it against the reference's metrics); the seed
    draws the labels (hence the log-probs), the advantages' sizes (per token when ``per_token_adv``: the response's
    sign times a size in [0.5, 1.5)), ``is_ratio`` (per response when padded, per token when packed) and the
    reference log-probs. Masked tokens hold garbage everywhere (labels -100, old / reference / rollout log-probs far
    off), which must never reach a result.
    """
    S = len(RESPONSES)
    counted, ratios, d, response = _designed_tokens(packed)
    token_shape = (counted.numel(),) if packed else (S, CASE_T)
    labels = torch.randint(0, vocab, (counted.numel(),))
    labels[~counted] = -100  # masked and padding labels outside the vocabulary must be ignored
    current = logp_of(labels.clamp(min=0).reshape(token_shape)).reshape(-1)
    old = torch.where(counted, current - ratios, current + 3.0)
    rollout = torch.where(counted, old - d, old - 5.0)
    ref = torch.where(counted, current + torch.randn(counted.numel(), dtype=torch.float64) * 0.3, current - 9.0)
    signs = torch.tensor([r.adv for r in RESPONSES])
    if per_token_adv:
        adv = signs[response.clamp(min=0)] * (0.5 + torch.rand(counted.numel()))
        adv[~counted] = 7.0  # garbage at masked tokens
        adv = adv.reshape(token_shape)
    else:
        adv = signs * (0.5 + torch.rand(S))
    cu = torch.tensor([0, *itertools.accumulate(CASE_LENGTHS)], dtype=torch.int32) if packed else None
    # per response in the padded layout (each backend broadcasts it to the tokens), per token when packed
    is_ratio = (1 + 0.1 * torch.rand((S,) if not packed else token_shape)).float()
    as_tokens = lambda x: x.reshape(token_shape)  # noqa: E731
    return Case(as_tokens(labels), adv.float(), as_tokens(old).float(), as_tokens(ref).float(), is_ratio,
                as_tokens(counted.float()), cu, vocab, as_tokens(rollout).float(), current=as_tokens(current),
                log_ratio=as_tokens(torch.where(counted, ratios, float("nan"))))


def assert_case_covers(config, case: Case, metrics: dict) -> None:
    """The case exercises what ``config`` can do, from the float64 reference's ``metrics`` on it and the designed
    log-ratios: clipping at both edges with non-zero advantages and unclipped tokens beside them (the level's units:
    responses or tokens), CISPO's cap, the dual clip, ``delta``, off-policy masking and the rollout correction each
    binding somewhere and not everywhere. Fails on a case that would let a bug in one of them pass."""
    value = lambda name: float(metrics[name])  # noqa: E731
    if "clip_ratio/low_mean" in metrics:
        assert value("clip_ratio/low_mean") > 0 and value("clip_ratio/high_mean") > 0, metrics
        assert value("clip_ratio/region_mean") < 1, metrics
    if "cispo_clip_ratio" in metrics:
        assert 0 < value("cispo_clip_ratio") < 1, metrics
    counted, _, _, response = _designed_tokens(case.cu_seqlens is not None)
    seq = response[counted]  # the response of each counted token
    per_token = case.advantages.shape == case.mask.shape
    adv = (case.advantages.reshape(-1)[counted] if per_token else case.advantages[seq]).double()
    if config.importance_sampling_level == "token":
        r = case.log_ratio.reshape(-1)[counted]
    else:  # the response's mean log-ratio on each of its tokens
        means = [sum(x.log_ratios) / max(len(x.log_ratios), 1) for x in RESPONSES]
        r = torch.tensor(means, dtype=torch.float64)[seq]
    for bound in (config.clip_ratio_c, config.delta):  # each caps A < 0 tokens whose weight passes it
        if bound is not None:
            binds = (adv < 0) & (r > math.log(bound))
            assert bool(binds.any()) and not bool(binds.all()), bound
    if config.rollout_correction is not None:
        bites = value("rollout/masked_fraction") > 0 or value("rollout/weight_max") == config.rollout_correction_max \
            or value("rollout/weight_min") == config.rollout_correction_min
        assert bites and value("rollout/weight_max") > 0, metrics
    if config.off_policy_mask_threshold is not None:
        sampling = case.rollout_logprobs if case.rollout_logprobs is not None else case.old_logprobs
        gap = sampling.double().reshape(-1)[counted] - case.current.reshape(-1)[counted]
        S = len(RESPONSES)
        mean_gap = torch.zeros(S, dtype=torch.float64).index_add_(0, seq, gap) / torch.bincount(seq, minlength=S)
        dropped = (adv < 0) & (mean_gap[seq] > config.off_policy_mask_threshold)
        assert bool(dropped.any()) and bool(((adv < 0) & ~dropped).any()), "off-policy mask"


def configs(levels=LEVELS, loss_types=LOSS_TYPES):
    """Every level x loss type, each with a different mix of the optional terms."""
    out = []
    for i, (level, loss_type) in enumerate(itertools.product(levels, loss_types)):
        out.append(GSPOConfig(
            importance_sampling_level=level,
            loss_type=loss_type,
            max_completion_length=9,
            beta=0.04 if i % 2 == 0 else 0.0,
            use_bias_correction_kl=i % 4 == 0,
            delta=1.0002 if i % 3 == 0 else None,
            temperature=0.7 if i % 5 == 0 else 1.0,
            entropy_coef=0.01 if i % 3 == 1 else 0.0,
        ))
    return out


def objective_configs():
    """The objectives beyond the clipped surrogate, the dual clip, off-policy masking and every rollout
    correction mode, each once, on different levels and aggregations (weights sit within ~3e-4 of 1 in
    :func:`make_case`, so the clip edges below are reached; rollout log-probs 0.4 away, so a cap of 1.5 bites)."""
    C = GSPOConfig
    rc = dict(rollout_correction_max=1.5)
    return [
        C(loss_type="sapo", importance_sampling_level="token", beta=0.04, entropy_coef=0.01),
        C(loss_type="sapo", importance_sampling_level="sequence", rollout_correction="token_truncate", **rc),
        C(loss_type="cispo", importance_sampling_level="token", epsilon_high=1.0001, rollout_correction="icepop",
          **rc),
        C(loss_type="cispo", cispo_clip="band", importance_sampling_level="sequence_token", epsilon_low=1e-4,
          epsilon_high=1e-4, aggregation="bnpo", temperature=0.7),
        C(loss_type="luspo", importance_sampling_level="sequence", clip_ratio_c=1.0001,
          rollout_correction="sequence_mask", **rc),
        C(loss_type="vespo", importance_sampling_level="token", beta=0.04, use_bias_correction_kl=True,
          rollout_correction="token_mask", **rc),
        C(loss_type="vespo", importance_sampling_level="sequence", vespo_k_pos=1.5, vespo_lambda_neg=0.5, beta=0.04,
          use_bias_correction_kl=True),
        C(loss_type="gmpo", importance_sampling_level="sequence", epsilon_low=1e-4, epsilon_high=2e-4,
          rollout_correction="sequence_truncate", **rc),
        C(loss_type="grpo", importance_sampling_level="token", clip_ratio_c=1.0001, aggregation="dapo",
          off_policy_mask_threshold=0.05),
        C(loss_type="dr_grpo", importance_sampling_level="token", max_completion_length=9,
          rollout_correction="sequence_masked_tis", **rc),
        C(loss_type="bnpo", importance_sampling_level="sequence", aggregation="seq_sum", delta=1.0002,
          rollout_correction="token_mask", rollout_correction_min=0.8, rollout_correction_max=None),
        # the divergence gates (OpenRLHF's binary_kl / tv gating), bounds that keep some units and drop others
        # whatever the drawn probabilities p: response 4's engine agrees with the trainer (divergence 0: kept under a
        # max, dropped under a min), two tokens of response 0 are 4 nats less likely to the engine (binary KL about
        # 3p, TV about p: that response is dropped under a max of 1e-5 unless both p < 2e-6)
        C(loss_type="grpo", importance_sampling_level="sequence_token", rollout_correction="sequence_binary_kl_mask",
          rollout_correction_max=1e-5),
        C(loss_type="sapo", importance_sampling_level="token", aggregation="bnpo", rollout_correction="token_tv_mask",
          rollout_correction_min=1e-6, rollout_correction_max=0.5),
    ]


def objective_id(config) -> str:
    parts = [config.loss_type, config.importance_sampling_level]
    if config.aggregation:
        parts.append(config.aggregation)
    if config.cispo_clip != "upper" and config.loss_type == "cispo":
        parts.append(config.cispo_clip)
    if config.clip_ratio_c:
        parts.append("dual")
    if config.off_policy_mask_threshold is not None:
        parts.append("opsm")
    if config.rollout_correction:
        parts.append(config.rollout_correction)
    return "-".join(parts)


def check_against_reference(out, expected, grads, ref_grads, rtol: float = RTOL, loss_scale: float = 1.0) -> None:
    """Loss (relative to max(|loss|, loss_scale): it sums terms of either sign), metrics and gradients.

    ``loss_scale``: the size of one token's term where it is not ~|A| (CISPO / VESPO sum ``w A log pi``, terms
    of size ``|log pi| ~ log V`` that cancel between advantages of either sign)."""
    assert torch.isfinite(out.loss)
    loss_err = abs(out.loss.item() - expected.loss.item()) / max(abs(expected.loss.item()), loss_scale)
    assert loss_err < rtol, (out.loss.item(), expected.loss.item())
    extra = set(out.metrics) - set(expected.metrics)  # implementation diagnostics, never a math metric
    assert set(expected.metrics) <= set(out.metrics) and all(name.startswith("fused_linear/") for name in extra)
    for name, value in expected.metrics.items():
        assert abs(float(out.metrics[name]) - float(value)) <= rtol * max(1.0, abs(float(value))), name
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < rtol


def logits_loss_vs_reference(backend: str, config, packed: bool, V: int = 97, device: str = "cpu"):
    """``gspo_loss(backend=...)`` and the float64 oracle on one fresh case: ``(out, expected, [grad], [ref])``.

    The logits are strided views (padded: ``base[:, :-1]`` of ``[S, T + 1, V]``; packed: the transpose of
    ``[V, N]``); the gradients are taken with respect to ``base``, so nothing outside the view may move.
    Packed cases carry per-token advantages, padded ones per-response advantages. The case covers what ``config``
    can do (:func:`assert_case_covers`).
    """
    import gspo_kernels as gk
    from gspo_kernels import reference

    if packed:
        base = torch.randn(V, sum(CASE_LENGTHS)) * 2
        take = lambda x: x.t()  # noqa: E731
    else:
        base = torch.randn(len(CASE_LENGTHS), CASE_T + 1, V) * 2
        take = lambda x: x[:, :-1]  # noqa: E731
    case = make_case(lambda y: reference.token_logprobs(take(base).double(), y, temperature=config.temperature,
                                                        final_logit_softcapping=config.final_logit_softcapping), V,
                     packed=packed, per_token_adv=packed)
    x = base.clone().to(device).requires_grad_()
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
          for k, v in case.kwargs(config.beta > 0, config).items()}
    out = gk.gspo_loss(take(x), case.labels.to(device), case.advantages.to(device), case.old_logprobs.to(device),
                       config=config, backend=backend, **kw)
    grads = torch.autograd.grad(out.loss, (x,))
    x64 = base.double().requires_grad_()
    expected = reference.gspo_loss(take(x64), case.labels, case.advantages, case.old_logprobs, config=config,
                                   **case.kwargs(config.beta > 0, config))
    assert_case_covers(config, case, expected.metrics)
    return out, expected, [g.cpu() for g in grads], torch.autograd.grad(expected.loss, (x64,))


def matrix_budget(index: int, V: int) -> Optional[int]:
    """The ``memory_budget`` of the ``index``-th config of a hidden-state parity matrix: every other one runs with
    4 fp32 rows of logits (the Triton one-pass loss then takes responses longer than that in two passes, the torch
    and cpu backends recompute their tiles instead of keeping them), the others with the default."""
    return 4 * V * 4 if index % 2 else None


def linear_loss_vs_reference(backend: str, config, packed: bool, V: int = 75, H: int = 24, device: str = "cpu",
                             memory_budget: Optional[int] = None):
    """``fused_linear_gspo_loss(backend=...)`` (with a bias) and the float64 oracle: grads of (hidden, W, b).

    ``hidden`` is a strided view, columns ``1..H`` of a ``[S, T + 1, H + 3]`` (padded, also dropping the first
    position) or ``[N, H + 3]`` (packed) buffer; its gradient is taken with respect to that buffer. The case
    covers what ``config`` can do (:func:`assert_case_covers`).
    """
    import gspo_kernels as gk
    from gspo_kernels import reference

    if packed:
        base = torch.randn(sum(CASE_LENGTHS), H + 3)
        take = lambda x: x[:, 1 : H + 1]  # noqa: E731
    else:
        base = torch.randn(len(CASE_LENGTHS), CASE_T + 1, H + 3)
        take = lambda x: x[:, 1:, 1 : H + 1]  # noqa: E731
    weight, bias = torch.randn(V, H) * 0.3, torch.randn(V) * 0.1
    case = make_case(
        lambda y: reference.linear_logprobs(take(base), weight, y, bias=bias, temperature=config.temperature,
                                            final_logit_softcapping=config.final_logit_softcapping), V,
        packed=packed, per_token_adv=packed,
    )
    leaves = [t.clone().to(device).requires_grad_() for t in (base, weight, bias)]
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
          for k, v in case.kwargs(config.beta > 0, config).items()}
    out = gk.fused_linear_gspo_loss(take(leaves[0]), leaves[1], case.labels.to(device), case.advantages.to(device),
                                    case.old_logprobs.to(device), bias=leaves[2], config=config, backend=backend,
                                    memory_budget=memory_budget, **kw)
    grads = torch.autograd.grad(out.loss, leaves)
    leaves64 = [t.double().requires_grad_() for t in (base, weight, bias)]
    expected = reference.fused_linear_gspo_loss(take(leaves64[0]), leaves64[1], case.labels, case.advantages,
                                                case.old_logprobs, bias=leaves64[2], config=config,
                                                **case.kwargs(config.beta > 0, config))
    assert_case_covers(config, case, expected.metrics)
    return out, expected, [g.cpu() for g in grads], torch.autograd.grad(expected.loss, leaves64)


def assert_zero_rows_get_zero_dh(config, grads, ref_grads) -> None:
    """Rows that carry no gradient (masked, clipped, zero advantage) get exactly zero dH."""
    if config.beta == 0 and config.entropy_coef == 0:
        H = ref_grads[0].shape[-1]
        zero_rows = ref_grads[0].reshape(-1, H).abs().amax(dim=1) == 0
        assert bool(zero_rows.any())
        assert torch.all(grads[0].reshape(-1, H)[zero_rows] == 0)


def assert_bf16_within_fp32_math_plus_rounding(backend: str, path: str, softcap: Optional[float] = None) -> None:
    """bf16 inputs through ``backend``'s public loss: the loss within the fp32 tolerance of the float64 oracle
    (on the same rounded inputs), gradients within :func:`gspo_kernels.testing.gradient_tolerance`
    (the fp32 error plus the roundings of a bf16 result, at most ``2^-6``). Never the plain bf16 path's error.
    ``softcap``: with ``GSPOConfig(final_logit_softcapping=softcap)`` on both sides. The inputs live on
    :func:`device_for` ``(backend)``."""
    import gspo_kernels as gk
    from gspo_kernels import reference
    from gspo_kernels.testing import gradient_tolerance

    B, T, V, H = 4, 16, 1000, 64
    labels = torch.randint(0, V, (B, T))
    if path == "logits":
        inputs = [(torch.randn(B, T, V) * 3).bfloat16()]
        as_logits = lambda xs: xs[0]  # noqa: E731
    else:
        inputs = [torch.randn(B, T, H).bfloat16(), (torch.randn(V, H) * 0.2).bfloat16()]
        as_logits = lambda xs: xs[0] @ xs[1].T  # noqa: E731
    old = (reference.token_logprobs(as_logits([x.double() for x in inputs]), labels, final_logit_softcapping=softcap)
           - torch.randn(B, 1) * 2e-4).float()
    adv = torch.randn(B)
    config = GSPOConfig(final_logit_softcapping=softcap)
    device = device_for(backend)
    leaves = [x.to(device).requires_grad_() for x in inputs]
    fn = gk.gspo_loss if path == "logits" else gk.fused_linear_gspo_loss
    out = fn(*leaves, labels.to(device), adv.to(device), old.to(device), backend=backend, config=config)
    grads = [g.cpu() for g in torch.autograd.grad(out.loss, leaves)]
    leaves64 = [x.double().requires_grad_() for x in inputs]
    expected = reference.gspo_loss(as_logits(leaves64), labels, adv, old, config=config)
    ref_grads = torch.autograd.grad(expected.loss, leaves64)
    assert abs(out.loss.item() - expected.loss.item()) <= RTOL * max(1.0, abs(expected.loss.item()))
    tol = gradient_tolerance("bf16", path, backend=backend, device=device)
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) <= tol, (rel_err(got, want), tol)


# The former name: its callers (per-backend copies of test_conformance.py's half-precision test) now get
# the honest bound above.
assert_bf16_no_worse_than_plain_bf16 = assert_bf16_within_fp32_math_plus_rounding


def skip_gpu_items_without_cuda(items) -> None:
    """Mark every item carrying ``@pytest.mark.gpu`` as skipped (with the reason) when CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU-only: no CUDA device on this machine (never ran here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def capture_cuda_graph(step, warmups: int = 2):
    """``(graph, outputs)``: ``step()`` (a loss step: forward and ``torch.autograd.grad``) captured in a
    ``torch.cuda.CUDAGraph`` with a clean harness. CUDA only.

    - The warm-up (``warmups`` calls: kernel compilation, the GEMM probes) runs on a side stream, and its
      outputs are dropped at once: no eager autograd graph is alive on the default stream when the capture
      begins (an eager step whose graph is still alive makes any capture of a backward fail with "operation
      would make the legacy stream depend on a capturing blocking stream", plain PyTorch included).
    - During the capture ``torch.cuda.set_sync_debug_mode("error")``: a host read (``.item()``, ``nonzero``, a
      blocking copy, a synchronize) raises naming the operation, so a successful capture shows the step reads
      nothing back (the README's promise). The mode is set inside the ``torch.cuda.graph`` block because
      entering it synchronizes the device on purpose.

    ``outputs`` are the captured step's static tensors: ``graph.replay()`` rewrites them from the current
    contents of the step's input tensors (change inputs in place with ``copy_``).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()  # the outputs (and the autograd graph behind them) die here
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")
        try:
            outputs = step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return graph, outputs


class NewTensors(TorchDispatchMode):
    """Records, at torch's dispatcher, every op (``ops``) and every *new* tensor (storage not aliasing an input)
    of at least ``min_numel`` elements (``big``: ``(op, shape)``): ``empty``, ``zeros``, ``new_empty`` and the
    outputs of custom operators alike."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel = min_numel
        self.ops = []
        self.big = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        self.ops.append(str(func))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() >= self.min_numel and \
                    t.untyped_storage().data_ptr() not in inputs:
                self.big.append((str(func), tuple(t.shape)))
        return out


def record_host_reads(monkeypatch) -> list:
    """From now until ``monkeypatch.undo()``: the name of every host read of a tensor value (``tolist``, ``item``,
    ``bool()``, ``int()``, ``float()``, ``nonzero``, ``cpu``, ``numpy``), appended to the returned list."""
    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _f=original, **k: (reads.append(_n),
                                                                                             _f(self, *a, **k))[1])
    real_nonzero = torch.nonzero
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: (reads.append("torch.nonzero"), real_nonzero(*a, **k))[1])
    return reads


def replays_against_eager(graph, static, step, static_adv, patterns, tol: float):
    """Replay the captured ``graph`` once per ``(advantages, zero)`` of ``patterns``, the advantages written into
    the captured ``static_adv``: each replay's outputs ``static`` within ``tol`` (relative) of the eager ``step()``
    on the same inputs. Yields the replayed gradient (``static[1]``, fp32) and ``zero``, the responses at zero
    advantage, for the caller's own checks."""
    for advantages, zero in patterns:
        static_adv.copy_(advantages)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.detach().clone() for t in static]
        eager = [t.detach() for t in step()]
        for a, b in zip(eager, replayed):
            assert rel_err(b, a) < tol
        yield replayed[1].float(), zero


def save_tiny_policy(path, kind: str = "dense", tokenizer: bool = True):
    """A tiny ``kind`` policy of the toy trainer (``"dense"``: Qwen3; ``"moe"``: Qwen3-MoE, 8 experts, 2 routed per
    token; hidden size 32, 2 layers) saved to ``path``, its config naming the path (with beta > 0, TRL builds its
    reference model from it), with the Hugging Face tokenizer where ``tokenizer``. Returns ``path``."""
    from gspo_kernels.train.tasks import ToyTokenizer, hf_tokenizer
    from gspo_kernels.train.toy_trainer import build_policy

    model = build_policy(kind, ToyTokenizer(), hidden_size=32, num_layers=2, seed=0)
    model.config._name_or_path = str(path)
    model.save_pretrained(path)
    if tokenizer:
        hf_tokenizer().save_pretrained(path)
    return path


def run_launch(command: List[str], timeout: float, env: Optional[dict] = None) -> str:
    """``command`` in its own process group; killed (and the test failed) when it runs past ``timeout``: a rank that
    hangs in a collective fails the test instead of blocking the suite. Returns its output."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(command)} did not finish within {timeout} s (a rank hung?):\n{out[-4000:]}") \
            from None
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({proc.returncode}):\n{out[-6000:]}")
    return out


def spawn_within(fn, args: tuple, nprocs: int, timeout: float) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with a deadline: a rank that raises fails the test (as
    ``spawn`` does, the others terminated); ranks still running after ``timeout`` seconds (a rank hung in a
    collective) are killed and the test fails, instead of blocking the suite."""
    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise AssertionError(f"{nprocs} ranks of {fn.__name__} did not finish within {timeout} s (a rank hung?)")
