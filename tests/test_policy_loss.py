"""``gspo_kernels.policy_loss`` (the sequence stage from log-probs) and ``GSPOConfig.log_ratio_clamp``.

Every backend against the float64 oracle (``reference.sequence_loss``): loss, metrics and the gradients
with respect to the log-probs and the entropy, both layouts, every level and loss type, with and without
the clamp (some responses' log-ratios lie above it).
"""

import dataclasses
import itertools

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import reference
from gspo_kernels.layout import LossTensors, prepare_loss_inputs
from tests.support import check_against_reference, configs, on_device

LENGTHS = (5, 1, 0, 7, 4)
BACKENDS = ("torch", "cpu", "triton")
CLAMP = 10.0


def _case(packed: bool, per_token_adv: bool):
    """Log-probs whose log-ratios are small for some responses and far above ``CLAMP`` for others."""
    S, T = len(LENGTHS), 8
    shape = (sum(LENGTHS),) if packed else (S, T)
    logp = torch.randn(shape) * 0.5 - 2.0
    # per response: inside the band, just outside it, above the clamp, well below it, above it again
    shift = torch.tensor([1e-4, -3e-2, -12.0, 0.4, -10.5])
    if packed:
        cu = torch.tensor([0, *itertools.accumulate(LENGTHS)], dtype=torch.int32)
        mask = (torch.rand(shape) > 0.15).float()
        per_tok_shift = shift.repeat_interleave(torch.tensor(LENGTHS))
    else:
        cu = None
        mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
        per_tok_shift = shift[:, None].expand(shape)
    old = logp + per_tok_shift + 1e-3 * torch.randn(shape)
    adv = torch.randn(shape if per_token_adv else (S,))
    entropy = torch.rand(shape) + 0.5
    ref = logp + 0.3 * torch.randn(shape)
    is_ratio = 1 + 0.1 * torch.rand(shape)
    if not packed:  # padding holds garbage that must never leak
        logp = torch.where(mask > 0, logp, torch.full_like(logp, float("-inf")))
        old = torch.where(mask > 0, old, torch.full_like(old, float("nan")))
    return dict(logp=logp, old=old, adv=adv, entropy=entropy, ref=ref, is_ratio=is_ratio, mask=mask, cu=cu)


def _run(backend, c, config):
    """``policy_loss(backend=...)`` on the CPU case ``c`` moved to the backend's device (``tests.support.device_for``);
    the gradients come back on the CPU."""
    c = on_device(c, backend)
    lp = c["logp"].clone().requires_grad_()
    ent = c["entropy"].clone().requires_grad_()
    out = gk.policy_loss(lp, c["adv"], c["old"], mask=c["mask"], cu_seqlens=c["cu"], ref_logprobs=c["ref"],
                         is_ratio=c["is_ratio"], entropy=ent, num_items_in_batch=11, config=config, backend=backend)
    grads = torch.autograd.grad(out.loss, (lp, ent), allow_unused=True, materialize_grads=True)
    return out, [g.cpu() for g in grads]


def _oracle(c, config):
    lp = c["logp"].double().reshape(-1).requires_grad_()
    ent = c["entropy"].double().reshape(-1).requires_grad_()
    labels = torch.zeros(c["logp"].shape, dtype=torch.long)
    inputs = prepare_loss_inputs(labels, 1, LossTensors(c["adv"].double(), old_logprobs=c["old"].double(), mask=c["mask"],
                                 cu_seqlens=c["cu"], ref_logprobs=c["ref"].double(),
                                 is_ratio=c["is_ratio"].double(), num_items_in_batch=11), beta=config.beta)
    out = reference.sequence_loss(lp, ent, inputs, config)
    grads = torch.autograd.grad(out.loss, (lp, ent), allow_unused=True, materialize_grads=True)
    return out, [g.reshape(c["logp"].shape) for g in grads]


CONFIGS = [
    dataclasses.replace(cfg, epsilon_low=0.2, epsilon_high=0.28, delta=3.0 if cfg.delta else None,
                        log_ratio_clamp=CLAMP if i % 2 == 0 else None)
    for i, cfg in enumerate(configs())
]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.importance_sampling_level}-{c.loss_type}"
                         f"{'-clamp' if c.log_ratio_clamp else ''}")
@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_matches_reference(backend, config, packed):
    c = _case(packed, per_token_adv=config.loss_type in ("bnpo", "dapo"))
    out, grads = _run(backend, c, config)
    expected, ref_grads = _oracle(c, config)
    check_against_reference(out, expected, grads, ref_grads)
    assert out.loss.dtype == torch.float32


@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_log_ratio_clamp_changes_value_and_gradient(backend, level):
    """The clamp is live in these inputs: clamped and unclamped results differ, and the oracle agrees."""
    c = _case(packed=True, per_token_adv=False)
    c["adv"][4] = -1.0  # the last response (log-ratio ~10.5): unclipped branch, so only the clamp stops it
    base = gk.GSPOConfig(importance_sampling_level=level, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28)
    clamped = dataclasses.replace(base, log_ratio_clamp=CLAMP)
    out_c, g_c = _run(backend, c, clamped)
    out_n, g_n = _run(backend, c, base)
    exp_c, ref_c = _oracle(c, clamped)
    check_against_reference(out_c, exp_c, g_c, ref_c)
    last = (torch.arange(sum(LENGTHS)) >= sum(LENGTHS[:4])) & (c["mask"] > 0)
    assert last.any()
    assert g_c[0][last].abs().max() == 0  # a clamped weight passes no gradient
    assert g_n[0][last].abs().min() > 1.0  # without the clamp: exp(10.5) / 4 tokens / 11 items
    assert out_n.loss > 1.3 * out_c.loss  # e^10.5 against e^10 on the largest term


def test_policy_loss_upcasts_half_precision_log_probs():
    c = _case(packed=True, per_token_adv=False)
    lp = c["logp"].bfloat16().requires_grad_()
    out = gk.policy_loss(lp, c["adv"], c["old"], cu_seqlens=c["cu"], config=gk.GSPOConfig(), backend="torch")
    assert out.loss.dtype == torch.float32
    out.loss.backward()
    assert lp.grad.dtype == torch.bfloat16


def test_policy_loss_bad_input_names_the_argument():
    lp = torch.randn(2, 3)
    adv = torch.randn(2)
    with pytest.raises(TypeError, match="logprobs"):
        gk.policy_loss(lp.long(), adv)
    with pytest.raises(ValueError, match="logprobs must be"):
        gk.policy_loss(lp.reshape(-1), adv)
    with pytest.raises(ValueError, match="logprobs must be \\[N\\]"):
        gk.policy_loss(lp, adv, cu_seqlens=torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match="entropy"):
        gk.policy_loss(lp, adv, entropy=torch.randn(3, 2))
    with pytest.raises(ValueError, match="advantages"):
        gk.policy_loss(lp, torch.randn(3))
    with pytest.raises(ValueError, match="old_logprobs"):
        gk.policy_loss(lp, adv, torch.randn(3, 2))
    with pytest.raises(ValueError, match="entropy is required"):
        gk.policy_loss(lp, adv, config=gk.GSPOConfig(entropy_coef=0.1))
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="log_ratio_clamp"):
            gk.GSPOConfig(log_ratio_clamp=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_policy_loss_on_cuda_runs_the_fused_sequence_stage(packed):
    """On CUDA, backend="auto" is the compiled Triton sequence stage (clamp included): against the oracle."""
    for config in CONFIGS:
        c = _case(packed, per_token_adv=config.loss_type in ("bnpo", "dapo"))
        expected, ref_grads = _oracle(c, config)
        out, grads = _run("auto", c, config)
        assert out.loss.is_cuda
        check_against_reference(out, expected, grads, ref_grads)
