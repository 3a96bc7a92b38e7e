"""TRL 1.16 parity for every loss type, vLLM importance sampling, adaptive entropy and soft-capped logits.

Stock ``trl.GRPOTrainer._compute_loss`` and the drop-in's on the same hand-made batch (``_inputs`` of
``test_trl_integration``: left-padded prompts, ragged completions, old log-probs spread around the clip band),
fp32 model: the loss and every parameter's gradient within ``FP32_RTOL`` (1e-5) relative
(:func:`gspo_kernels.testing.rel_err`: the largest difference over the largest entry), and TRL's metrics.

Cases: each of TRL's eight loss types at each importance level TRL accepts for it (``token`` and
``sequence``; TRL warns for luspo at ``token`` and vespo at ``sequence``, and runs them), with the KL term,
``delta``, the objectives' own options, entropy masking and the off-policy mask mixed in; the four vLLM
importance-sampling modes (the drop-in gets the engine's log-probs, never TRL's ratio, so the library computes
the weights; VESPO folds them); adaptive entropy control over three accumulation windows; a tiny Gemma-2 with
``final_logit_softcapping``, alone and with a logit scale, and a short ``train()`` of it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import trl

from gspo_kernels.integrations.trl import GRPOTrainer
from gspo_kernels.testing import FP32_RTOL, rel_err
from gspo_kernels.train.tasks import hf_tokenizer, trl_reward_function
from tests.integrations.test_trl_integration import TASK, _config, _dataset, _inputs, policy_dir  # noqa: F401 (a fixture)
from tests.support import device_for

BANDS = {"token": (0.2, 0.28), "sequence": (3e-4, 4e-4)}


def _pair(path, tmp_path, backend="torch", drop_in=None, **config):
    from transformers import AutoModelForCausalLM

    # both trainers on the backend's device: the Triton backend gets CUDA tensors where CUDA exists
    config.setdefault("use_cpu", device_for(backend) == "cpu")

    def build(cls, **extra):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return cls(model=model, reward_funcs=trl_reward_function(TASK), args=_config(tmp_path, **config),
                   train_dataset=_dataset(), processing_class=hf_tokenizer(), **extra)

    return build(trl.GRPOTrainer), build(GRPOTrainer, gspo_backend=backend, **(drop_in or {}))


def _step(trainer, inputs, accumulation=2):
    """One ``_compute_loss`` + backward in train mode; the loss and every parameter's gradient."""
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = accumulation  # set by Trainer.train(); both scale by it
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, copy.deepcopy(inputs))
    loss.backward()
    grads = {name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for name, p in model.named_parameters()}
    return loss.detach(), grads


def _assert_same(ours, theirs):
    """Loss and every gradient within FP32_RTOL relative; most parameters get a gradient."""
    (loss_o, grads_o), (loss_t, grads_t) = ours, theirs
    assert float(loss_t.abs()) > 1e-6, "a zero loss would make the comparison vacuous"
    assert rel_err(loss_o, loss_t) <= FP32_RTOL, (float(loss_o), float(loss_t))
    nonzero = 0
    for name, g_t in grads_t.items():
        assert rel_err(grads_o[name], g_t) <= FP32_RTOL, (name, rel_err(grads_o[name], g_t))
        nonzero += int(g_t.abs().max() > 1e-6)
    assert nonzero >= len(grads_t) // 2, "most parameters must receive a gradient"


METRICS = ("entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
           "clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio", "vespo/phi_seq_mean", "policy_loss",
           "entropy_coef")


def _assert_metrics_match(ours, theirs, mode="train"):
    """Every metric of this list that TRL logged, the drop-in logged too, and with the same value."""
    logged = [name for name in METRICS if theirs._metrics[mode].get(name)]
    assert "entropy" in logged
    for name in logged:
        assert ours._metrics[mode][name] == pytest.approx(theirs._metrics[mode][name], rel=1e-5, abs=1e-6), name
    return logged


# (loss_type, level, options): every loss type at both levels; options to cover the objectives' parameters,
# the KL term (with and without the bias correction), delta, entropy masking and the off-policy mask
CASES = [
    ("grpo", "token", dict(beta=0.05)),
    ("grpo", "sequence", dict(delta=1.0005)),
    ("dapo", "token", dict(delta=1.3)),
    ("dapo", "sequence", dict(beta=0.05, use_bias_correction_kl=True)),
    ("dr_grpo", "token", {}),
    ("dr_grpo", "sequence", dict(beta=0.05)),
    ("bnpo", "token", dict(beta=0.05, use_bias_correction_kl=True)),
    ("bnpo", "sequence", {}),
    ("cispo", "token", dict(epsilon_high=1.2, beta=0.05)),
    ("cispo", "sequence", dict(epsilon_high=1.0002)),
    ("sapo", "token", dict(beta=0.05)),
    ("sapo", "sequence", dict(sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)),
    ("luspo", "token", dict(beta=0.05)),
    ("luspo", "sequence", {}),
    ("vespo", "token", dict(beta=0.05, use_bias_correction_kl=True)),
    ("vespo", "sequence", dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5)),
    # masks: TRL multiplies the policy term by them (and the entropy bonus by the entropy mask only)
    ("sapo", "token", dict(top_entropy_quantile=0.5, entropy_coef=0.02)),
    ("vespo", "token", dict(off_policy_mask_threshold=0.1)),
    ("cispo", "sequence", dict(epsilon_high=1.0002, off_policy_mask_threshold=2e-4, top_entropy_quantile=0.6,
                               entropy_coef=0.01)),
    ("luspo", "sequence", dict(off_policy_mask_threshold=2e-4, beta=0.05)),
]
MASKS = ("top_entropy_quantile", "off_policy_mask_threshold")


@pytest.mark.parametrize("loss_type, level, options", CASES,
                         ids=[f"{t}-{lv}-{'-'.join(o) or 'plain'}" for t, lv, o in CASES])
def test_every_loss_type_matches_trl(policy_dir, tmp_path, loss_type, level, options):  # noqa: F811
    epsilon, epsilon_high = BANDS[level]
    config = dict(loss_type=loss_type, importance_sampling_level=level, epsilon=epsilon, epsilon_high=epsilon_high,
                  temperature=0.9)
    config.update(options)
    theirs, ours = _pair(policy_dir, tmp_path, **config)
    inputs = _inputs(theirs.model, torch.Generator().manual_seed(3), with_old=True, beta=config.get("beta", 0.0),
                     temperature=0.9, band=epsilon)
    want = _step(theirs, inputs)
    _assert_same(_step(ours, inputs), want)
    logged = _assert_metrics_match(ours, theirs)

    metrics = theirs._metrics["train"]
    if loss_type in ("grpo", "dapo", "dr_grpo", "bnpo", "luspo"):
        assert 0 < metrics["clip_ratio/region_mean"][-1] < 1, "some responses (tokens) in the band, some out"
    elif loss_type == "cispo":
        assert 0 < metrics["cispo_clip_ratio"][-1] < 1, "some weights above the cap, some below"
    elif loss_type == "vespo":
        assert "vespo/phi_seq_mean" in logged
    if config.get("beta"):
        assert "kl" in logged
    for name in MASKS:  # the mask changes TRL's loss here (else the case could not tell a masked loss apart)
        if name in options:
            setattr(theirs, name, 1.0 if name == "top_entropy_quantile" else None)
            assert rel_err(_step(theirs, inputs)[0], want[0]) > 1e-4, name
            setattr(theirs, name, options[name])


# (backend, loss_type, level, options, gspo_one_pass, whether the loss runs inside the forward)
ROUTES = [
    ("triton", "grpo", "sequence", dict(beta=0.05), True, True),
    ("triton", "dapo", "token", dict(off_policy_mask_threshold=0.1), True, True),
    ("cpu", "luspo", "sequence", {}, True, True),
    ("cpu", "sapo", "token", dict(top_entropy_quantile=0.5), True, False),
    ("cpu", "grpo", "token", dict(entropy_coef=0.01), True, False),
    ("triton", "grpo", "sequence", dict(beta=0.05), False, False),
]


@pytest.mark.parametrize("backend, loss_type, level, options, one_pass, inside", ROUTES,
                         ids=[f"{r[0]}-{r[1]}-{r[2]}-{'-'.join(r[3]) or 'plain'}-{'one-pass' if r[4] else 'default'}"
                              for r in ROUTES])
def test_the_loss_runs_inside_the_forward_when_asked_unless_it_needs_the_entropies_first(
        policy_dir, tmp_path, monkeypatch, backend, loss_type, level, options, one_pass, inside):  # noqa: F811
    """With ``gspo_one_pass=True`` the drop-in computes the loss inside the model's forward with
    ``fused_linear_gspo_loss`` (on the Triton backend the one-pass loss, its gradient formed in the forward), except
    under TRL's top-entropy mask or entropy bonus, which need the entropies before the loss; by default it takes the
    log-probs route. Either way the loss, every gradient and the metrics are stock TRL's."""
    import gspo_kernels.integrations.trl as drop_in

    calls = []

    def spy(real, name):  # records (head function, gradient enabled) and calls it
        def call(*args, **kwargs):
            calls.append((name, torch.is_grad_enabled()))
            return real(*args, **kwargs)
        return call

    for name in ("fused_linear_gspo_loss", "linear_logprobs"):
        monkeypatch.setattr(drop_in, name, spy(getattr(drop_in, name), name))
    epsilon, epsilon_high = BANDS[level]
    config = dict(loss_type=loss_type, importance_sampling_level=level, epsilon=epsilon, epsilon_high=epsilon_high,
                  temperature=0.9, **options)
    theirs, ours = _pair(policy_dir, tmp_path, backend=backend, drop_in=dict(gspo_one_pass=one_pass), **config)
    inputs = _inputs(theirs.model, torch.Generator().manual_seed(6), with_old=True, beta=config.get("beta", 0.0),
                     temperature=0.9, band=epsilon)
    want = _step(theirs, inputs)
    calls.clear()
    _assert_same(_step(ours, inputs), want)
    _assert_metrics_match(ours, theirs)
    assert calls == ([("fused_linear_gspo_loss", True)] if inside else [("linear_logprobs", True)])


def _trl_importance_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's vLLM importance-sampling ratio (``_generate_and_score_completions``), written out for the test."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


# (loss_type, level, vllm mode, C_min, C_max, options)
VLLM_CASES = [
    ("dapo", "token", "token_truncate", 0.5, 3.0, dict(nan=True)),
    ("grpo", "sequence", "token_mask", 0.5, 3.0, {}),
    ("bnpo", "token", "token_mask", 0.5, None, dict(beta=0.05)),
    ("cispo", "token", "sequence_truncate", 0.5, 3.0, dict(epsilon_high=1.2)),
    ("sapo", "token", "sequence_mask", None, 3.0, {}),  # TRL's default mode and C_max
    ("luspo", "sequence", "sequence_mask", 0.5, 3.0, {}),
    ("vespo", "token", "token_truncate", None, 3.0, dict(nan=True)),
    ("vespo", "token", "token_mask", 0.5, 3.0, {}),
    ("grpo", "sequence", "sequence_truncate", 0.5, 3.0, dict(off_policy_mask_threshold=0.5)),
]


@pytest.mark.parametrize("loss_type, level, mode, clip_min, clip_max, options", VLLM_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in VLLM_CASES])
def test_vllm_importance_sampling_computed_by_the_library_matches_trl(policy_dir, tmp_path, loss_type, level,  # noqa: F811
                                                                        mode, clip_min, clip_max, options):
    options = dict(options)
    nan = options.pop("nan", False)
    epsilon, epsilon_high = BANDS[level]
    config = dict(loss_type=loss_type, importance_sampling_level=level, epsilon=epsilon, epsilon_high=epsilon_high,
                  vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                  vllm_importance_sampling_clip_max=clip_max)
    config.update(options)
    theirs, ours = _pair(policy_dir, tmp_path, **config)
    for trainer in (theirs, ours):  # as if generation ran in vLLM (TRL reads only these two flags in the loss)
        trainer.use_vllm = True
        trainer.vllm_importance_sampling_correction = True
    ours._check_supported()
    gen = torch.Generator().manual_seed(11)
    inputs = _inputs(theirs.model, gen, with_old=True, beta=config.get("beta", 0.0), band=epsilon)
    old, mask = inputs["old_per_token_logps"], inputs["completion_mask"]
    # the engine's log-probs: old - diff, with token (and sequence) ratios above C_max = 3 and below C_min = 0.5,
    # garbage in the padding, and (nan=True) one token the engine could not score
    diff = 0.05 * torch.randn(old.shape, generator=gen)
    diff[0, 0], diff[1, 0] = 1.5, -0.9
    sampling = torch.where(mask > 0, old - diff, torch.full_like(old, 5.0))
    if nan:
        sampling[2, 1] = float("nan")
    inputs["sampling_per_token_logps"] = sampling
    ratio = _trl_importance_ratio(old, sampling, mask, mode, clip_min, clip_max)
    assert (ratio == (0.0 if mode.endswith("mask") else clip_max or 0.5)).any(), "the cap must act on some weight"
    want = _step(theirs, {**inputs, "importance_sampling_ratio": ratio})
    _assert_same(_step(ours, inputs), want)  # ours gets no ratio: the library computes it
    _assert_metrics_match(ours, theirs)
    # without the correction TRL's loss is another one (the weights matter on these inputs)
    theirs.vllm_importance_sampling_correction = False
    assert rel_err(_step(theirs, inputs)[0], want[0]) > 1e-4


@pytest.mark.parametrize("loss_type, level, quantile", [("dapo", "token", 1.0), ("sapo", "sequence", 0.5)])
def test_adaptive_entropy_control_matches_trl(policy_dir, tmp_path, loss_type, level, quantile):  # noqa: F811
    """Three accumulation windows of two micro-batches: the coefficient rises (capped at its max) while the entropy
    is below the target, falls (floored at its min) once the target is lowered; the bonus is gated by the previous
    window's entropy. Loss, gradients, the coefficient and the logged metrics match TRL's at every micro-batch."""
    epsilon, epsilon_high = BANDS[level]
    config = dict(loss_type=loss_type, importance_sampling_level=level, epsilon=epsilon, epsilon_high=epsilon_high,
                  use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.05, entropy_coef_max=0.08,
                  entropy_coef_min=0.05, entropy_target=10.0, top_entropy_quantile=quantile,
                  gradient_accumulation_steps=2)
    theirs, ours = _pair(policy_dir, tmp_path, **config)
    state = theirs.accelerator.gradient_state  # one state shared by every Accelerator of the process
    coefs = []
    try:
        for window in range(3):
            if window == 2:
                for trainer in (theirs, ours):
                    trainer.args.entropy_target = 0.1  # below the entropy (~2.9 nats): the coefficient falls
            for micro in range(2):
                state._set_sync_gradients(micro == 1)
                inputs = _inputs(theirs.model, torch.Generator().manual_seed(20 + 2 * window + micro), with_old=True,
                                 beta=0.0, band=epsilon)
                want = _step(theirs, inputs)
                _assert_same(_step(ours, inputs), want)
            assert ours.entropy_coef == pytest.approx(theirs.entropy_coef, abs=1e-12)
            assert ours._last_world_entropy == pytest.approx(theirs._last_world_entropy, rel=1e-6)
            coefs.append(theirs.entropy_coef)
    finally:
        state._set_sync_gradients(True)
    assert coefs == pytest.approx([0.06, 0.08, 0.05])  # +delta, +delta capped at max, -delta floored at min
    logged = _assert_metrics_match(ours, theirs)
    assert {"policy_loss", "entropy_coef"} <= set(logged)
    assert len(ours._metrics["train"]["entropy_coef"]) == 3


# ----------------------------------------------------------------------------- soft-capped logits (Gemma 2)

SOFTCAP = 4.0


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    """A tiny Gemma-2 (2 layers, hidden 32) with final_logit_softcapping=4 and an lm_head whose logits spread
    to several units, so that the cap bends them."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    path = tmp_path_factory.mktemp("tiny_gemma2")
    tok = hf_tokenizer()
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, final_logit_softcapping=SOFTCAP,
        tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, attn_implementation="eager",
    ))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)
    model.config._name_or_path = str(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_the_soft_cap_bends_these_logits(gemma2_dir):
    """Non-vacuity of the soft-cap cases: the model's capped log-probs are far from the uncapped ones."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma2_dir, dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        capped = model(input_ids=ids).logits
        raw = model.lm_head(model.model(input_ids=ids).last_hidden_state)
    torch.testing.assert_close(capped, SOFTCAP * torch.tanh(raw / SOFTCAP))
    assert raw.abs().max() > 2 * SOFTCAP
    assert (capped.log_softmax(-1) - raw.log_softmax(-1)).abs().max() > 1.0


@pytest.mark.parametrize("loss_type, level, backend, extra", [
    ("grpo", "sequence", "torch", dict(beta=0.05)),
    ("sapo", "token", "triton", dict(temperature=0.9)),
    ("vespo", "token", "cpu", {}),
    ("dapo", "token", "cpu", dict(temperature=0.9, logit_scale=0.5)),
])
def test_final_logit_softcapping_matches_trl(gemma2_dir, tmp_path, loss_type, level, backend, extra):
    """The cap runs in the drop-in's fused head (forward and backward): old-log-probs pass, loss and gradients as
    stock TRL's. ``logit_scale``: TRL scales the logits before the cap (no Gemma has both; set on the config)."""
    extra = dict(extra)
    scale = extra.pop("logit_scale", None)
    if scale is not None:
        import shutil

        from transformers import AutoConfig

        path = tmp_path / "scaled"
        shutil.copytree(gemma2_dir, path)
        cfg = AutoConfig.from_pretrained(path)
        cfg.logit_scale = scale
        cfg.save_pretrained(path)
    else:
        path = gemma2_dir
    epsilon, epsilon_high = BANDS[level]
    theirs, ours = _pair(path, tmp_path, backend=backend, loss_type=loss_type, importance_sampling_level=level,
                         epsilon=epsilon, epsilon_high=epsilon_high, **extra)
    temperature = extra.get("temperature", 1.0)
    inputs = _inputs(theirs.model, torch.Generator().manual_seed(4), with_old=True, beta=extra.get("beta", 0.0),
                     temperature=temperature, band=epsilon)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    C = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        old_t, _, _ = theirs._get_per_token_logps_and_entropies(theirs.model, ids, attn, C)
        old_o, _, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, attn, C)
    assert rel_err(old_o, old_t) <= FP32_RTOL
    _assert_same(_step(ours, inputs), _step(theirs, inputs))
    _assert_metrics_match(ours, theirs)


def test_softcapped_model_trains_like_stock_trl(gemma2_dir, tmp_path):
    """Two optimizer steps of ``train()`` (generation, rewards, old log-probs, loss, adaptive entropy) on the
    soft-capped Gemma-2: the logged loss, grad_norm, entropy and entropy_coef equal stock TRL's step by step."""
    from transformers import AutoModelForCausalLM

    config = dict(loss_type="sapo", importance_sampling_level="token", steps_per_generation=2, max_steps=2,
                  use_adaptive_entropy=True, entropy_coef=0.02, entropy_target=10.0)
    logs = []
    for cls, extra in ((trl.GRPOTrainer, {}), (GRPOTrainer, {"gspo_backend": "cpu"})):
        model = AutoModelForCausalLM.from_pretrained(gemma2_dir, dtype=torch.float32)
        trainer = cls(model=model, reward_funcs=trl_reward_function(TASK), args=_config(tmp_path, **config),
                      train_dataset=_dataset(), processing_class=hf_tokenizer(), **extra)
        trainer.train()
        logs.append([row for row in trainer.state.log_history if "loss" in row])
    theirs, ours = logs
    assert len(theirs) == len(ours) == 2
    for t, o in zip(theirs, ours):
        assert o["loss"] == pytest.approx(t["loss"], rel=1e-5, abs=1e-7)
        assert o["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-4)
        assert o["grad_norm"] > 0
        for key in ("entropy", "entropy_coef", "policy_loss", "reward"):
            if key in t or key in o:  # reward: on the rows of a generation step only
                assert o[key] == pytest.approx(t[key], rel=1e-5, abs=1e-7), key
    assert theirs[1]["entropy_coef"] > theirs[0]["entropy_coef"]  # the controller moved
