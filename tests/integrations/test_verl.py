"""verl 0.9.1 parity: the registered policy losses against verl's own, and the routed fused head.

verl is a test dependency (installed by the Makefile); imported directly, never skipped.
"""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from verl.models.transformers.monkey_patch import patch_forward_with_backends
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig

import gspo_kernels as gk
from gspo_kernels.integrations import verl as gk_verl

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
B, T = 6, 9
TOL = 1e-6


def _actor_config(global_info: bool, **kw) -> ActorConfig:
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, **kw}
    config = ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=4, **kw)
    if global_info:  # as verl's ppo_loss fills it on a data-parallel rank
        config.global_batch_info.update(dp_size=2, batch_num_tokens=71, global_batch_size=11, loss_scale_factor=None)
    return config


def _inputs(gen, extreme: bool = True):
    lengths = torch.tensor([9, 4, 0, 1, 7, 6])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    log_prob = torch.randn(B, T, generator=gen) * 0.5 - 2.0
    # log-ratios: in the clip band, outside it (both sides, both advantage signs), beyond the dual
    # clip and, for row 4, above GSPO's clamp at 10
    old = log_prob - torch.randn(B, T, generator=gen) * 0.6 - torch.tensor([0.0, 0.4, 0.0, -0.5, 0.0, 0.3])[:, None]
    old[4] = log_prob[4] - (10.5 if extreme else 0.25) - 0.01 * torch.randn(T, generator=gen)
    old[~mask] = 7.0  # padding: never read
    adv = torch.randn(B, 1, generator=gen).expand(B, T).clone() + 0.3 * torch.randn(B, T, generator=gen)
    adv[4] = -1.0  # the clamp decides this row's gradient
    adv[1], adv[3] = adv[1].abs() + 0.5, -adv[3].abs() - 0.5  # responses clipped above and below
    weights = 0.5 + torch.rand(B, T, generator=gen)
    return old, log_prob, adv, mask, weights


def _call(fn, old, log_prob, adv, mask, mode, config, weights):
    lp = log_prob.clone().requires_grad_()
    loss, metrics = fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=mode,
                       config=config, rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), metrics, grad


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.fixture(scope="module", autouse=True)
def _registered():
    saved = dict(core_algos.POLICY_LOSS_REGISTRY)
    assert gk_verl.register_policy_loss() == "gspo_kernels"
    yield
    core_algos.POLICY_LOSS_REGISTRY.clear()
    core_algos.POLICY_LOSS_REGISTRY.update(saved)


@pytest.mark.parametrize("with_weights", [False, True], ids=["no-is-weights", "rollout-is-weights"])
@pytest.mark.parametrize("global_info", [False, True], ids=["local", "global-batch-info"])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("ours_name, theirs_name", [("gspo_kernels", "gspo"), ("gspo_kernels_token", "vanilla")],
                         ids=["gspo-token", "grpo"])
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_policy_loss_matches_verl(backend, ours_name, theirs_name, mode, global_info, with_weights):
    gen = torch.Generator().manual_seed(7)
    old, log_prob, adv, mask, weights = _inputs(gen)
    weights = weights if with_weights else None
    config = _actor_config(global_info)
    if backend != "auto":
        core_algos.register_policy_loss(ours_name)(gk_verl.make_policy_loss(
            "sequence_token" if ours_name == "gspo_kernels" else "token", backend=backend))
    theirs = _call(core_algos.get_policy_loss_fn(theirs_name), old, log_prob, adv, mask, mode, config, weights)
    ours = _call(core_algos.get_policy_loss_fn(ours_name), old, log_prob, adv, mask, mode, config, weights)
    if backend != "auto":
        gk_verl.register_policy_loss()
    if backend == "auto":
        assert _rel(ours[0], theirs[0]) < TOL, (ours[0], theirs[0])
    else:  # the fused kernel sums in another order: 1e-6 of the terms' magnitude (the loss with +-|A|)
        scale = max(abs(float(_call(core_algos.get_policy_loss_fn(theirs_name), old, log_prob, sign * adv.abs(),
                                    mask, mode, config, weights)[0])) for sign in (1, -1))
        assert abs(float(ours[0] - theirs[0])) < TOL * max(scale, abs(float(theirs[0]))), (ours[0], theirs[0])
    assert _rel(ours[2], theirs[2]) < TOL
    assert set(ours[1]) == set(theirs[1])
    for key, value in theirs[1].items():
        assert abs(ours[1][key] - value) <= TOL * max(abs(value), 1e-3), (key, ours[1][key], value)
    assert theirs[1]["actor/pg_clipfrac"] > 0 and theirs[2].abs().sum() > 0  # the inputs clip and train
    if theirs_name == "vanilla":
        assert theirs[1]["actor/pg_clipfrac_lower"] > 0  # and reach verl's dual clip


def test_log_ratio_clamp_is_what_makes_gspo_match():
    """Without the clamp at 10 the row-4 gradient differs from verl's: the parity test sees the clamp."""
    gen = torch.Generator().manual_seed(7)
    old, log_prob, adv, mask, weights = _inputs(gen)
    config = _actor_config(False)
    theirs = _call(core_algos.get_policy_loss_fn("gspo"), old, log_prob, adv, mask, "token-mean", config, None)
    lp = log_prob.clone().requires_grad_()
    out = gk.policy_loss(lp, adv, old, mask=mask, config=gk.GSPOConfig(
        importance_sampling_level="sequence_token", loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.28))
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert _rel(grad, theirs[2]) > 1e-2
    assert theirs[2][4].abs().max() == 0


def test_every_level_is_registered_and_gspo_differs_from_gspo_token_only_in_gradient():
    gen = torch.Generator().manual_seed(3)
    old, log_prob, adv, mask, _ = _inputs(gen)
    adv = adv[:, :1].expand(B, T)  # one advantage per response: GSPO and GSPO-token share the value
    config = _actor_config(False)
    seq = _call(core_algos.get_policy_loss_fn("gspo_kernels_sequence"), old, log_prob, adv, mask,
                "seq-mean-token-mean", config, None)
    tok = _call(core_algos.get_policy_loss_fn("gspo_kernels_sequence_token"), old, log_prob, adv, mask,
                "seq-mean-token-mean", config, None)
    assert _rel(seq[0], tok[0]) < TOL
    torch.testing.assert_close(seq[2], tok[2], rtol=1e-5, atol=1e-7)  # equal under seq-mean-token-mean
    with pytest.raises(ValueError, match="loss_agg_mode"):
        _call(core_algos.get_policy_loss_fn("gspo_kernels"), old, log_prob, adv, mask, "sum", config, None)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        _call(core_algos.get_policy_loss_fn("gspo_kernels_token"), old, log_prob, adv, mask, "token-mean",
              _actor_config(False, clip_ratio_c=1.0), None)  # verl asserts clip_ratio_c > 1.0
    with pytest.raises(ValueError, match="importance_sampling_level"):
        gk_verl.register_policy_loss("gspo")


OBJECTIVES = [("gspo_kernels_sapo", "sapo"), ("gspo_kernels_cispo", "cispo"), ("gspo_kernels_geo_mean", "geo_mean")]
# options away from verl's defaults, so that a loss reading the defaults instead of the config fails the parity
OBJECTIVE_OPTIONS = dict(tau_pos=0.8, tau_neg=1.4, clip_ratio_low=0.15, clip_ratio_high=0.3)


# the Triton sequence stage (interpreter) in two of the four settings: it is compared with the float64 reference
# in the library's own tests; here it only has to read verl's inputs the same way
SETTINGS = [("auto", False, False), ("auto", False, True), ("auto", True, False), ("auto", True, True),
            ("triton", False, False), ("triton", True, True)]


@pytest.mark.parametrize("backend, global_info, with_weights", SETTINGS,
                         ids=[f"{b}-{'global' if g else 'local'}-{'is' if w else 'no-is'}" for b, g, w in SETTINGS])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("ours_name, theirs_name", OBJECTIVES, ids=[t for _, t in OBJECTIVES])
def test_objectives_match_verl(backend, ours_name, theirs_name, mode, global_info, with_weights):
    """``gspo_kernels_sapo|cispo|geo_mean`` against verl's ``sapo``, ``cispo``, ``geo_mean``: loss, gradient w.r.t.
    ``log_prob`` and metrics, every ``loss_agg_mode`` (verl's sapo and geo_mean ignore it), with and without
    ``global_batch_info`` and ``rollout_is_weights``; per-token advantages of both signs within a response."""
    gen = torch.Generator().manual_seed(5)
    old, log_prob, adv, mask, weights = _inputs(gen, extreme=theirs_name != "geo_mean")
    weights = weights if with_weights else None
    config = _actor_config(global_info, **OBJECTIVE_OPTIONS)
    fn = core_algos.get_policy_loss_fn(ours_name)
    if backend != "auto":
        fn = gk_verl.make_policy_loss("token", loss_type=gk_verl.OBJECTIVE_LOSS_NAMES[ours_name], backend=backend)
    theirs = _call(core_algos.get_policy_loss_fn(theirs_name), old, log_prob, adv, mask, mode, config, weights)
    ours = _call(fn, old, log_prob, adv, mask, mode, config, weights)
    tol = TOL if backend == "auto" else 1e-5  # the fused kernel sums in another order
    assert _rel(ours[0], theirs[0]) < tol, (ours[0], theirs[0])
    assert _rel(ours[2], theirs[2]) < tol
    assert set(ours[1]) == set(theirs[1])
    for key, value in theirs[1].items():
        assert abs(ours[1][key] - value) <= tol * max(abs(value), 1e-3), (key, ours[1][key], value)
    assert theirs[2].abs().sum() > 0
    if theirs_name != "sapo":  # the inputs reach the clip (CISPO's band, GMPO's log-space clip on both sides)
        assert theirs[1]["actor/pg_clipfrac"] > 0
    if theirs_name == "geo_mean":
        assert theirs[1]["actor/pg_clipfrac_lower"] > 0
    if mode == "token-mean" and not global_info and not with_weights and backend == "auto":
        # the options read from the config matter on these inputs
        default = _call(core_algos.get_policy_loss_fn(theirs_name), old, log_prob, adv, mask, mode,
                        _actor_config(False), None)
        assert _rel(default[2], theirs[2]) > 1e-3


@pytest.mark.parametrize("with_weights", [False, True], ids=["no-is-weights", "rollout-is-weights"])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("level", ["sequence_token", "sequence"])
def test_dual_clip_on_the_gspo_levels_is_verls_dual_clip_of_the_sequence_weight(level, mode, with_weights):
    """``make_policy_loss(level, dual_clip=True)`` at a GSPO level against verl's ``vanilla`` (its dual clip) fed
    with log-probs whose per-token ratio is the GSPO weight (clamped at 10 as verl's gspo clamps it): at
    ``sequence_token`` the value of the sequence weight with the token's own gradient, at ``sequence`` the
    sequence weight itself."""
    gen = torch.Generator().manual_seed(7)
    old, log_prob, adv, mask, weights = _inputs(gen)
    weights = weights if with_weights else None
    config = _actor_config(True)
    lp = log_prob.clone().requires_grad_()
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    seq = torch.where(mask, lp - old, 0.0).sum(-1, keepdim=True) / lengths
    as_token = lp - lp.detach() + seq.detach() if level == "sequence_token" else seq.expand(B, T)
    as_token = torch.clamp(as_token, max=gk_verl.GSPO_LOG_RATIO_CLAMP)
    def vanilla(a):
        return core_algos.get_policy_loss_fn("vanilla")(
            old_log_prob=torch.zeros(B, T), log_prob=as_token, advantages=a, response_mask=mask, loss_agg_mode=mode,
            config=config, rollout_is_weights=weights)

    loss_t, metrics_t = vanilla(adv)
    (grad_t,) = torch.autograd.grad(loss_t, lp, retain_graph=True)
    ours = _call(gk_verl.make_policy_loss(level, dual_clip=True), old, log_prob, adv, mask, mode, config, weights)
    # within 1e-6 of the terms' magnitude (the loss with +-|A|): the two sum in different orders, and the terms'
    # signs cancel to ~1e-2 of that magnitude here
    scale = max(abs(float(vanilla(sign * adv.abs())[0])) for sign in (1, -1))
    assert abs(float(ours[0] - loss_t)) < TOL * max(scale, abs(float(loss_t))), (ours[0], loss_t)
    assert _rel(ours[2], grad_t) < TOL
    for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"):
        assert abs(ours[1][key] - metrics_t[key]) <= TOL * max(abs(metrics_t[key]), 1e-3), key
    assert metrics_t["actor/pg_clipfrac_lower"] > 0  # the dual clip binds on these inputs
    plain = _call(gk_verl.make_policy_loss(level), old, log_prob, adv, mask, mode, config, weights)
    assert _rel(plain[0], ours[0]) > 1e-3 and plain[1]["actor/pg_clipfrac_lower"] == 0


def test_register_policy_loss_registers_the_objectives_and_checks_its_arguments():
    for name, loss_type in gk_verl.OBJECTIVE_LOSS_NAMES.items():
        assert core_algos.get_policy_loss_fn(name).__qualname__ == f"gspo_kernels_policy_loss[{loss_type}]"
    with pytest.raises(ValueError, match="dual_clip must be a bool"):
        gk_verl.register_policy_loss(dual_clip="yes")
    with pytest.raises(ValueError, match="loss_type must be 'clip' or one of"):
        gk_verl.make_policy_loss("token", loss_type="vespo")
    gen = torch.Generator().manual_seed(3)
    old, log_prob, adv, mask, _ = _inputs(gen)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        _call(core_algos.get_policy_loss_fn("gspo_kernels_geo_mean"), old, log_prob, adv, mask, "sum",
              _actor_config(False), None)


def _qwen3(seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=131, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).float()


def _fused_run(model, ids, w1, w2):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, return_dict=True, temperature=0.8)
    ((out.log_probs * w1).sum() + (out.entropy * w2).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.log_probs.detach(), out.entropy.detach(), grads


@pytest.mark.parametrize("verl_backend", ["torch", "triton"])
def test_routed_fused_head_matches_verl_fused_linear_for_ppo(verl_backend):
    model = _qwen3(0)
    cls = type(model)
    original_forward = cls.forward
    ids = torch.randint(0, 131, (3, 11))
    w1, w2 = torch.randn(3, 11), torch.randn(3, 11)
    try:
        patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
        want = _fused_run(model, ids, w1, w2)  # verl's own FusedLinearForPPO (its torch backend)
        restore = gk_verl.route_fused_kernels(backend="auto")
        try:
            # verl's Triton linear_cross_entropy needs CUDA; routed, both of verl's backends run the library
            patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=verl_backend)
            got = _fused_run(model, ids, w1, w2)
        finally:
            restore()
    finally:
        cls.forward = original_forward
    assert _rel(got[0], want[0]) < 1e-5
    assert _rel(got[1], want[1]) < 1e-5
    assert set(got[2]) == set(want[2]) and "lm_head.weight" in got[2]
    for name, grad in want[2].items():
        assert _rel(got[2][name], grad) < 1e-5, name
    from verl.utils.experimental import torch_functional
    from verl.utils.kernel import linear_cross_entropy

    assert torch_functional.FusedLinearForPPO is not gk_verl.FusedLinearForPPO  # restored
    assert linear_cross_entropy.linear_cross_entropy is not gk_verl.linear_cross_entropy
