"""The PyTorch sequence stage: float64 gradcheck in every mode, and group advantages."""

import dataclasses

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import reference
from gspo_kernels.layout import LossTensors, prepare_loss_inputs
from gspo_kernels.objectives.stage import gspo_objective
from tests.support import configs


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["seq-adv", "token-adv"])
@pytest.mark.parametrize("config", configs(), ids=lambda c: f"{c.importance_sampling_level}-{c.loss_type}")
def test_gradcheck(config, per_token_adv):
    S, T = 3, 5
    labels = torch.zeros(S, T, dtype=torch.long)
    mask = torch.ones(S, T)
    mask[0, 3:] = 0
    mask[2] = 0  # an empty response
    logp = (torch.randn(S * T, dtype=torch.float64) * 0.3 - 1.0).requires_grad_()
    entropy = (torch.rand(S * T, dtype=torch.float64) + 0.5).requires_grad_()
    # old log-probs inside the clip band for some responses, outside it for others, away from its edges
    old = logp.detach().reshape(S, T) - torch.tensor([1e-4, -5e-2, 2e-4], dtype=torch.float64)[:, None]
    adv = torch.randn((S, T) if per_token_adv else (S,), dtype=torch.float64)
    ref = logp.detach().reshape(S, T) + 0.1 * torch.randn(S, T, dtype=torch.float64)
    inputs = prepare_loss_inputs(labels, 1, LossTensors(adv, old_logprobs=old, mask=mask, ref_logprobs=ref,
                                 is_ratio=torch.rand(S, dtype=torch.float64) + 0.5, num_items_in_batch=7),
                                 beta=config.beta)

    def f(lp, ent):
        return gspo_objective(lp, ent, inputs, config).loss

    if config.importance_sampling_level == "sequence_token":
        # Stop-gradients make finite differences meaningless here. At this point GSPO-token has the
        # value and the gradient of the token-level objective whose old log-probs are
        # old'_t = logp_t - s_i (s_i the response's mean log-ratio): gradcheck that one instead, and
        # check that the two analytical gradients agree.
        r = (logp.detach() - old.reshape(-1)) * mask.reshape(-1)
        s_i = r.reshape(S, T).sum(1) / mask.sum(1).clamp(min=1)
        old_eq = logp.detach().reshape(S, T) - s_i[:, None]
        token_cfg = dataclasses.replace(config, importance_sampling_level="token")
        token_inputs = dataclasses.replace(inputs, old_logprobs=old_eq.reshape(-1))
        g_ours = torch.autograd.grad(f(logp, entropy), (logp, entropy), allow_unused=True, materialize_grads=True)
        g_token = torch.autograd.grad(gspo_objective(logp, entropy, token_inputs, token_cfg).loss, (logp, entropy),
                                      allow_unused=True, materialize_grads=True)
        for a, b in zip(g_ours, g_token):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
        f = lambda lp, ent: gspo_objective(lp, ent, token_inputs, token_cfg).loss  # noqa: E731
    assert torch.autograd.gradcheck(f, (logp, entropy), eps=1e-7, atol=1e-8, rtol=1e-5)
    # and the objective agrees with the oracle's own sequence stage
    ours = gspo_objective(logp, entropy, inputs, config)
    theirs = reference.sequence_loss(logp, entropy, inputs, config)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-12, atol=1e-14)
    for name, value in theirs.metrics.items():
        torch.testing.assert_close(ours.metrics[name].double(), value.double(), rtol=1e-6, atol=1e-7, msg=name)


def test_gspo_token_gradient_equals_gspo_under_grpo():
    """Spec: with one advantage per response, GSPO-token's gradient equals GSPO's under "grpo"."""
    S, T = 4, 6
    labels = torch.zeros(S, T, dtype=torch.long)
    mask = (torch.rand(S, T) > 0.2).float()
    logp = (torch.randn(S * T, dtype=torch.float64) - 1).requires_grad_()
    old = logp.detach().reshape(S, T) - 1e-4 * torch.randn(S, 1, dtype=torch.float64)
    inputs = prepare_loss_inputs(labels, 1, LossTensors(torch.randn(S, dtype=torch.float64), old_logprobs=old, mask=mask))
    grads = []
    for level in ("sequence", "sequence_token"):
        out = gspo_objective(logp, None, inputs, gk.GSPOConfig(importance_sampling_level=level))
        grads.append(torch.autograd.grad(out.loss, logp)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-16)
    assert grads[0].abs().sum() > 0


def test_objective_has_no_nan_with_empty_responses_and_inf_padding():
    labels = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    old = torch.tensor([[-1.0, -2.0, float("-inf")], [float("nan"), float("-inf"), 0.0]])
    inputs = prepare_loss_inputs(labels, 1, LossTensors(torch.tensor([1.0, -1.0]), old_logprobs=old, mask=mask))
    logp = torch.tensor([-1.0, -2.0, 0.0, 0.0, 0.0, 0.0], requires_grad=True)
    for level in ("sequence", "sequence_token", "token"):
        out = gspo_objective(logp, torch.ones(6), inputs, gk.GSPOConfig(importance_sampling_level=level))
        (grad,) = torch.autograd.grad(out.loss, logp)
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v) for v in out.metrics.values())
        assert torch.all(grad[2:] == 0)


@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
def test_fp32_objective_matches_fp64_when_weights_overflow_and_masked_inputs_are_nan(level):
    """fp32 with e^100 weights (clipped, or capped by delta) and NaN at masked positions of the per-token
    advantages and is_ratio: the same loss and gradient as the fp64 objective on clean inputs."""
    S, T = 3, 4
    labels = torch.zeros(S, T, dtype=torch.long)
    mask = torch.ones(S, T)
    mask[1, 2:] = 0
    mask[2, 3] = 0  # a masked NaN inside the response whose weight is live
    logp64 = torch.randn(S * T, dtype=torch.float64) - 1
    old = logp64.reshape(S, T) - torch.tensor([[100.0], [100.0], [1e-4]], dtype=torch.float64)
    adv = torch.tensor([[1.0] * T, [-2.0] * T, [0.5] * T], dtype=torch.float64)  # clipped, delta-capped, live
    ratio = 1 + 0.1 * torch.rand(S, T, dtype=torch.float64)
    cfg = gk.GSPOConfig(importance_sampling_level=level, delta=2.0, beta=0.02)
    ref_lp = logp64.reshape(S, T) + 0.1
    grads = []
    for dtype, poison in ((torch.float32, float("nan")), (torch.float64, 0.0)):
        a, r = adv.clone(), ratio.clone()
        a[mask == 0], r[mask == 0] = poison, poison
        inputs = prepare_loss_inputs(labels, 1, LossTensors(a.to(dtype), old_logprobs=old.to(dtype), mask=mask,
                                     is_ratio=r.to(dtype), ref_logprobs=ref_lp.to(dtype)), beta=cfg.beta)
        logp = logp64.to(dtype).requires_grad_()
        out = gspo_objective(logp, None, inputs, cfg)
        grads.append((out.loss, torch.autograd.grad(out.loss, logp)[0]))
    (loss32, g32), (loss64, g64) = grads
    assert torch.isfinite(loss32) and torch.isfinite(g32).all()
    torch.testing.assert_close(loss32.double(), loss64, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g32.double(), g64, rtol=1e-5, atol=1e-7)
    assert bool((g32[8:11] != 0).all()) and g32[11] == 0  # the live response has a gradient, masked tokens none


def test_dapo_divides_by_num_items_in_batch_as_given():
    labels = torch.zeros(2, 3, dtype=torch.long)
    logp = (torch.randn(6) - 1).requires_grad_()
    old = logp.detach().reshape(2, 3) - 0.01
    cfg = gk.GSPOConfig(loss_type="dapo")
    losses = [gspo_objective(logp, None, prepare_loss_inputs(labels, 1, LossTensors(torch.tensor([1.0, -0.5]), old_logprobs=old,
                                                             num_items_in_batch=n)), cfg).loss for n in (1, 0.25)]
    torch.testing.assert_close(losses[1], 4 * losses[0])


def test_group_advantages_matches_reference():
    rewards = torch.randn(6 * 8)
    rewards[8:16] = 0.5  # one group with equal rewards
    ours = gk.group_advantages(rewards, 8)
    torch.testing.assert_close(ours.double(), reference.group_advantages(rewards, 8), rtol=1e-5, atol=1e-6)
    assert torch.all(ours[8:16] == 0)
    with pytest.raises(ValueError, match="group_size"):
        gk.group_advantages(rewards, 5)
