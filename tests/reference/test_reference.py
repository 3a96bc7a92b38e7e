"""The float64 oracle against values worked out by hand from docs/math.md (not from the code's output).

With V = 1 every log-prob is exactly 0, so ``r_t = -old_t`` and each loss below is a few exps.
"""

import math

import pytest
import torch

from gspo_kernels import GSPOConfig, reference
from gspo_kernels.reference import objectives as reference_objectives

WIDE = dict(epsilon_low=0.2, epsilon_high=0.2)  # GRPO-style band, so clipping is visible


def one_token_vocab(B, T):
    return torch.zeros(B, T, 1, dtype=torch.float64, requires_grad=True), torch.zeros(B, T, dtype=torch.long)


def test_gspo_vs_grpo_on_the_same_inputs():
    logits, labels = one_token_vocab(1, 2)
    old = torch.tensor([[-0.2, 0.1]], dtype=torch.float64)  # r = [0.2, -0.1]
    adv = torch.tensor([1.0], dtype=torch.float64)
    gspo = reference.gspo_loss(logits, labels, adv, old, config=GSPOConfig(**WIDE))
    grpo = reference.gspo_loss(logits, labels, adv, old, config=GSPOConfig(importance_sampling_level="token", **WIDE))
    # GSPO: one weight exp(mean r) = exp(0.05), inside the band: l_t = -exp(0.05) for both tokens.
    assert gspo.loss.item() == pytest.approx(-math.exp(0.05), rel=1e-12)
    # GRPO: exp(0.2) = 1.2214 is clipped to 1.2 (A > 0), exp(-0.1) is not.
    assert grpo.loss.item() == pytest.approx(-(1.2 + math.exp(-0.1)) / 2, rel=1e-12)
    assert grpo.metrics["clip_ratio/high_mean"].item() == pytest.approx(0.5)
    assert gspo.metrics["clip_ratio/high_mean"].item() == 0.0
    assert gspo.metrics["importance_weight/mean"].item() == pytest.approx(math.exp(0.05), rel=1e-12)

    neg = torch.tensor([-1.0], dtype=torch.float64)
    gspo_n = reference.gspo_loss(logits, labels, neg, old, config=GSPOConfig(**WIDE))
    grpo_n = reference.gspo_loss(logits, labels, neg, old, config=GSPOConfig(importance_sampling_level="token", **WIDE))
    assert gspo_n.loss.item() == pytest.approx(math.exp(0.05), rel=1e-12)
    # A < 0 keeps the larger of w and clip(w): exp(0.2) unclipped, exp(-0.1) inside the band.
    assert grpo_n.loss.item() == pytest.approx((math.exp(0.2) + math.exp(-0.1)) / 2, rel=1e-12)


def test_paper_band_clips_the_whole_response():
    logits, labels = one_token_vocab(2, 2)
    old = torch.tensor([[-1e-3, -1e-3], [-1e-4, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    out = reference.gspo_loss(logits, labels, adv, old, config=GSPOConfig())
    # Response 0: w = exp(1e-3) > 1 + 4e-4 -> clipped to 1.0004. Response 1: w = exp(5e-5), inside.
    assert out.loss.item() == pytest.approx(-(1.0004 + math.exp(5e-5)) / 2, rel=1e-12)
    assert out.metrics["clip_ratio/high_mean"].item() == pytest.approx(0.5)
    assert out.metrics["importance_weight/max"].item() == pytest.approx(math.exp(1e-3), rel=1e-12)
    assert out.metrics["importance_weight/min"].item() == pytest.approx(math.exp(5e-5), rel=1e-12)


def test_aggregations_by_hand():
    # Response 0: one token, r = 0.1; response 1: three tokens, r = 0, plus one masked token.
    logits, labels = one_token_vocab(2, 4)
    old = torch.tensor([[-0.1, 9.0, 9.0, 9.0], [0.0, 0.0, 0.0, -5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    adv = torch.tensor([1.0, 2.0], dtype=torch.float64)
    band = dict(epsilon_low=0.5, epsilon_high=0.5, importance_sampling_level="token")
    l0, l1 = -math.exp(0.1), -2.0  # per-token losses of responses 0 and 1
    expected = {
        "grpo": (l0 / 1 + 3 * l1 / 3) / 2,
        "bnpo": (l0 + 3 * l1) / 4,
        "dr_grpo": (l0 + 3 * l1) / (2 * 6),
        "dapo": (l0 + 3 * l1) / 10,
    }
    for loss_type, value in expected.items():
        cfg = GSPOConfig(loss_type=loss_type, max_completion_length=6, **band)
        out = reference.gspo_loss(logits, labels, adv, old, mask=mask, config=cfg, num_items_in_batch=10)
        assert out.loss.item() == pytest.approx(value, rel=1e-12), loss_type


def test_kl_is_ratio_and_delta_by_hand():
    logits, labels = one_token_vocab(1, 1)
    old = torch.tensor([[-0.5]], dtype=torch.float64)  # w = exp(0.5), far above the band
    ref = torch.tensor([[0.3]], dtype=torch.float64)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    cfg = GSPOConfig(beta=0.1, delta=1.5, epsilon_low=0.2, epsilon_high=0.2)
    out = reference.gspo_loss(logits, labels, adv, old, ref_logprobs=ref, is_ratio=torch.tensor([0.5]), config=cfg)
    # c1 = min(exp(0.5), 1.5) = 1.5, c2 = 1.2; A = -1: l = -min(-1.5, -1.2) = 1.5; times is_ratio 0.5.
    kl = math.exp(0.3) - 0.3 - 1
    assert out.loss.item() == pytest.approx(0.5 * 1.5 + 0.1 * kl, rel=1e-12)
    assert out.metrics["kl"].item() == pytest.approx(kl, rel=1e-12)
    biased = reference.gspo_loss(logits, labels, adv, old, ref_logprobs=ref,
                                 config=GSPOConfig(beta=0.1, use_bias_correction_kl=True, **WIDE))
    assert biased.loss.item() == pytest.approx(math.exp(0.5) + 0.1 * kl * math.exp(0.5), rel=1e-12)


def test_temperature_and_entropy_by_hand():
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    logp, entropy = reference.token_logprobs(logits, torch.tensor([0]), temperature=2.0, return_entropy=True)
    e = math.e
    p = [e / (e + 3)] + [1 / (e + 3)] * 3
    assert logp.item() == pytest.approx(1 - math.log(e + 3), rel=1e-12)
    assert entropy.item() == pytest.approx(-sum(q * math.log(q) for q in p), rel=1e-12)


def test_spec_gradient_formula_for_gspo():
    """dL/dlogp_t = -(1/S) A_i w_i / |y_i| mask_t 1[not clipped] (sequence level, grpo, no KL)."""
    S, T = 4, 6
    mask = torch.ones(S, T)
    mask[1, 4:] = 0
    mask[3] = 0  # an empty response
    logp = (torch.randn(S, T, dtype=torch.float64) * 0.5 - 2).requires_grad_()
    shift = torch.tensor([1e-5, -2e-3, 3e-3, 0.0], dtype=torch.float64)[:, None]  # 1: low clip, 2: high clip
    old = logp.detach() - shift
    adv = torch.tensor([0.7, -1.3, 0.4, 2.0], dtype=torch.float64)
    out = reference.policy_loss(logp, adv, old, mask=mask, config=GSPOConfig())
    (grad,) = torch.autograd.grad(out.loss, logp)
    lengths = mask.sum(1).clamp(min=1).double()
    w = torch.exp(shift[:, 0])
    clipped = torch.tensor([False, True, True, False])
    expected = -(1 / S) * adv[:, None] * w[:, None] / lengths[:, None] * mask * (~clipped)[:, None]
    torch.testing.assert_close(grad, expected.double(), rtol=1e-12, atol=0)
    assert out.metrics["clip_ratio/low_mean"].item() == pytest.approx(1 / 3)  # counted over 3 non-empty responses
    assert out.metrics["clip_ratio/high_mean"].item() == pytest.approx(1 / 3)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = reference.group_advantages(rewards, 4, eps=0.0)
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of (1, 0, 0, 1)
    torch.testing.assert_close(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64) / std)
    assert torch.equal(adv[4:], torch.zeros(4, dtype=torch.float64))  # equal rewards: A = 0


def test_minus_inf_logits_on_other_columns_give_the_smaller_vocabulary():
    """A -inf logit is a column that does not exist: same log-prob, entropy and gradient as without it."""
    z = torch.tensor([[1.0, -0.5, float("-inf"), 0.25]], dtype=torch.float64, requires_grad=True)
    small = torch.tensor([[1.0, -0.5, 0.25]], dtype=torch.float64, requires_grad=True)
    logp, ent = reference.token_logprobs(z, torch.tensor([1]), return_entropy=True)
    logp_s, ent_s = reference.token_logprobs(small, torch.tensor([1]), return_entropy=True)
    p = torch.softmax(small.detach(), -1)[0]
    assert ent.item() == pytest.approx(-sum(q * math.log(q) for q in p.tolist()), rel=1e-12)
    assert logp.item() == pytest.approx(logp_s.item(), rel=1e-12)
    (logp + 0.3 * ent).sum().backward()
    (logp_s + 0.3 * ent_s).sum().backward()
    assert torch.isfinite(z.grad).all() and z.grad[0, 2] == 0
    torch.testing.assert_close(z.grad[0, [0, 1, 3]], small.grad[0], rtol=1e-12, atol=0)
    # through the loss, with an entropy bonus (the old oracle returned NaN here)
    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    logits[..., 0] = float("-inf")
    x = logits.clone().requires_grad_()
    out = reference.gspo_loss(x, torch.randint(1, 5, (2, 3)), torch.tensor([1.0, -1.0]),
                              config=GSPOConfig(entropy_coef=0.01))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("offset", [100.0, 1000.0])
def test_huge_importance_weights_stay_finite_where_the_math_is(offset):
    """old = logp - offset: w = e^offset. Clipped (A > 0) or capped by delta, the loss is finite and the
    gradient exactly 0 even when e^offset overflows float64 (offset = 1000)."""
    logits, labels = one_token_vocab(2, 3)
    old = torch.full((2, 3), -offset, dtype=torch.float64)
    adv = torch.tensor([1.0, 0.0], dtype=torch.float64)  # clipped high, and a zero advantage
    for level in ("sequence", "sequence_token", "token"):
        out = reference.gspo_loss(logits, labels, adv, old, config=GSPOConfig(importance_sampling_level=level))
        (grad,) = torch.autograd.grad(out.loss, logits)
        assert out.loss.item() == pytest.approx(-1.0004 / 2, rel=1e-12), level
        assert torch.all(grad == 0), level
    # A < 0 with delta: c1 = min(w, delta) = delta, the loss is delta * |A| and the gradient 0
    out = reference.gspo_loss(logits, labels, -adv, old, config=GSPOConfig(delta=1.5))
    (grad,) = torch.autograd.grad(out.loss, logits)
    assert out.loss.item() == pytest.approx(1.5 / 2, rel=1e-12) and torch.all(grad == 0)
    if offset == 100.0:  # unclipped (A < 0, no delta): e^100 is finite, so are the loss and the gradient
        lp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
        out = reference.policy_loss(lp, torch.tensor([-1.0], dtype=torch.float64), lp.detach() - offset)
        (grad,) = torch.autograd.grad(out.loss, lp)
        assert out.loss.item() == pytest.approx(math.exp(100), rel=1e-12)
        torch.testing.assert_close(grad, torch.full((1, 3), math.exp(100) / 3, dtype=torch.float64), rtol=1e-12,
                                   atol=0)


def test_packed_and_padded_layouts_by_hand():
    """The same two responses, padded with a mask and packed with cu_seqlens and a token mask."""
    logits_p = torch.zeros(2, 3, 1, dtype=torch.float64)
    old_p = torch.tensor([[-0.1, -0.3, 7.0], [0.2, 9.0, 9.0]], dtype=torch.float64)
    mask_p = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    cfg = GSPOConfig(importance_sampling_level="token", loss_type="bnpo", epsilon_low=0.5, epsilon_high=0.5)
    padded = reference.gspo_loss(logits_p, torch.zeros(2, 3, dtype=torch.long), adv, old_p, mask=mask_p, config=cfg)
    # packed: response 0 = tokens 0..2 with a masked token in the middle, response 1 = token 3
    old_k = torch.tensor([-0.1, float("nan"), -0.3, 0.2], dtype=torch.float64)
    labels_k = torch.tensor([0, -100, 0, 0])
    packed = reference.gspo_loss(torch.zeros(4, 1, dtype=torch.float64), labels_k, adv, old_k,
                                 cu_seqlens=torch.tensor([0, 3, 4]), mask=torch.tensor([1, 0, 1, 1]), config=cfg)
    expected = -(math.exp(0.1) + math.exp(0.3) - 2 * math.exp(-0.2)) / 3
    assert padded.loss.item() == pytest.approx(expected, rel=1e-12)
    assert packed.loss.item() == pytest.approx(expected, rel=1e-12)


def test_the_oracle_checks_its_own_inputs():
    logits, labels = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    adv = torch.zeros(2)
    for cu, match in [(torch.tensor([1, 2, 4]), "start at 0"), (torch.tensor([0, 3, 2]), "non-decreasing"),
                      (torch.tensor([0, 1, 3]), "end at N = 4"), (torch.tensor([0.0, 2, 4]), "int32 or int64")]:
        with pytest.raises((ValueError, TypeError), match=match):
            reference.gspo_loss(logits, labels, adv, cu_seqlens=cu)
    cu = torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match="only 0 and 1 .*flat position 1 holds 0.5"):
        reference.gspo_loss(logits, labels, adv, cu_seqlens=cu, mask=torch.tensor([1.0, 0.5, 1.0, 1.0]))
    with pytest.raises(ValueError, match="labels .at unmasked positions. must lie in"):
        reference.gspo_loss(logits, torch.tensor([0, 3, 0, 0]), adv, cu_seqlens=cu)
    reference.gspo_loss(logits, torch.tensor([0, 3, 0, 0]), adv, cu_seqlens=cu, mask=torch.tensor([1, 0, 1, 1]))
    with pytest.raises(ValueError, match="advantages must be"):
        reference.gspo_loss(logits, labels, torch.zeros(3), cu_seqlens=cu)
    with pytest.raises(ValueError, match="ref_logprobs is required"):
        reference.gspo_loss(logits, labels, adv, cu_seqlens=cu, config=GSPOConfig(beta=0.1))
    with pytest.raises(ValueError, match="num_items_in_batch"):
        reference.gspo_loss(logits, labels, adv, cu_seqlens=cu, num_items_in_batch=torch.tensor(0.0))
    with pytest.raises(ValueError, match="logits must have shape"):
        reference.gspo_loss(torch.zeros(2, 2, 3), labels, adv, cu_seqlens=cu)


def test_the_oracle_does_not_import_the_fast_paths():
    """The oracle may share the config and the output type only: a layout bug must not hit both sides."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(reference))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {m for m in imported if m.startswith("gspo_kernels")} == {"gspo_kernels.config", "gspo_kernels.objectives.stage",
                                                                     "gspo_kernels.reference.checks", "gspo_kernels.reference.objectives"}
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module == "gspo_kernels.objectives.stage" for alias in node.names}
    assert names == {"LossOutput"}
    # the oracle's second module (its per-response formulas) shares the config only
    tree = ast.parse(inspect.getsource(reference_objectives))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {m for m in imported if m.startswith("gspo_kernels")} == {"gspo_kernels.config"}


def test_all_masked_and_empty_batches_give_zero_loss_and_zero_gradients():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    logits.data[0, 1] = float("nan")  # masked garbage
    mask = torch.zeros(2, 3)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        cfg = GSPOConfig(loss_type=loss_type, max_completion_length=3, entropy_coef=0.1)
        out = reference.gspo_loss(logits, torch.full((2, 3), -100), torch.randn(2), mask=mask, config=cfg)
        (grad,) = torch.autograd.grad(out.loss, logits)
        assert out.loss.item() == 0.0 and torch.all(grad == 0)
        assert all(v.item() == 0.0 for v in out.metrics.values())
    empty = torch.zeros(0, 5, dtype=torch.float64, requires_grad=True)
    out = reference.gspo_loss(empty, torch.zeros(0, dtype=torch.long), torch.randn(2),
                              cu_seqlens=torch.tensor([0, 0, 0]))
    (grad,) = torch.autograd.grad(out.loss, empty)
    assert out.loss.item() == 0.0 and grad.shape == (0, 5)
