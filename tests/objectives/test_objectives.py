"""The objectives beyond the clipped surrogate (SAPO, CISPO, LUSPO, VESPO, GMPO), the dual clip, off-policy
sequence masking and the rollout correction: every backend against the float64 reference (logits and hidden
states, padded and packed, and ``policy_loss``), the gradients the peers define (stop-gradients included),
the peers' own functions (TRL 1.16, verl 0.9.1) on the same inputs, and the config's refusals.

Tolerances: fp32 results within 1e-5 relative of float64 (``tests/support.py``); the torch backend in float64
within 1e-10 of the peers' float64 results.
"""

from __future__ import annotations

import math

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import reference
from tests.support import (
    RTOL,
    assert_case_covers,
    check_against_reference,
    device_for,
    linear_loss_vs_reference,
    logits_loss_vs_reference,
    make_case,
    matrix_budget,
    objective_configs,
    objective_id,
    rel_err,
)
from tests.test_conformance import _device, backend  # noqa: F401  (the backend fixture, small tiles included)

CONFIGS = objective_configs()


def _loss_scale(config, vocab: int) -> float:
    """CISPO and VESPO sum ``w A log pi``: one term is ``|log pi| ~ log V`` (the helpers' V), not ``|A|``."""
    return math.log(vocab) if config.loss_type in ("cispo", "vespo") else 1.0


# ---------------------------------------------------------------------------------------------
# Every backend against the float64 reference.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("config", CONFIGS, ids=objective_id)
def test_logits_loss_matches_reference(backend, config, packed, case_seed):  # noqa: F811
    check_against_reference(*logits_loss_vs_reference(backend, config, packed, device=_device(backend)),
                            loss_scale=_loss_scale(config, 97))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("config", CONFIGS, ids=objective_id)
def test_linear_loss_matches_reference(backend, config, packed, case_seed):  # noqa: F811
    """Several chunks and vocabulary tiles on every backend (small tiles; every other config a budget of 4 rows)."""
    budget = matrix_budget(CONFIGS.index(config), 75)
    check_against_reference(*linear_loss_vs_reference(backend, config, packed, device=_device(backend),
                                                      memory_budget=budget), loss_scale=_loss_scale(config, 75))


# More combinations for the sequence stage alone (cheap: no logits): the remaining branches of the fused kernel.
MORE = [
    gk.GSPOConfig(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.0001, log_ratio_clamp=5e-4),
    gk.GSPOConfig(loss_type="sapo", importance_sampling_level="sequence_token", beta=0.04,
                  use_bias_correction_kl=True, off_policy_mask_threshold=0.0),
    gk.GSPOConfig(loss_type="vespo", importance_sampling_level="token", off_policy_mask_threshold=0.05,
                  aggregation="grpo"),
    gk.GSPOConfig(loss_type="gmpo", importance_sampling_level="token", epsilon_low=1e-4, epsilon_high=1e-4,
                  off_policy_mask_threshold=0.05, beta=0.04, use_bias_correction_kl=True, aggregation="dr_grpo",
                  max_completion_length=9),
    gk.GSPOConfig(loss_type="dapo", importance_sampling_level="sequence_token", clip_ratio_c=1.0001, delta=1.0003,
                  rollout_correction="icepop", rollout_correction_max=1.4, entropy_coef=0.01),
    # the other gates (the divergence gates' bounds, on this test's log-probs (p about 0.05 to 0.4): the tokens the
    # engine agrees on have divergence 0 (dropped under a min), those 4 nats apart a binary KL near 0.4 and a TV
    # near p (dropped under a max), the others a binary KL of a few 1e-3 and a TV of a few 1e-2 (kept))
    gk.GSPOConfig(loss_type="grpo", importance_sampling_level="sequence", rollout_correction="sequence_geometric_mask",
                  rollout_correction_min=0.9, rollout_correction_max=1.1),
    gk.GSPOConfig(loss_type="gmpo", importance_sampling_level="token", epsilon_low=1e-4, epsilon_high=2e-4,
                  rollout_correction="token_binary_kl_mask", rollout_correction_min=2e-3, rollout_correction_max=1e-2),
    gk.GSPOConfig(loss_type="luspo", importance_sampling_level="sequence", rollout_correction="sequence_tv_mask",
                  rollout_correction_max=0.05),
]


@pytest.mark.parametrize("draw", range(3))
@pytest.mark.parametrize("config", CONFIGS + MORE, ids=objective_id)
def test_policy_loss_matches_reference(backend, config, draw, case_seed):  # noqa: F811
    """The sequence stage alone (packed, per-token advantages, with entropies), three draws each (its seed per
    test: ``case_seed``)."""
    dev = _device(backend)
    case = make_case(lambda y: torch.randn(y.shape, dtype=torch.float64) * 0.5 - 2.0, 11, packed=True,
                     per_token_adv=True)
    logp = case.current.float()
    entropy = torch.rand(logp.shape) + 0.5
    kw = case.kwargs(config.beta > 0, config)
    x, h = logp.clone().to(dev).requires_grad_(), entropy.clone().to(dev).requires_grad_()
    out = gk.policy_loss(x, case.advantages.to(dev), case.old_logprobs.to(dev), entropy=h, config=config,
                         backend=backend, **{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    grads = [g.cpu() for g in torch.autograd.grad(out.loss, (x, h), allow_unused=True, materialize_grads=True)]
    x64, h64 = logp.double().requires_grad_(), entropy.double().requires_grad_()
    expected = reference.policy_loss(x64, case.advantages, case.old_logprobs, entropy=h64, config=config, **kw)
    assert_case_covers(config, case, expected.metrics)
    ref_grads = torch.autograd.grad(expected.loss, (x64, h64), allow_unused=True, materialize_grads=True)
    check_against_reference(out, expected, grads, ref_grads, loss_scale=_loss_scale(config, 11))


# ---------------------------------------------------------------------------------------------
# The gradients the peers define, from the formulas (not from the code).
# ---------------------------------------------------------------------------------------------


def _token_problem(S=3, T=5, seed=0, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(S, T, generator=g, dtype=torch.float64) * 0.5 - 1.5
    old = logp - torch.randn(S, T, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(S, generator=g, dtype=torch.float64)
    adv[1] = -abs(adv[1]) - 0.2
    adv[0] = abs(adv[0]) + 0.2
    return logp, old, adv


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_cispo_gradient_is_the_detached_capped_weight_times_the_advantage(name):
    """CISPO's loss ``-sg(min(r, cap)) A log pi``: ``dL/dlogp_t = -min(r_t, cap) A / N`` (dapo over N tokens);
    the gradient never flows through the weight, so it differs from ``d/dlogp`` of the value."""
    logp, old, adv = _token_problem()
    cap = 1.1
    cfg = gk.GSPOConfig(loss_type="cispo", importance_sampling_level="token", epsilon_high=cap)
    dev = device_for(name)
    x = logp.float().to(dev).requires_grad_()
    out = gk.policy_loss(x, adv.float().to(dev), old.float().to(dev), config=cfg, backend=name)
    (grad,) = torch.autograd.grad(out.loss, x)
    r = torch.exp(logp - old)
    expected = -torch.clamp(r, max=cap) * adv[:, None] / logp.numel()
    assert rel_err(grad, expected) < RTOL
    assert (r > cap).any() and (r < cap).any()  # both sides of the cap
    expected_value = (-torch.clamp(r, max=cap) * adv[:, None] * logp).sum() / logp.numel()
    assert abs(out.loss.item() - expected_value.item()) < RTOL * max(1.0, abs(expected_value.item()))
    # the band variant (verl): clamp(r, 1 - eps_low, 1 + eps_high)
    cfg = gk.GSPOConfig(loss_type="cispo", cispo_clip="band", importance_sampling_level="token", epsilon_low=0.1,
                        epsilon_high=0.15, aggregation="bnpo")
    x = logp.float().to(dev).requires_grad_()
    (grad,) = torch.autograd.grad(gk.policy_loss(x, adv.float().to(dev), old.float().to(dev), config=cfg,
                                                 backend=name).loss, x)
    assert rel_err(grad, -torch.clamp(r, 0.9, 1.15) * adv[:, None] / logp.numel()) < RTOL


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_sapo_gradient_is_the_soft_gate_derivative(name):
    """SAPO: ``l = -(4 / tau) sigmoid(tau (r - 1)) A``, ``tau = 1.0`` for ``A > 0`` and ``1.05`` otherwise;
    ``dl/dlogp = -4 s (1 - s) r A`` (grpo aggregation: divided by ``|y_i| S``)."""
    logp, old, adv = _token_problem(spread=0.8)
    S, T = logp.shape
    cfg = gk.GSPOConfig(loss_type="sapo", importance_sampling_level="token")
    dev = device_for(name)
    x = logp.float().to(dev).requires_grad_()
    out = gk.policy_loss(x, adv.float().to(dev), old.float().to(dev), config=cfg, backend=name)
    (grad,) = torch.autograd.grad(out.loss, x)
    r = torch.exp(logp - old)
    tau = torch.where(adv > 0, 1.0, 1.05).double()[:, None]
    s = torch.sigmoid(tau * (r - 1))
    assert rel_err(grad, -4 * s * (1 - s) * r * adv[:, None] / (T * S)) < RTOL
    value = (-(4 / tau) * s * adv[:, None]).mean(1).mean()
    assert abs(out.loss.item() - value.item()) < RTOL * max(1.0, abs(value.item()))


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_vespo_gradient_is_the_detached_gamma_weight(name):
    """VESPO: ``log w_i = clamp(sum_t log r_t, log 1e-8, 20)``, ``phi = e^lambda w^k e^(-lambda w)``
    ((2, 3) for ``A >= 0``, (3, 2) otherwise), ``dL/dlogp_t = -phi_i A_i / N``."""
    logp, old, adv = _token_problem(spread=0.1)
    cfg = gk.GSPOConfig(loss_type="vespo", importance_sampling_level="token")
    dev = device_for(name)
    x = logp.float().to(dev).requires_grad_()
    out = gk.policy_loss(x, adv.float().to(dev), old.float().to(dev), config=cfg, backend=name)
    (grad,) = torch.autograd.grad(out.loss, x)
    w = torch.exp((logp - old).sum(1))
    k = torch.where(adv >= 0, 2.0, 3.0).double()
    lam = torch.where(adv >= 0, 3.0, 2.0).double()
    phi = math.e ** lam * w**k * torch.exp(-lam * w)
    assert rel_err(grad, (-phi * adv)[:, None].expand_as(logp) / logp.numel()) < RTOL
    assert abs(float(out.metrics["vespo/phi_seq_mean"]) - phi.mean().item()) < RTOL


def test_gmpo_gradient_by_finite_differences():
    """GMPO has no stop-gradient: the float64 torch objective passes gradcheck, clipped tokens included."""
    logp, old, adv = _token_problem(spread=0.3)
    cfg = gk.GSPOConfig(loss_type="gmpo", epsilon_low=0.2, epsilon_high=0.25)
    r = logp - old
    assert ((r > 0.25) | (r < -0.2)).any() and ((r.abs() < 0.2)).any()
    x = logp.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda lp: gk.policy_loss(lp, adv, old, config=cfg, backend="torch").loss, (x,),
                                    eps=1e-7, atol=1e-9, rtol=1e-6)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_dual_clip_bounds_the_negative_advantage_loss(name):
    """verl's dual clip: for ``A < 0`` and ``r > c`` the token's loss is ``c |A|`` and its gradient 0."""
    c = 1.5
    logp = torch.tensor([[-1.0, -1.0, -1.0]])
    old = logp - torch.tensor([[0.0, math.log(2.0), math.log(1.2)]])  # r = 1, 2, 1.2
    adv = torch.tensor([-1.0])
    cfg = gk.GSPOConfig(importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.2, clip_ratio_c=c,
                        loss_type="bnpo")
    dev = device_for(name)
    x = logp.to(dev).requires_grad_()
    out = gk.policy_loss(x, adv.to(dev), old.to(dev), config=cfg, backend=name)
    (grad,) = torch.autograd.grad(out.loss, x)
    # -min(rA, clip(r)A) = 1, 2, 1.2; the dual clip caps the middle one at 1.5
    assert abs(out.loss.item() - (1 + 1.5 + 1.2) / 3) < 1e-6
    torch.testing.assert_close(grad.cpu(), torch.tensor([[1.0, 0.0, 1.2]]) / 3, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# The peers' own functions on the same inputs (float64).
# ---------------------------------------------------------------------------------------------


def _verl_config(**kw):
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=4,
                       clip_ratio_low=0.2, clip_ratio_high=0.28, **kw)


@pytest.mark.parametrize("mode", ["sapo", "cispo", "geo_mean", "vanilla"])
def test_matches_verl_policy_losses(mode):
    """verl 0.9.1's ``sapo``, ``cispo`` (band clip), ``geo_mean`` and ``vanilla`` (dual clip at 3) against the
    torch objective in float64: loss and gradient (no empty response: verl's seq-mean skips them)."""
    from verl.trainer.ppo import core_algos

    logp, old, adv = _token_problem(S=4, T=6, spread=0.6)
    logp[3] -= 0.0
    old[3] = logp[3] - 1.3  # r = e^1.3 > 3: the dual clip for a negative advantage
    adv[3] = -0.7
    mask = torch.ones_like(logp)
    mask[2, 4:] = 0
    adv_t = adv[:, None].expand_as(logp).clone()
    verl_fn = core_algos.get_policy_loss_fn(mode)
    agg = {"sapo": "seq-mean-token-mean", "cispo": "token-mean", "geo_mean": "token-mean",
           "vanilla": "token-mean"}[mode]
    lp = logp.clone().requires_grad_()
    loss, _ = verl_fn(old_log_prob=old, log_prob=lp, advantages=adv_t, response_mask=mask, loss_agg_mode=agg,
                      config=_verl_config(clip_ratio_c=3.0))
    (verl_grad,) = torch.autograd.grad(loss, lp)
    ours_cfg = {
        "sapo": dict(loss_type="sapo", importance_sampling_level="token"),
        "cispo": dict(loss_type="cispo", cispo_clip="band", importance_sampling_level="token", aggregation="bnpo"),
        "geo_mean": dict(loss_type="gmpo"),
        "vanilla": dict(loss_type="bnpo", importance_sampling_level="token", clip_ratio_c=3.0),
    }[mode]
    cfg = gk.GSPOConfig(epsilon_low=0.2, epsilon_high=0.28, **ours_cfg)
    x = logp.clone().requires_grad_()
    out = gk.policy_loss(x, adv, old, mask=mask, config=cfg, backend="torch")
    (grad,) = torch.autograd.grad(out.loss, x)
    # verl divides by (|y| + 1e-8) in geo_mean: 1e-9 relative at these lengths
    assert abs(out.loss.item() - loss.item()) < 1e-8 * max(1.0, abs(loss.item()))
    assert rel_err(grad * mask, verl_grad * mask) < 1e-8


def test_matches_trl_gamma_weights_and_off_policy_mask():
    """TRL 1.16's ``get_gamma_weights`` (VESPO, with a token-level IS ratio folded in) and
    ``get_off_policy_mask`` against the library's pieces, from the same float64 inputs."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    from gspo_kernels.objectives.stage import off_policy_keep
    from gspo_kernels.objectives.vespo import vespo_log_weight, vespo_phi

    logp, old, adv = _token_problem(S=4, T=6, spread=0.2)
    mask = torch.ones_like(logp)
    mask[2, 3:] = 0
    is_ratio = torch.where(mask > 0, torch.rand(logp.shape, dtype=torch.float64) + 0.5, 1.0)
    is_ratio[0, 1] = 0.0  # a masked-out token: log 0 -> log 1e-8
    phi_trl = GRPOTrainer.get_gamma_weights(adv[:, None], logp - old, mask, is_ratio)
    S, T = logp.shape
    valid, seq = (mask > 0).reshape(-1), torch.arange(S).repeat_interleave(T)
    log_w = vespo_log_weight((logp - old).reshape(-1), is_ratio.reshape(-1), valid, seq, S)
    cfg = gk.GSPOConfig(loss_type="vespo")
    torch.testing.assert_close(vespo_phi(log_w, adv, cfg), phi_trl[:, 0], rtol=1e-12, atol=1e-300)

    sampling = logp - torch.randn(logp.shape, dtype=torch.float64) * 0.3
    sampling[1, 2] = float("nan")  # not scored by the engine: no evidence
    keep_trl = GRPOTrainer.get_off_policy_mask(adv[:, None], logp, sampling, mask, 0.05)
    keep = off_policy_keep(logp.reshape(-1), sampling.reshape(-1), adv[seq], valid, seq, S, 0.05)
    torch.testing.assert_close(keep.reshape(S, T)[:, 0], keep_trl[:, 0])
    assert 0 < keep_trl.sum() < S  # both outcomes


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_rollout_correction_matches_trl_compute_loss_given_its_vllm_weights(mode):
    """TRL 1.16 computes its vLLM importance weights inside ``_generate_and_score_completions`` (during generation,
    no function of their own), so they are written out here from that code: ``exp`` of the masked log-prob
    difference, summed over the response for the sequence modes, truncated or masked at C_min / C_max. TRL's own
    ``_compute_loss`` takes them as ``importance_sampling_ratio``; the library computes them itself from the engine's
    log-probs (``rollout_correction=mode``): the same loss and gradient in float64. The library's weight metrics are
    checked against the written-out weights."""
    logp, old, adv = _token_problem(S=4, T=6, spread=0.05)
    mask = torch.ones_like(logp)
    mask[1, 4:] = 0
    rollout = old - torch.randn(logp.shape, dtype=torch.float64) * 0.15
    c_min, c_max = 0.8, 1.3
    diff = (old - rollout) * mask
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        weights = ratio.clamp(c_min, c_max)
    else:
        weights = ratio.masked_fill((ratio < c_min) | (ratio > c_max), 0.0)
    assert (weights != ratio).any() and (weights == ratio).any()
    x = logp.clone().requires_grad_()
    theirs, _ = _trl_loss("bnpo", "token", x, old, adv[:, None], mask, mask.sum(), is_ratio=weights, epsilon_low=0.2,
                          epsilon_high=0.2)
    corrected = gk.GSPOConfig(importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.2,
                              loss_type="bnpo", rollout_correction=mode, rollout_correction_min=c_min,
                              rollout_correction_max=c_max)
    y = logp.clone().requires_grad_()
    got = gk.policy_loss(y, adv, old, mask=mask, rollout_logprobs=rollout, config=corrected, backend="torch")
    assert abs(got.loss.item() - theirs.item()) < 1e-12
    assert rel_err(torch.autograd.grad(got.loss, y)[0] * mask, torch.autograd.grad(theirs, x)[0] * mask) < 1e-10
    # the mismatch metrics: verl's direct KL estimator, TRL's weight statistics (over responses for sequence modes)
    assert abs(float(got.metrics["rollout/kl"]) - ((rollout - old) * mask).sum().item() / mask.sum().item()) < 1e-6
    weights = weights.expand_as(logp)
    flat = weights[:, 0] if mode.startswith("sequence") else weights[mask > 0]
    assert abs(float(got.metrics["rollout/weight_max"]) - flat.max().item()) < 1e-6
    assert abs(float(got.metrics["rollout/weight_mean"]) - flat.mean().item()) < 1e-6
    zero_fraction = ((weights == 0) & (mask > 0)).sum().item() / mask.sum().item()
    assert abs(float(got.metrics["rollout/masked_fraction"]) - zero_fraction) < 1e-6


# ---------------------------------------------------------------------------------------------
# Inputs and options refused with a clear error.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_type="ppo"), "loss_type must be one of"),
    (dict(aggregation="token-mean"), "aggregation must be None or one of"),
    (dict(aggregation="dr_grpo"), "max_completion_length is required"),
    (dict(loss_type="sapo", sapo_temperature_neg=0.0), "sapo_temperature_neg must be a finite number > 0"),
    (dict(loss_type="sapo", sapo_temperature_pos=float("inf")), "sapo_temperature_pos"),
    (dict(loss_type="cispo"), "epsilon_high is CISPO's absolute cap"),
    (dict(loss_type="cispo", epsilon_high=5.0, cispo_clip="lower"), "cispo_clip must be one of"),
    (dict(loss_type="vespo", vespo_lambda_pos=0.0), "vespo_lambda_pos must be a finite number >= 1e-4"),
    (dict(loss_type="vespo", vespo_k_neg=-1.0), "vespo_k_neg must be a finite number >= 0"),
    (dict(clip_ratio_c=1.0), "clip_ratio_c must be None or a finite number > 1"),
    (dict(loss_type="sapo", clip_ratio_c=3.0), "clip_ratio_c .* applies to the clipped surrogate only"),
    (dict(loss_type="gmpo", delta=2.0), "delta .* applies to the clipped surrogate only"),
    (dict(off_policy_mask_threshold=-0.1), "off_policy_mask_threshold must be None or a finite number >= 0"),
    (dict(rollout_correction="tis"), "rollout_correction must be None or one of"),
    (dict(rollout_correction="token_truncate", rollout_correction_max=0.0), "rollout_correction_max must be"),
    (dict(rollout_correction_min=2.0, rollout_correction_max=1.5), r"rollout_correction_min \(2.0\) must be <="),
    (dict(rollout_correction="token_mask", rollout_correction_max=None), "needs rollout_correction_max or"),
    (dict(rollout_correction="icepop", rollout_correction_max=None), r"needs rollout_correction_max \(C_max\)"),
    (dict(loss_type="vespo", rollout_correction="sequence_mask"), "loss_type='vespo' folds the rollout correction"),
])
def test_config_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gk.GSPOConfig(**kwargs)


def test_rollout_arguments_refused():
    logp, old, adv = _token_problem()
    cfg = gk.GSPOConfig(rollout_correction="token_truncate")
    with pytest.raises(ValueError, match="rollout_logprobs is required"):
        gk.policy_loss(logp, adv, old, config=cfg)
    with pytest.raises(ValueError, match="is_ratio and config.rollout_correction are exclusive"):
        gk.policy_loss(logp, adv, old, rollout_logprobs=old, is_ratio=torch.ones_like(logp), config=cfg)
    with pytest.raises(ValueError, match="rollout_logprobs must have the token shape"):
        gk.policy_loss(logp, adv, old, rollout_logprobs=old[:, :2], config=cfg)
    # rollout_logprobs without a correction: the metrics only, the loss unchanged
    plain = gk.policy_loss(logp, adv, old)
    out = gk.policy_loss(logp, adv, old, rollout_logprobs=old - 0.1)
    assert out.loss.item() == plain.loss.item()
    assert abs(float(out.metrics["rollout/kl"]) + 0.1) < 1e-6 and float(out.metrics["rollout/masked_fraction"]) == 0


# ---------------------------------------------------------------------------------------------
# TRL 1.16's own _compute_loss on given log-probs (its model call replaced by the tensors).
# ---------------------------------------------------------------------------------------------


def _trl_loss(loss_type, level, logp, old, adv, mask, num_items, *, is_ratio=None, sampling=None, **options):
    """``GRPOTrainer._compute_loss`` on a stand-in trainer whose forward returns ``logp``: TRL's formulas,
    aggregation and metrics, unmodified (one process, no gradient accumulation, ``steps_per_generation=1``)."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trl.trainer.grpo_trainer import GRPOTrainer

    args = SimpleNamespace(use_bias_correction_kl=False, delta=None, sapo_temperature_pos=1.0,
                           sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                           vespo_lambda_neg=2.0, steps_per_generation=1)
    trainer = SimpleNamespace(
        args=args, loss_type=loss_type, importance_sampling_level=level, beta=0.0, top_entropy_quantile=1.0,
        epsilon_low=options.get("epsilon_low", 0.2), epsilon_high=options.get("epsilon_high", 0.28),
        off_policy_mask_threshold=options.get("off_policy_mask_threshold"), use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask, get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.ones_like(logp), None),
    )
    B, T = logp.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "num_items_in_batch": torch.tensor(float(num_items))}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    if sampling is not None:
        inputs["sampling_per_token_logps"] = sampling
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, {name: values[-1] for name, values in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type, level, options", [
    ("sapo", "token", {}),
    ("sapo", "sequence", {}),
    ("cispo", "token", dict(epsilon_high=1.3)),
    ("cispo", "sequence", dict(epsilon_high=1.05)),
    ("luspo", "sequence", {}),
    ("luspo", "token", {}),
    ("vespo", "token", {}),
    ("vespo", "token", dict(token_mask=True)),
    ("dapo", "token", dict(off_policy_mask_threshold=0.02)),
])
def test_matches_trl_compute_loss(loss_type, level, options):
    """Loss, gradient and TRL's metrics of ``loss_type`` at ``level`` against TRL's ``_compute_loss`` (float64),
    VESPO with a vLLM token_mask ratio folded in, DAPO with off-policy masking from the sampling log-probs."""
    logp, old, adv = _token_problem(S=4, T=6, spread=0.25)
    mask = torch.ones_like(logp)
    mask[2, 4:] = 0
    num_items = 19.0
    trl_options = {k: v for k, v in options.items() if k != "token_mask"}
    rollout = old - torch.randn(logp.shape, dtype=torch.float64) * 0.1
    is_ratio = None
    if options.get("token_mask"):  # TRL's vLLM token_mask ratio, from its definition
        ratio = torch.exp((old - rollout) * mask)
        is_ratio = ratio.masked_fill((ratio > 1.1) | (ratio < 0.9), 0.0)
        assert (is_ratio == 0).any()
    sampling = rollout if "off_policy_mask_threshold" in options else None
    x = logp.clone().requires_grad_()
    theirs, trl_metrics = _trl_loss(loss_type, level, x, old, adv[:, None], mask, num_items, is_ratio=is_ratio,
                                    sampling=sampling, **trl_options)
    (trl_grad,) = torch.autograd.grad(theirs, x)
    cfg = gk.GSPOConfig(loss_type=loss_type, importance_sampling_level=level, epsilon_low=0.2,
                        epsilon_high=trl_options.get("epsilon_high", 0.28),
                        off_policy_mask_threshold=options.get("off_policy_mask_threshold"),
                        rollout_correction="token_mask" if is_ratio is not None else None,
                        rollout_correction_min=0.9, rollout_correction_max=1.1)
    y = logp.clone().requires_grad_()
    ours = gk.policy_loss(y, adv, old, mask=mask, num_items_in_batch=num_items, config=cfg, backend="torch",
                          rollout_logprobs=rollout if (is_ratio is not None or sampling is not None) else None)
    (grad,) = torch.autograd.grad(ours.loss, y)
    # TRL builds SAPO's temperatures with torch.where on Python floats: fp32 (1.05 -> 1.0499999523), 5e-8 apart
    tol = 1e-6 if loss_type == "sapo" else 1e-10
    assert abs(ours.loss.item() - theirs.item()) < tol * max(1.0, abs(theirs.item()))
    assert rel_err(grad * mask, trl_grad * mask) < tol
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio",
                 "vespo/phi_seq_mean"):
        if name in trl_metrics:
            assert abs(float(ours.metrics[name]) - trl_metrics[name]) < 1e-6, name


@pytest.mark.parametrize("config", [
    gk.GSPOConfig(loss_type="sapo", importance_sampling_level="token"),
    gk.GSPOConfig(loss_type="sapo", importance_sampling_level="sequence", sapo_temperature_neg=2.0),
    gk.GSPOConfig(loss_type="luspo", importance_sampling_level="sequence", epsilon_low=0.1, epsilon_high=0.1,
                  clip_ratio_c=1.2),
    gk.GSPOConfig(loss_type="gmpo", epsilon_low=0.1, epsilon_high=0.15, aggregation="bnpo"),
    gk.GSPOConfig(loss_type="dapo", importance_sampling_level="token", epsilon_low=0.1, epsilon_high=0.1,
                  off_policy_mask_threshold=0.0, rollout_correction="sequence_masked_tis", rollout_correction_max=1.2),
], ids=objective_id)
def test_gradcheck_objectives_without_stop_gradient(config):
    """The objectives whose gradient is the derivative of their value: float64 finite differences, the masked
    token, clipped and capped tokens, both advantage signs and a dropped response included."""
    logp, old, adv = _token_problem(S=3, T=5, spread=0.3)
    mask = torch.ones_like(logp)
    mask[1, 3:] = 0
    rollout = old - torch.randn(logp.shape, dtype=torch.float64) * 0.2
    x = logp.clone().requires_grad_()

    def loss(lp):
        return gk.policy_loss(lp, adv, old, mask=mask, rollout_logprobs=rollout, config=config, backend="torch").loss

    assert torch.autograd.gradcheck(loss, (x,), eps=1e-7, atol=1e-9, rtol=1e-6)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_nan_rollout_logprob_is_an_unscored_token(name):
    """A NaN engine log-prob at an unmasked token means "not scored" (TRL): weight 1, no error, also under
    ``check_finite=True``; the same loss as the engine agreeing with the trainer there."""
    logp, old, adv = _token_problem(spread=0.05)
    rollout = old - 0.05 * torch.randn(logp.shape, dtype=torch.float64)
    cfg = gk.GSPOConfig(importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.2,
                        rollout_correction="token_truncate", rollout_correction_max=2.0)
    with_nan, agreeing = rollout.clone(), rollout.clone()
    with_nan[0, 2] = float("nan")
    agreeing[0, 2] = old[0, 2]
    dev = device_for(name)
    logp, adv, old = logp.float().to(dev), adv.float().to(dev), old.float().to(dev)
    a = gk.policy_loss(logp, adv, old, rollout_logprobs=with_nan.float().to(dev), config=cfg, check_finite=True,
                       backend=name)
    b = gk.policy_loss(logp, adv, old, rollout_logprobs=agreeing.float().to(dev), config=cfg, backend=name)
    assert torch.isfinite(a.loss) and a.loss.item() == b.loss.item()
    assert float(a.metrics["rollout/kl"]) == float(b.metrics["rollout/kl"])


# ---------------------------------------------------------------------------------------------
# The objectives' registry: an objective is one module, nothing else lists it.
# ---------------------------------------------------------------------------------------------

def _plain_surrogate(*, log_w, A_live, **_):
    """The unclipped importance-weighted policy gradient: ``l_t = -w_t A_t``."""
    return -torch.exp(log_w) * A_live, None


def _plain_check(config, active):
    if active and config.beta != 0:
        raise ValueError("loss_type='plain_pg' takes no KL term")


def test_an_objective_registered_outside_the_package_runs_through_the_public_api():
    """The steps of docs/architecture.md are complete: an objective defined here (no table of the package edited)
    is a loss_type of GSPOConfig, validated by its own check, and runs through ``policy_loss`` and ``gspo_loss``
    on the torch backend, to the value computed by hand."""
    from gspo_kernels import config as config_module
    from gspo_kernels import objectives

    objectives.register(objectives.Objective(
        name="plain_pg", loss_types=(objectives.LossType("plain_pg", "plain_pg", "bnpo"),),
        surrogate=_plain_surrogate, check=_plain_check))
    try:
        assert "plain_pg" in config_module.ALL_LOSS_TYPES and "plain_pg" in config_module.OBJECTIVES
        assert config_module.IMPLIED_AGGREGATION["plain_pg"] == "bnpo"
        with pytest.raises(ValueError, match="takes no KL"):
            gk.GSPOConfig(loss_type="plain_pg", beta=0.1)
        cfg = gk.GSPOConfig(loss_type="plain_pg", importance_sampling_level="token")
        assert cfg.objective == "plain_pg" and cfg.effective_aggregation == "bnpo"

        logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -3.0, -1.5]], dtype=torch.float64)
        old = logp + torch.tensor([[0.0, math.log(2.0), -math.log(2.0)], [math.log(4.0), 0.0, 0.0]],
                                  dtype=torch.float64)
        adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
        mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
        # w = exp(logp - old): 1, 1/2, 2 (A = 1); 1/4, 1 (A = -2); the last token masked. Token mean over 5:
        want = (-(1.0 + 0.5 + 2.0) * 1.0 - (0.25 + 1.0) * -2.0) / 5.0  # = -0.2
        lp = logp.clone().requires_grad_()
        out = gk.policy_loss(lp, adv, old, mask=mask, config=cfg, backend="torch")
        assert out.loss.item() == pytest.approx(want, abs=1e-12)
        out.loss.backward()  # dl/dlogp_t = -w_t A_t / 5
        grad = torch.tensor([[-1.0, -0.5, -2.0], [0.5, 2.0, 0.0]], dtype=torch.float64) / 5.0
        torch.testing.assert_close(lp.grad, grad, rtol=0, atol=1e-12)
        assert out.metrics["importance_weight/max"].item() == pytest.approx(2.0)

        # gspo_loss: logits whose log-softmax at the labels are these log-probs give the same loss
        V = 4
        labels = torch.tensor([[0, 1, 2], [3, 0, 1]])
        logits = torch.zeros(2, 3, V, dtype=torch.float64)
        logits.scatter_(2, labels[..., None], 1.0)
        token_logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
        old2 = token_logp.detach() + (old - logp)
        got = gk.gspo_loss(logits, labels, adv, old2, mask=mask, config=cfg, backend="torch")
        assert got.loss.item() == pytest.approx(want, abs=1e-12)
    finally:
        objectives.unregister("plain_pg")
    assert "plain_pg" not in config_module.ALL_LOSS_TYPES
    with pytest.raises(ValueError, match="loss_type must be one of"):
        gk.GSPOConfig(loss_type="plain_pg")


@pytest.mark.parametrize("route", ["logits", "hidden"])
def test_an_objective_without_triton_helpers_runs_on_every_backend_and_route(backend, route):  # noqa: F811
    """An objective registered outside the package has no Triton helpers: every backend computes it with
    PyTorch's sequence stage on every route, the Triton backend's one-node logits loss and one-pass hidden-state
    loss included (they take their two-stage form), with gradients; against the torch backend in float64."""
    from gspo_kernels import objectives

    objectives.register(objectives.Objective(
        name="plain_pg", loss_types=(objectives.LossType("plain_pg", "plain_pg", "bnpo"),),
        surrogate=_plain_surrogate, check=_plain_check))
    try:
        cfg = gk.GSPOConfig(loss_type="plain_pg", importance_sampling_level="token")
        B, T, H, V = 3, 5, 8, 37
        labels = torch.randint(0, V, (B, T))
        mask = torch.ones(B, T)
        mask[1, 3:] = 0
        adv = torch.tensor([1.0, -0.5, 0.7])
        hidden, weight = torch.randn(B, T, H), torch.randn(V, H) * 0.5
        logits = hidden @ weight.t()
        old = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1).float()
        old = old - 0.3 * torch.randn(B, T)
        leaves = (logits,) if route == "logits" else (hidden, weight)
        dev = _device(backend)

        def run(tensors, name, device):
            xs = [t.clone().to(device).requires_grad_() for t in tensors]
            args = dict(mask=mask.to(device), config=cfg, backend=name)
            if route == "logits":
                out = gk.gspo_loss(xs[0], labels.to(device), adv.to(device), old.to(device), **args)
            else:
                out = gk.fused_linear_gspo_loss(xs[0], xs[1], labels.to(device), adv.to(device), old.to(device),
                                                **args)
            return out.loss, torch.autograd.grad(out.loss, xs)

        loss, grads = run(leaves, backend, dev)
        want, want_grads = run([t.double() for t in leaves], "torch", "cpu")
        assert abs(loss.item() - want.item()) <= RTOL * max(1.0, abs(want.item()))
        for g, w in zip(grads, want_grads):
            assert rel_err(g.cpu(), w) < RTOL
    finally:
        objectives.unregister("plain_pg")


def _code_words(path):
    """``(line, text)`` of every identifier and string literal of a module's code: not its docstrings, not its
    comments, not ``GSPOConfig``'s field declarations."""
    import ast

    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skipped.add(id(body[0].value))  # a docstring
        if isinstance(node, ast.ClassDef) and node.name == "GSPOConfig":
            skipped.update(id(st.target) for st in node.body if isinstance(st, ast.AnnAssign))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.value.lineno, node.arg
        elif isinstance(node, ast.alias):
            yield 0, node.name + " " + (node.asname or "")
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, node.module or ""
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


@pytest.mark.parametrize("name", ["vespo", "sapo", "cispo", "gmpo", "luspo"])
def test_an_objective_is_named_in_its_own_module_only(name):
    """No module's code names an objective (identifiers, strings) but its own module (and its Triton helpers'),
    the float64 reference (``reference/``, independent by design), GSPOConfig's field declarations and the two
    integrations that declare how their framework names an objective and its options (``integrations/trl.py``,
    ``integrations/verl.py``: the registry knows no framework); docstrings and comments may."""
    from pathlib import Path

    package = Path(gk.__file__).parent
    own = {f"objectives/{name}.py", f"backends/triton/objectives/{name}.py", "reference/__init__.py", "reference/objectives.py",
           "objectives/__init__.py", "backends/triton/objectives/__init__.py",  # the two packages' module lists
           "integrations/trl.py", "integrations/verl.py"}  # TRL's and verl's names of the objectives
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative in own:
            continue
        found += [f"{relative}:{line}: {word!r}" for line, word in _code_words(path) if name in word.lower()]
    assert found == [], found
