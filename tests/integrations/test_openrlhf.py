"""The OpenRLHF integration against OpenRLHF 0.11.2 itself (imported, never transcribed): its PolicyLoss on every
combination of its options and every backend, its Actor on a tiny model, the refusals, switching it on.

OpenRLHF imports ``flash_attn`` (and its trainer ``vllm``) at import time; ``tests/integrations/openrlhf_env.py`` puts the
stand-ins of ``tests/integrations/stubs`` on ``sys.path`` for this module's tests only.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

from gspo_kernels.testing import FP32_RTOL, rel_err
from tests.integrations.openrlhf_env import openrlhf_importable, subprocess_env, tiny_causal_lm
from tests.support import device_for

BACKENDS = ("torch", "cpu", "triton")
BF16_U = 2.0 ** -8  # one bf16 rounding, relative


@pytest.fixture(scope="module")
def orl():
    """``(gspo_kernels.integrations.openrlhf, openrlhf.models)`` with OpenRLHF importable; TorchDynamo off meanwhile
    (OpenRLHF's ``compute_entropy`` is ``torch.compile``d: eager here, the same math without a compile per shape)."""
    import torch._dynamo

    disabled = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        with openrlhf_importable():
            import openrlhf.models

            from gspo_kernels.integrations import openrlhf as integration

            yield integration, openrlhf.models
    finally:
        torch._dynamo.config.disable = disabled


# ---------------------------------------------------------------------------------------------- PolicyLoss

LENGTHS = (9, 1, 0, 5, 7, 3)  # a full, a length-1 and an empty response
T = 9
# OpenRLHF's mismatch corrections (level, mode, gating, threshold): each gate's band keeps some units and drops
# others on _losses_inputs' tokens (rollout 0.3 from old, sampled-token probabilities 0.02 .. 0.95)
CORRECTIONS = (
    ("off", "mask", "ratio", (0.5, 5.0)),
    ("token", "mask", "ratio", (0.78, 1.3)),
    ("token", "clip", "ratio", (0.78, 1.3)),
    ("seq", "mask", "ratio", (0.93, 1.09)),
    ("token", "mask", "binary_kl", (0.0, 2.5e-3)),
    ("seq", "mask", "binary_kl", (0.0, 0.016)),
    ("token", "mask", "tv", (0.0, 0.02)),
    ("seq", "mask", "tv", (0.0, 0.047)),
)


def _combinations():
    """Every combination of OpenRLHF's options that it accepts, once each: ppo with each correction, dual clip
    or not, token or sample aggregation; gspo (always sample aggregation) with the correction off or on (on: the
    ratio against the rollout's log-probs); each with this batch's counts or global ones (dp_size 2)."""
    out = []
    for (kind, corrections), dual, token_level, global_counts in itertools.product(
            (("ppo", CORRECTIONS), ("gspo", CORRECTIONS[:2])), (None, 1.6), (True, False), (False, True)):
        if kind == "gspo" and token_level:
            continue  # OpenRLHF's gspo forces the sample aggregation
        for level, mode, gating, threshold in corrections:
            out.append(dict(ctor=dict(clip_eps_low=0.1, clip_eps_high=0.12, dual_clip=dual, token_level_loss=token_level,
                                      policy_loss_type=kind, is_correction_level=level, is_correction_mode=mode,
                                      is_correction_gating=gating, is_correction_threshold=list(threshold)),
                            global_counts=global_counts))
    return out


COMBINATIONS = _combinations()


def _losses_inputs(dtype=torch.float32):
    """``[B, T]`` log-probs (the sampled tokens' probabilities 0.02 .. 0.95), old log-probs 0.3 away (the clip band
    of 0.1 / 0.12 bites), rollout log-probs 0.3 from those, per-token advantages of both signs, and OpenRLHF's
    right-padded action mask; masked positions hold finite values (OpenRLHF multiplies them by 0)."""
    B = len(LENGTHS)
    logp = -torch.rand(B, T) * 3.9 - 0.05
    old = logp + 0.3 * torch.randn(B, T)
    rollout = old + 0.3 * torch.randn(B, T)
    adv = torch.randn(B, T)
    adv[0, :3] = 0.0
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    return [x.to(dtype) for x in (logp, old, rollout, adv)] + [mask]


def _global_counts(mask):
    """OpenRLHF's loss_batch_info as two data-parallel ranks holding this batch each would get it."""
    return dict(dp_size=2, batch_num_tokens=2 * mask.sum().float(), global_batch_size=2 * mask.any(-1).sum().float())


def _run(loss_fn, logp, old, adv, mask, rollout, counts):
    x = logp.clone().requires_grad_()
    loss, *metrics = loss_fn(x, old, adv, action_mask=mask, rollout_log_probs=rollout, **counts)
    (grad,) = torch.autograd.grad(loss, x)
    return loss, grad, metrics


def _compare(got, want, what: str, loss_tol: float, grad_tol: float, metric_tol: float, metric_rtol: float = 0.0):
    """Loss relative to ``max(|L|, 1)``, the gradient relative to its largest entry, the metrics absolute (plus
    ``metric_rtol`` relative: those OpenRLHF returns in the log-probs' dtype)."""
    (loss, grad, metrics), (loss_w, grad_w, metrics_w) = got, want
    assert abs(loss.item() - loss_w.item()) <= loss_tol * max(abs(loss_w.item()), 1.0), (what, loss, loss_w)
    assert rel_err(grad.double().cpu(), grad_w.double().cpu()) <= grad_tol, what
    for name, value, expected in zip(("clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"), metrics, metrics_w):
        assert (value is None) == (expected is None), (what, name)
        if expected is not None:
            tol = metric_tol + metric_rtol * abs(float(expected))
            assert abs(float(value) - float(expected)) <= tol, (what, name, float(value), float(expected))


def _one_per_correction():
    """One combination per (policy loss, correction), the dual clip / aggregation / counts rotating among them."""
    groups = {}
    for combo in COMBINATIONS:
        ctor = combo["ctor"]
        key = tuple(ctor[k] for k in ("policy_loss_type", "is_correction_level", "is_correction_gating",
                                      "is_correction_mode"))
        groups.setdefault(key, []).append(combo)
    return [group[(3 * i) % len(group)] for i, group in enumerate(groups.values())]


# The Triton backend interpreted on the CPU (~1 s a call) runs one combination per correction (every branch of the
# sequence kernel the integration reaches, the dual clip, both aggregations and global counts among them); torch
# and cpu run them all (the options' mapping does not depend on the backend); on a GPU Triton runs them all.
TRITON_COMBINATIONS = _one_per_correction()


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_matches_openrlhf_on_every_option(orl, backend):
    """Loss, gradient wrt ``log_probs`` and the four metrics (None where OpenRLHF's are) of every combination of
    OpenRLHF's options, fp32: within fp32 rounding (the library's stated 1e-5; the metrics are counts or means)."""
    gko, models = orl
    dev = device_for(backend)
    logp, old, rollout, adv, mask = (x.to(dev) for x in _losses_inputs())
    bites = {}
    combinations = TRITON_COMBINATIONS if backend == "triton" and dev == "cpu" else COMBINATIONS
    for combo in combinations:
        counts = _global_counts(mask) if combo["global_counts"] else {}
        want = _run(models.PolicyLoss(**combo["ctor"]), logp, old, adv, mask, rollout, counts)
        got = _run(gko.PolicyLoss(**combo["ctor"], backend=backend), logp, old, adv, mask, rollout, counts)
        _compare(got, want, combo, FP32_RTOL, FP32_RTOL, 1e-6)
        if want[2][3] is not None:
            bites.setdefault(tuple(combo["ctor"][k] for k in ("is_correction_level", "is_correction_gating",
                                                              "is_correction_mode")), set()).add(float(want[2][3]))
    # every gate kept some units and dropped others
    assert len(bites) == len(CORRECTIONS) - 1
    assert all(0 < f < 1 for shares in bites.values() for f in shares), bites


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_policy_loss_bf16(orl, backend):
    """bf16 inputs. The library computes in fp32 from them: against OpenRLHF's math on the same inputs in float64,
    within fp32 rounding plus the loss's two roundings to bf16 (the library's output, then OpenRLHF's aggregation
    factor) and the gradient's one. Against OpenRLHF's own bf16 arithmetic (the ungated combinations), within its
    roundings: per token ``l_t`` carries at most ``(5 + |r_t|) u`` relative error (the log-ratio's rounding, scaled
    by ``|r_t|`` through exp; exp; the two products; the dual clip's product), the masked sum and the division one
    ``u`` each, where ``u = 2^-8``; the gradient the same per entry; inputs whose ratio lies within that of a
    clip edge or the dual clip's (or of their bf16 roundings, OpenRLHF's bounds) are dropped: there the gradient
    is discontinuous (and a tie in bf16 halves it)."""
    gko, models = orl
    dev = device_for(backend)
    logp, old, rollout, adv, mask = (x.to(dev) for x in _losses_inputs(torch.bfloat16))
    combinations = TRITON_COMBINATIONS[::3] if backend == "triton" and dev == "cpu" else COMBINATIONS
    u = BF16_U
    r = (logp.double() - old.double()).abs()
    ratio = torch.exp(logp.double() - old.double())
    edges = [edge for e in (1 - 0.1, 1 + 0.12, 1.6) for edge in (e, float(torch.tensor(e).bfloat16()))]  # 1.6: dual
    near = torch.zeros_like(mask)
    for edge in edges:
        near |= (ratio - edge).abs() <= (6 + r) * u * ratio
    for combo in combinations:
        counts = _global_counts(mask) if combo["global_counts"] else {}
        to64 = lambda *xs: [x.double() for x in xs]  # noqa: E731
        want64 = _run(models.PolicyLoss(**combo["ctor"]), *to64(logp, old, adv), mask, rollout.double(),
                      {k: (v.double() if torch.is_tensor(v) else v) for k, v in counts.items()})
        got = _run(gko.PolicyLoss(**combo["ctor"], backend=backend), logp, old, adv, mask, rollout, counts)
        _compare(got, want64, combo, FP32_RTOL + 2 * u, FP32_RTOL + u, 1e-5, u)  # ppo_kl, vllm_kl: bf16
        if combo["ctor"]["is_correction_level"] != "off" or combo["ctor"]["policy_loss_type"] != "ppo":
            continue  # (gspo's sequence ratio and the gates: the float64 check above)
        keep = mask & ~near
        want = _run(models.PolicyLoss(**combo["ctor"]), logp, old, adv, keep, rollout, counts)
        got = _run(gko.PolicyLoss(**combo["ctor"], backend=backend), logp, old, adv, keep, rollout, counts)
        terms = _per_token_losses(combo, logp, old, adv, keep).abs()
        per_token = ((5 + r) * u * terms).sum() / keep.sum().clamp(min=1)
        loss_tol = (per_token + 4 * u * abs(want[0].item())) / max(abs(want[0].item()), 1.0)
        grad_tol = float(((5 + r) * u)[keep].max()) + 2 * u
        _compare(got, want, combo, loss_tol, grad_tol, 1e-5, 3 * u)  # ppo_kl: OpenRLHF's bf16 sum and division


def _per_token_losses(combo, logp, old, adv, mask):
    """|l_t| of OpenRLHF's ppo surrogate in float64 (the scale of each token's rounding error)."""
    ratio = torch.exp(logp.double() - old.double())
    a = adv.double()
    loss = -torch.minimum(ratio * a, ratio.clamp(0.9, 1.12) * a)
    if combo["ctor"]["dual_clip"] is not None:
        loss = torch.where(a < 0, torch.minimum(loss, -combo["ctor"]["dual_clip"] * a), loss)
    return torch.where(mask, loss, 0.0)


# OpenRLHF's refusals: (constructor options, what the message names)
REFUSED = (
    (dict(is_correction_level="seq", is_correction_mode="clip"), "clip"),
    (dict(is_correction_level="token", is_correction_mode="clip", is_correction_gating="tv"), "clip"),
    (dict(is_correction_level="off", is_correction_mode="clip", is_correction_gating="binary_kl"), "clip"),
    (dict(is_correction_level="token", is_correction_gating="binary_kl", is_correction_threshold=[0.1, 0.5]),
     "upper bound"),
    (dict(is_correction_level="both"), "is_correction_level"),
    (dict(is_correction_mode="drop"), "is_correction_mode"),
    (dict(is_correction_gating="kl"), "is_correction_gating"),
    (dict(dual_clip=1.0), "dual_clip"),
)


@pytest.mark.parametrize("options, names", REFUSED, ids=[n for _, n in REFUSED])
def test_policy_loss_refuses_what_openrlhf_refuses(orl, options, names):
    gko, models = orl
    with pytest.raises((ValueError, AssertionError)):
        models.PolicyLoss(**options)
    with pytest.raises(ValueError, match=names):
        gko.PolicyLoss(**options)


def test_policy_loss_refuses_what_the_library_cannot_express(orl):
    """OpenRLHF accepts these and then keeps no token, or raises in forward: refused clearly at construction."""
    gko, _ = orl
    with pytest.raises(ValueError, match="low > high"):
        gko.PolicyLoss(is_correction_level="token", is_correction_threshold=[2.0, 1.0])
    with pytest.raises(ValueError, match="finite number > 0"):
        gko.PolicyLoss(is_correction_level="token", is_correction_gating="tv", is_correction_threshold=[0.0, 0.0])
    with pytest.raises(ValueError, match="policy_loss_type"):
        gko.PolicyLoss(policy_loss_type="grpo")
    with pytest.raises(ValueError, match="epsilon_low"):
        gko.PolicyLoss(clip_eps_low=1.0)
    loss = gko.PolicyLoss(is_correction_level="token")
    x = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="rollout_log_probs is required"):
        loss(x, x.detach(), torch.ones(2, 3), action_mask=torch.ones(2, 3, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------------- Actor

P, A = 6, 6  # prompt (left-padded) and response (right-padded) widths: S = 12


def _rollout_batch(vocab: int):
    """OpenRLHF's layout: ``sequences [B, P + A]`` (prompts left-padded, responses right-padded), the attention
    mask, and the action mask ``[B, A]`` of the response tokens."""
    prompt_lengths, response_lengths = (6, 3, 4), (6, 2, 4)
    B = len(prompt_lengths)
    sequences = torch.randint(1, vocab, (B, P + A))
    positions = torch.arange(P + A)[None, :]
    prompt = (positions >= P - torch.tensor(prompt_lengths)[:, None]) & (positions < P)
    response = (positions >= P) & (positions < P + torch.tensor(response_lengths)[:, None])
    attention_mask = (prompt | response).long()
    sequences = torch.where(attention_mask > 0, sequences, 0)
    return sequences, attention_mask, response[:, P:]


def _actor_pair(orl, model, backend: str, packing: bool, temperature: float = 0.7):
    gko, models = orl
    theirs = models.Actor(model, temperature=temperature)
    ours = gko.Actor(model, temperature=temperature, gspo_backend=backend)
    theirs.packing_samples = ours.packing_samples = packing  # OpenRLHF sets it only for a model it loads itself
    return ours, theirs


def _logits(model, sequences, attention_mask, temperature: float = 0.7):
    """The model's logits of every position but the last, over the temperature, in float64 (for the bounds)."""
    with torch.no_grad():
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        z = model(sequences, attention_mask=attention_mask, position_ids=position_ids).logits[:, :-1]
    return z.double() / temperature


def _actor_step(actor, model, sequences, attention_mask, action_mask, **kwargs):
    """The trainer's use: action log-probs (and the entropy) of the policy, a loss weighting each, its gradients."""
    model.zero_grad(set_to_none=True)
    out = actor(sequences, action_mask, attention_mask=attention_mask, return_output=True, **kwargs)
    logp, output = out
    g = torch.Generator().manual_seed(7)
    loss = (logp * torch.randn(logp.shape, generator=g)).sum()
    entropy = getattr(output, "entropy", None)
    if entropy is not None:
        loss = loss + (entropy[:, -A:] * action_mask * torch.randn(action_mask.shape, generator=g)).sum()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), None if entropy is None else entropy.detach(), output, grads


# padded on the CPU backends (the head is linear_logprobs, whose backends the library's own tests hold to the float64
# oracle: Triton's among them); OpenRLHF's packed samples (unpadded, then padded back: the same for every backend)
# with the lm_head tied to the embeddings (Qwen2.5-0.5B's layout: both gradients reach one weight)
ACTOR_CASES = [("torch", False, False), ("cpu", False, False), ("cpu", True, True)]


@pytest.mark.parametrize("backend, packing, tied", ACTOR_CASES,
                         ids=["padded-torch", "padded-cpu", "packed-tied-checkpointed-cpu"])
def test_actor_matches_openrlhf(orl, backend, packing, tied):
    """fp32, temperature 0.7, left-padded prompts and right-padded responses (or OpenRLHF's packed samples): the
    action log-probs, the entropy at every position, every parameter's gradient, the old log-probs (no gradient:
    only the action window's) and every position's log-probs (``return_logprobs``) equal OpenRLHF's Actor's within
    fp32 rounding; ``output`` holds no logits. OpenRLHF's entropy, ``logsumexp(z) - sum_v p_v z_v``, cancels where
    the distribution is peaked: its absolute error reaches a few fp32 roundings of ``max |z|`` (8 allowed)."""
    model = tiny_causal_lm(tie_word_embeddings=tied)
    if packing:  # and the backbone's activations recomputed in the backward (--actor.gradient_checkpointing_enable)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    sequences, attention_mask, action_mask = _rollout_batch(model.config.vocab_size)
    ours, theirs = _actor_pair(orl, model, backend, packing)
    got = _actor_step(ours, model, sequences, attention_mask, action_mask, return_entropy=True)
    want = _actor_step(theirs, model, sequences, attention_mask, action_mask, return_entropy=True)
    assert got[0].shape == want[0].shape == action_mask.shape and got[1].shape == want[1].shape
    assert rel_err(got[0], want[0]) < FP32_RTOL
    cancellation = 8 * 2.0 ** -23 * _logits(model, sequences, attention_mask).abs().amax(-1)
    assert ((got[1] - want[1]).abs() <= FP32_RTOL * want[1].abs().max() + cancellation).all()
    assert got[2]["logits"] is None and want[2]["logits"] is not None
    assert set(got[3]) == set(want[3])
    for name in want[3]:
        assert rel_err(got[3][name], want[3][name]) < FP32_RTOL, name
    with torch.no_grad():
        old = ours(sequences, action_mask, attention_mask=attention_mask)
        assert rel_err(old, theirs(sequences, action_mask, attention_mask=attention_mask)) < FP32_RTOL
        every = ours(sequences, attention_mask=attention_mask, return_logprobs=True)
        want_every = theirs(sequences, attention_mask=attention_mask, return_logprobs=True)
        assert every.shape == want_every.shape == (sequences.shape[0], sequences.shape[1] - 1)
        assert rel_err(every, want_every) < FP32_RTOL


def _flat(grads, names):
    return torch.cat([grads[name].double().flatten() for name in names])


@pytest.mark.parametrize("backend", ("cpu", "torch"))
def test_actor_bf16(orl, backend):
    """A bf16 model. Both actors run the same backbone (the same bf16 hidden states); OpenRLHF rounds the logits
    to bf16 before its fp32 softmax, the library keeps them in fp32. So per token, with ``z`` OpenRLHF's logits
    over the temperature and ``u = 2^-8``: ``|d logp| <= u (|z_y| + max |z|)`` and ``|d H| <= u sum_v p_v |log p_v
    + H| |z_v|`` (first order; the fp32 tolerance added). The parameters' gradients (the bf16 backbone's backward
    of each head's ``dH``) are each within a bf16 rounding ``u`` of OpenRLHF's own error against the float64 model:
    the two heads round different intermediates (OpenRLHF the logits, the library the logits' gradient operand)."""
    import copy

    gko, models = orl
    model = tiny_causal_lm(dtype=torch.bfloat16)
    exact = copy.deepcopy(model).double()
    sequences, attention_mask, action_mask = _rollout_batch(model.config.vocab_size)
    ours, theirs = _actor_pair(orl, model, backend, False)
    got = _actor_step(ours, model, sequences, attention_mask, action_mask, return_entropy=True)
    want = _actor_step(theirs, model, sequences, attention_mask, action_mask, return_entropy=True)
    reference = models.Actor(exact, temperature=0.7)
    reference.packing_samples = False
    truth = _actor_step(reference, exact, sequences, attention_mask, action_mask, return_entropy=True)

    u = BF16_U
    z = _logits(model, sequences, attention_mask)
    p = torch.softmax(z, -1)
    log_p = torch.log_softmax(z, -1)
    entropy = -(p * log_p).sum(-1, keepdim=True)
    labels = sequences[:, 1:]
    logp_bound = u * (z.gather(-1, labels[..., None]).squeeze(-1).abs() + z.abs().amax(-1)) + FP32_RTOL
    entropy_bound = u * (p * (log_p + entropy).abs() * z.abs()).sum(-1) + FP32_RTOL
    window = slice(-A, None)
    assert ((got[0] - want[0]).abs() <= logp_bound[:, window] * action_mask).all()
    assert ((got[1] - want[1]).abs() <= entropy_bound).all()
    names = list(truth[3])
    exact_grad = _flat(truth[3], names)
    err_ours = (_flat(got[3], names) - exact_grad).norm() / exact_grad.norm()
    err_theirs = (_flat(want[3], names) - exact_grad).norm() / exact_grad.norm()
    assert err_ours <= err_theirs + u, (float(err_ours), float(err_theirs))


def test_actor_keeps_the_model_outputs_and_refuses_logit_scales(orl):
    """A mixture-of-experts model: ``output.aux_loss`` (the router's load-balancing loss, which OpenRLHF's trainer
    adds) equals OpenRLHF's, and its gradient too; a Gemma-2 soft cap is the library's; a model that scales its
    logits is refused naming the option; a vision-language model runs OpenRLHF's forward, with one warning."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, MixtralConfig, MixtralForCausalLM

    gko, models = orl
    moe = MixtralForCausalLM(MixtralConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01))
    sequences, attention_mask, action_mask = _rollout_batch(101)
    ours, theirs = _actor_pair(orl, moe, "cpu", False)
    got = _actor_step(ours, moe, sequences, attention_mask, action_mask)
    want = _actor_step(theirs, moe, sequences, attention_mask, action_mask)
    assert got[2].aux_loss is not None and abs(float(got[2].aux_loss.detach()) - float(want[2].aux_loss.detach())) < 1e-6
    assert rel_err(got[0], want[0]) < FP32_RTOL

    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           final_logit_softcapping=2.0))
    ours, theirs = _actor_pair(orl, gemma, "cpu", False)
    with torch.no_grad():
        assert rel_err(ours(sequences, action_mask, attention_mask=attention_mask),
                       theirs(sequences, action_mask, attention_mask=attention_mask)) < FP32_RTOL

    scaled = tiny_causal_lm()
    scaled.config.logit_scale = 2.0
    with pytest.raises(ValueError, match="logit_scale"):
        gko.Actor(scaled)(sequences, action_mask, attention_mask=attention_mask)

    vlm, theirs = _actor_pair(orl, tiny_causal_lm(), "cpu", False)
    vlm.is_vlm = theirs.is_vlm = True
    with pytest.warns(UserWarning, match="vision-language model"):
        with torch.no_grad():
            assert torch.equal(vlm(sequences, action_mask, attention_mask=attention_mask),
                               theirs(sequences, action_mask, attention_mask=attention_mask))


# ------------------------------------------------------------------------------------------- switching it on

_SWITCH_ON = r"""
import importlib, warnings
import ray
from gspo_kernels.integrations import openrlhf as gko

# OpenRLHF's trainer modules imported first (they bind Actor and PolicyLoss at import) ...
import openrlhf.models
import openrlhf.trainer.ray.launcher as launcher
import openrlhf.trainer.ray.ppo_actor as ppo_actor
# ... then what a Ray worker does: import and run the hook named in the job's runtime_env
module, name = gko.HOOK.rsplit(".", 1)
getattr(importlib.import_module(module), name)()
# the names the trainer resolves when it builds the policy, its loss and the reference model
assert ppo_actor.ActorPPOTrainer.__init__.__globals__["PolicyLoss"] is gko.PolicyLoss
assert ppo_actor.Actor is gko.Actor and launcher.Actor is gko.Actor
assert openrlhf.models.Actor is gko.Actor and openrlhf.models.PolicyLoss is gko.PolicyLoss
assert gko.PolicyLoss.backend == "torch" and gko.Actor.gspo_backend == "torch"  # from the job's env_vars

# the driver: enable() makes the ray.init that OpenRLHF's train() calls start every worker with the hook
calls = []
ray.init = lambda *args, **kwargs: calls.append(kwargs)
gko.enable(backend="torch")
ray.init(runtime_env={"env_vars": {"NCCL_DEBUG": "WARN"}})
env = calls[0]["runtime_env"]
assert env["worker_process_setup_hook"] == gko.HOOK, env
assert env["env_vars"] == {"NCCL_DEBUG": "WARN", gko.BACKEND_ENV: "torch"}, env
print("switched on")

# the launcher: train_ppo_ray's own command line (here its --help), run as its __main__ with the library on
try:
    gko.main(["--help"])
except SystemExit as exit:
    assert exit.code == 0, exit.code
"""


def test_enable_makes_the_trainer_build_the_library_classes_in_a_fresh_process():
    """In a fresh interpreter: the worker hook (run as Ray runs it) makes OpenRLHF's trainer modules hold the
    library's Actor and PolicyLoss, with the backend from the job's environment; ``enable`` in the driver makes
    ``ray.init`` carry the hook and keeps the runtime env OpenRLHF passes; the launcher runs train_ppo_ray's command
    line. (A real Ray worker, and ``python -m``: test_openrlhf_distributed.py.)"""
    env = subprocess_env()
    env["GSPO_KERNELS_OPENRLHF_BACKEND"] = "torch"
    done = subprocess.run([sys.executable, "-c", _SWITCH_ON], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "switched on" in done.stdout, done.stderr[-3000:]
    assert "--actor.policy_loss_type" in done.stdout, done.stdout[-3000:]  # train_ppo_ray's own options


def test_untested_openrlhf_version_warns_once_naming_the_tested_one(orl, monkeypatch):
    gko, _ = orl
    assert gko.untested_version_warning(gko.TESTED_OPENRLHF) is None
    monkeypatch.setattr(gko.metadata, "version", lambda name: "0.12.0")
    monkeypatch.setattr(gko, "_WARNED", set())
    with pytest.warns(UserWarning, match=r"tested with openrlhf==0\.11\.2; openrlhf 0\.12\.0") as record:
        gko.PolicyLoss()
        gko._check_version()
    assert len([w for w in record if "tested with openrlhf" in str(w.message)]) == 1


def test_runtime_env_refuses_another_setup_hook(orl):
    gko, _ = orl
    assert gko.runtime_env({"worker_process_setup_hook": gko.HOOK})["worker_process_setup_hook"] == gko.HOOK
    with pytest.raises(ValueError, match="already has a worker_process_setup_hook"):
        gko.runtime_env({"worker_process_setup_hook": "my_project.setup"})
