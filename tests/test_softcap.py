"""``final_logit_softcapping`` (Gemma 2/3): logits ``z -> c tanh(z / c)`` before the temperature, every backend.

The float64 oracle (``gspo_kernels.reference``) caps in float64 and lets autograd differentiate ``tanh``; the
backends compute the cap and its slope ``sech^2(z / c)`` by hand. Every backend (``cpu``, ``torch``, ``triton``
in the interpreter without a GPU; the conformance suite's ``backend`` fixture, with its small tiles) is
compared with the oracle at the library's tolerances: fp32 within ``RTOL`` (1e-5 relative), bf16 / fp16 by
:func:`tests.support.assert_bf16_within_fp32_math_plus_rounding`. The cap is strong here (``c = 2`` against
logits up to ~8, ``tanh`` saturated on many columns), so a missing or wrong slope cannot hide.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import GSPOConfig, reference
from tests.distributed.test_vocab_parallel import RANGES, _free_port, gloo_process
from tests.support import (
    RTOL,
    assert_bf16_within_fp32_math_plus_rounding,
    check_against_reference,
    configs,
    device_for,
    linear_loss_vs_reference,
    logits_loss_vs_reference,
    rel_err,
    spawn_within,
)
from tests.test_conformance import NAMES, _device, use_backend

CAP = 2.0
# Every level and every loss type, with the optional terms (KL, bias correction, delta, temperature, entropy
# bonus) mixed as configs() mixes them: indices 0, 3, 5, 6, 10, 11 of its 12.
SOFTCAP_CONFIGS = [dataclasses.replace(configs()[i], final_logit_softcapping=CAP) for i in (0, 3, 5, 6, 10, 11)]
CONFIG_IDS = lambda c: f"{c.importance_sampling_level}-{c.loss_type}"  # noqa: E731


@pytest.fixture(params=NAMES)
def backend(request, monkeypatch) -> str:
    """Every backend, as in the conformance suite (skipped with the reason where it cannot run, small tiles)."""
    return use_backend(request.param, monkeypatch)


def _capped(z: torch.Tensor, c: float = CAP) -> torch.Tensor:
    return c * torch.tanh(z.double() / c)


# ---------------------------------------------------------------------------------------------
# The oracle itself: its cap is the plain formula (checked against capping the logits by hand).
# ---------------------------------------------------------------------------------------------


def test_reference_caps_before_the_temperature():
    logits, labels = torch.randn(4, 6, 30) * 5, torch.randint(0, 30, (4, 6))
    lp, ent = reference.token_logprobs(logits, labels, temperature=0.6, return_entropy=True,
                                       final_logit_softcapping=CAP)
    want_lp, want_ent = reference.token_logprobs(_capped(logits), labels, temperature=0.6, return_entropy=True)
    assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent)
    assert rel_err(lp, reference.token_logprobs(logits, labels, temperature=0.6)) > 0.1  # the cap matters here
    adv, old = torch.randn(4), want_lp.float() - 1e-4
    config = GSPOConfig(temperature=0.6, beta=0.1, entropy_coef=0.01)
    kw = dict(ref_logprobs=old - 0.2, config=config)
    capped_config = dataclasses.replace(config, final_logit_softcapping=CAP)
    got = reference.gspo_loss(logits, labels, adv, old, **{**kw, "config": capped_config})
    want = reference.gspo_loss(_capped(logits), labels, adv, old, **kw)
    assert got.loss.item() == want.loss.item()
    hidden, weight, bias = torch.randn(4, 6, 8), torch.randn(30, 8), torch.randn(30)
    got = reference.fused_linear_gspo_loss(hidden, weight, labels, adv, old, bias=bias,
                                           **{**kw, "config": capped_config})
    want = reference.gspo_loss(_capped(hidden.double() @ weight.double().T + bias.double()), labels, adv, old, **kw)
    assert abs(got.loss.item() - want.loss.item()) <= 1e-12 * max(1.0, abs(want.loss.item()))


# ---------------------------------------------------------------------------------------------
# Every backend against the oracle: losses (every level and loss type, padded and packed, strided inputs),
# per-token functions, each mode of the hidden-state path, half precision, in-place backward.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("config", SOFTCAP_CONFIGS, ids=CONFIG_IDS)
def test_logits_loss_with_softcap_matches_reference(backend, config, packed, case_seed):
    check_against_reference(*logits_loss_vs_reference(backend, config, packed, device=_device(backend)))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("config", SOFTCAP_CONFIGS, ids=CONFIG_IDS)
def test_linear_loss_with_softcap_matches_reference(backend, config, packed, case_seed):
    """Hidden states, weight and bias (the bias added before the cap: it must not be shifted by its max)."""
    check_against_reference(*linear_loss_vs_reference(backend, config, packed, device=_device(backend)))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_and_linear_logprobs_with_softcap(backend, temperature):
    """Log-probs, entropies and the gradients of a weighted sum of both, from a strided ``logits[:, 1:]`` view
    and from strided hidden states with a bias of 3 (large enough that a shifted bias would change the cap)."""
    dev = _device(backend)
    V, H = 97, 16
    base = torch.randn(3, 7, V) * 3
    labels = torch.randint(0, V, (3, 6))
    w1, w2 = torch.randn(3, 6), torch.randn(3, 6)
    x = base.clone().to(dev).requires_grad_()
    lp, ent = gk.token_logprobs(x[:, 1:], labels.to(dev), temperature=temperature, return_entropy=True,
                                backend=backend, final_logit_softcapping=CAP)
    x64 = base.double().requires_grad_()
    rl, re = reference.token_logprobs(x64[:, 1:], labels, temperature=temperature, return_entropy=True,
                                      final_logit_softcapping=CAP)
    assert lp.dtype == torch.float32 and lp.shape == (3, 6)
    assert rel_err(lp, rl) < RTOL and rel_err(ent, re) < RTOL
    (grad,) = torch.autograd.grad((lp * w1.to(dev) + ent * w2.to(dev)).sum(), x)
    (ref_grad,) = torch.autograd.grad((rl * w1 + re * w2).sum(), x64)
    assert rel_err(grad, ref_grad) < RTOL
    assert torch.all(grad[:, 0] == 0)
    with torch.no_grad():  # what users run for old / reference log-probs
        lp = gk.token_logprobs(x[:, 1:], labels.to(dev), temperature=temperature, backend=backend,
                               final_logit_softcapping=CAP)
    assert rel_err(lp, rl) < RTOL

    hidden = torch.randn(3, 6, H + 2)
    weight, bias = torch.randn(V, H) * 0.5, torch.randn(V) + 3.0
    leaves = [t.clone().to(dev).requires_grad_() for t in (hidden, weight, bias)]
    lp, ent = gk.linear_logprobs(leaves[0][..., 1:-1], leaves[1], labels.to(dev), bias=leaves[2],
                                 temperature=temperature, return_entropy=True, backend=backend,
                                 final_logit_softcapping=CAP)
    leaves64 = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    rl, re = reference.linear_logprobs(leaves64[0][..., 1:-1], leaves64[1], labels, bias=leaves64[2],
                                       temperature=temperature, return_entropy=True, final_logit_softcapping=CAP)
    assert rel_err(lp, rl) < RTOL and rel_err(ent, re) < RTOL
    grads = torch.autograd.grad((lp * w1.to(dev) + ent * w2.to(dev)).sum(), leaves)
    ref_grads = torch.autograd.grad((rl * w1 + re * w2).sum(), leaves64)
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < RTOL


@pytest.mark.parametrize("mode", ["default", "recompute", "batch_invariant"])
def test_hidden_state_modes_with_softcap(backend, mode):
    """Each way a backend runs the hidden-state path (logits saved for the backward or recomputed, the
    batch-invariant kernels) with the cap, some rows inactive (masked), against the oracle."""
    refused = backend == "torch" and mode == "batch_invariant"  # documented: torch refuses it, with the cap too
    dev = _device(backend)
    V, H = 150, 24
    hidden, weight, bias = torch.randn(2, 9, H), torch.randn(V, H) * 0.4, torch.randn(V)
    labels = torch.randint(0, V, (2, 9))
    mask = (torch.rand(2, 9) > 0.3).float()
    config = SOFTCAP_CONFIGS[2]
    old = (reference.linear_logprobs(hidden, weight, labels, bias=bias, temperature=config.temperature,
                                     final_logit_softcapping=CAP) - torch.randn(2, 1) * 2e-4).float()
    adv = torch.tensor([1.0, -0.5])
    kw = dict(memory_budget=0 if mode == "recompute" else None, batch_invariant=mode == "batch_invariant")
    leaves = [t.clone().to(dev).requires_grad_() for t in (hidden, weight, bias)]
    if refused:
        with pytest.raises(ValueError, match="batch_invariant=True needs backend='triton' or backend='cpu'"):
            gk.fused_linear_gspo_loss(leaves[0], leaves[1], labels.to(dev), adv.to(dev), old.to(dev), bias=leaves[2],
                                      mask=mask.to(dev), config=config, backend=backend, **kw)
        return
    out = gk.fused_linear_gspo_loss(leaves[0], leaves[1], labels.to(dev), adv.to(dev), old.to(dev), bias=leaves[2],
                                    mask=mask.to(dev), config=config, backend=backend, **kw)
    grads = torch.autograd.grad(out.loss, leaves)
    leaves64 = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    expected = reference.fused_linear_gspo_loss(leaves64[0], leaves64[1], labels, adv, old, bias=leaves64[2],
                                                mask=mask, config=config)
    check_against_reference(out, expected, [g.cpu() for g in grads], torch.autograd.grad(expected.loss, leaves64))


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_half_precision_with_softcap(backend, path):
    assert_bf16_within_fp32_math_plus_rounding(backend, path, softcap=CAP)


def test_inplace_backward_with_softcap(backend):
    """The gradient written into the logits' own storage: the label's slope is read before it is overwritten."""
    dev = _device(backend)
    B, T, V = 3, 6, 50
    logits = torch.randn(B, T, V) * 3
    labels = torch.randint(0, V, (B, T))
    adv = torch.tensor([1.0, 0.0, -2.0])
    config = GSPOConfig(final_logit_softcapping=CAP, temperature=0.8)
    old = reference.token_logprobs(logits, labels, temperature=0.8, final_logit_softcapping=CAP).float() - 1e-4
    x64 = logits.double().requires_grad_()
    (ref_grad,) = torch.autograd.grad(reference.gspo_loss(x64, labels, adv, old, config=config).loss, x64)
    x = logits.clone().to(dev).requires_grad_()
    gk.gspo_loss(x, labels.to(dev), adv.to(dev), old.to(dev), config=config, backend=backend,
                 inplace_backward=True).loss.backward()
    assert x.grad.data_ptr() == x.data_ptr()
    assert rel_err(x.grad.cpu(), ref_grad) < RTOL


def test_extreme_logits_with_softcap(backend):
    """Saturated logits (+-1e4: slope exactly 0 in fp32), -inf columns off the label (capped to -c, a real
    column, as the model's own cap makes them), and a NaN logit (NaN in, NaN out for its row only)."""
    dev = _device(backend)
    V = 40
    logits = torch.randn(4, V) * 2
    labels = torch.tensor([0, 1, 2, 3])
    logits[0, 5:9] = 1e4
    logits[1, 1] = -1e4  # the label itself saturated below
    logits[2, 10:] = float("-inf")
    x = logits.clone().to(dev).requires_grad_()
    lp, ent = gk.token_logprobs(x, labels.to(dev), return_entropy=True, backend=backend, final_logit_softcapping=CAP)
    x64 = logits.double().requires_grad_()
    rl, re = reference.token_logprobs(x64, labels, return_entropy=True, final_logit_softcapping=CAP)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert rel_err(lp, rl) < RTOL and rel_err(ent, re) < RTOL
    w1, w2 = torch.randn(4), torch.randn(4)
    (grad,) = torch.autograd.grad((lp * w1.to(dev) + ent * w2.to(dev)).sum(), x)
    (ref_grad,) = torch.autograd.grad((rl * w1 + re * w2).sum(), x64)
    assert torch.isfinite(grad).all() and rel_err(grad, ref_grad) < RTOL
    assert torch.all(grad[0, 5:9] == 0) and grad[1, 1] == 0 and torch.all(grad[2, 10:] == 0)
    logits[3, 7] = float("nan")
    with torch.no_grad():
        lp = gk.token_logprobs(logits.to(dev), labels.to(dev), backend=backend, final_logit_softcapping=CAP)
    assert torch.isnan(lp[3]) and torch.isfinite(lp[:3]).all()


def test_fp64_inputs_with_softcap(backend):
    """fp64 logits / hidden states: fp64 math (the cpu backend runs them through the torch backend). The Triton
    kernels' cap is a polynomial / exp2 formula built for fp32 accuracy: about 3e-11 relative in fp64."""
    tol = 1e-9 if backend == "triton" else 1e-12
    dev = _device(backend)
    logits, labels = torch.randn(2, 5, 60, dtype=torch.float64) * 3, torch.randint(0, 60, (2, 5))
    x = logits.clone().to(dev).requires_grad_()
    lp = gk.token_logprobs(x, labels.to(dev), backend=backend, final_logit_softcapping=CAP).cpu()
    rl = reference.token_logprobs(logits, labels, final_logit_softcapping=CAP)
    assert lp.dtype == torch.float64 and rel_err(lp, rl) < tol
    hidden, weight = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(60, 8, dtype=torch.float64)
    h = hidden.clone().to(dev).requires_grad_()
    lp = gk.linear_logprobs(h, weight.to(dev), labels.to(dev), backend=backend, final_logit_softcapping=CAP)
    (g,) = torch.autograd.grad(lp.sum(), h)
    g = g.cpu()
    h64 = hidden.clone().requires_grad_()
    (rg,) = torch.autograd.grad(reference.linear_logprobs(h64, weight, labels, final_logit_softcapping=CAP).sum(), h64)
    assert rel_err(g, rg) < tol


# ---------------------------------------------------------------------------------------------
# Validation and policies.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, error", [
    (0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
    (True, TypeError), ("30", TypeError), (torch.tensor(30.0), TypeError),
])
def test_bad_softcap_is_refused_naming_the_option(value, error):
    with pytest.raises(error, match="final_logit_softcapping"):
        GSPOConfig(final_logit_softcapping=value)
    logits, labels = torch.randn(2, 5), torch.tensor([0, 1])
    with pytest.raises(error, match="final_logit_softcapping"):
        gk.token_logprobs(logits, labels, final_logit_softcapping=value)
    with pytest.raises(error, match="final_logit_softcapping"):
        gk.linear_logprobs(torch.randn(2, 3), torch.randn(5, 3), labels, final_logit_softcapping=value)


def test_good_softcap_values():
    assert GSPOConfig().final_logit_softcapping is None
    assert GSPOConfig(final_logit_softcapping=30).final_logit_softcapping == 30
    logits, labels = torch.randn(2, 5), torch.tensor([0, 1])
    lp_int = gk.token_logprobs(logits, labels, final_logit_softcapping=3, backend="torch")
    assert torch.equal(lp_int, gk.token_logprobs(logits, labels, final_logit_softcapping=3.0, backend="torch"))


def test_policy_loss_ignores_the_softcap():
    """The log-probs are given: the cap (like the temperature) was applied where they were computed."""
    logp, adv = -torch.rand(2, 4), torch.randn(2)
    old = logp - 1e-4
    plain = gk.policy_loss(logp, adv, old)
    capped = gk.policy_loss(logp, adv, old, config=GSPOConfig(final_logit_softcapping=CAP))
    assert torch.equal(plain.loss, capped.loss)


# ---------------------------------------------------------------------------------------------
# Vocabulary parallelism: the cap is elementwise; 2 gloo processes against the oracle.
# ---------------------------------------------------------------------------------------------


def _vp_worker(rank: int, world: int, port: int) -> None:
    with gloo_process(rank, world, port):
        try:
            s, e = RANGES[world][rank]
            vp = gk.VocabParallel(None, s, e)
            V, H = vp.vocab_size, 16
            for backend_name in ("cpu", "torch", "triton"):
                device = device_for(backend_name)  # CUDA tensors for triton / torch where CUDA exists
                torch.set_default_device(device)
                gen = torch.Generator(device=device).manual_seed(7)  # the same inputs on every rank
                labels = torch.randint(0, V, (3, 5), generator=gen)
                w1, w2 = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
                logits = torch.randn(3, 5, V, generator=gen) * 3
                # rank 1's first column (15) is the stand-in label of rows whose label lives elsewhere: -inf there
                logits[..., 15] = torch.where(labels == 15, logits[..., 15], torch.full_like(logits[..., 15], -math.inf))
                shard = logits[..., s:e].clone().requires_grad_()
                lp, ent = gk.token_logprobs(shard, labels, temperature=0.7, return_entropy=True, backend=backend_name,
                                            vocab_parallel=vp, final_logit_softcapping=CAP)
                (g,) = torch.autograd.grad((lp * w1 + ent * w2).sum(), shard)
                x64 = logits.double().requires_grad_()
                rl, re = reference.token_logprobs(x64, labels, temperature=0.7, return_entropy=True,
                                                  final_logit_softcapping=CAP)
                (rg,) = torch.autograd.grad((rl * w1 + re * w2).sum(), x64)
                name = f"{backend_name} rank {rank}"
                assert rel_err(lp, rl) < RTOL and rel_err(ent, re) < RTOL, name
                assert rel_err(g, rg[..., s:e]) < RTOL, name

                hidden, weight = torch.randn(3, 5, H, generator=gen), torch.randn(V, H, generator=gen) * 0.5
                bias = torch.randn(V, generator=gen) + 2.0
                h, w_s, b_s = hidden.clone().requires_grad_(), weight[s:e].clone().requires_grad_(), \
                    bias[s:e].clone().requires_grad_()
                config = dataclasses.replace(configs()[5], final_logit_softcapping=CAP)
                old = (reference.linear_logprobs(hidden, weight, labels, bias=bias, temperature=config.temperature,
                                                 final_logit_softcapping=CAP) - 1e-4).float()
                adv = torch.tensor([1.0, -1.0, 0.5])
                out = gk.fused_linear_gspo_loss(h, w_s, labels, adv, old, bias=b_s, config=config, backend=backend_name,
                                                vocab_parallel=vp)
                grads = torch.autograd.grad(out.loss, (h, w_s, b_s))
                leaves64 = [t.double().requires_grad_() for t in (hidden, weight, bias)]
                expected = reference.fused_linear_gspo_loss(*leaves64[:2], labels, adv, old, bias=leaves64[2],
                                                            config=config)
                ref_grads = torch.autograd.grad(expected.loss, leaves64)
                assert abs(out.loss.item() - expected.loss.item()) <= RTOL * max(1.0, abs(expected.loss.item())), name
                assert rel_err(grads[0], ref_grads[0]) < RTOL, name
                assert rel_err(grads[1], ref_grads[1][s:e]) < RTOL and rel_err(grads[2], ref_grads[2][s:e]) < RTOL, name
        finally:
            torch.set_default_device(None)


def test_vocab_parallel_with_softcap():
    spawn_within(_vp_worker, (2, _free_port()), nprocs=2, timeout=180)



def test_torch_compile_fullgraph_with_softcap():
    """backend="cpu" under torch.compile (fullgraph): the ops' softcap argument goes through their fake
    implementations and autograd formulas; the compiled loss and gradients equal the eager ones, and the cap
    changed them."""
    from tests.backends.cpu.test_cpu_backend import _compile_case, _eager_and_compiled

    hidden, weight, labels, adv, old, kw = _compile_case()
    cfg = GSPOConfig(loss_type="bnpo", beta=0.04, entropy_coef=0.01, final_logit_softcapping=1.5)

    def step(h, w, config=cfg):
        a = gk.gspo_loss(h @ w.T, labels, adv, old, config=config, backend="cpu", **kw).loss
        return a + gk.fused_linear_gspo_loss(h, w, labels, adv, old, config=config, backend="cpu", **kw).loss

    _eager_and_compiled(step, hidden, weight)
    uncapped = dataclasses.replace(cfg, final_logit_softcapping=None)
    assert abs(step(hidden, weight).item() - step(hidden, weight, uncapped).item()) > 1e-3
