"""TRL parity: ``trl.GRPOTrainer._compute_loss`` and ours on the same ``inputs``, and a 2-step ``train()``.

Tolerance (fp32 model, fp32 loss): loss within ``rtol 1e-5 / atol 1e-7``; every parameter's gradient
within ``atol 1e-6 + rtol 1e-4`` of TRL's (the two differ only in summation order: TRL's chunked
log-softmax vs the library's tiles; observed max differences are ~1e-8).
"""

import copy

import pytest
import torch
import trl  # a test peer: `make test` installs it, and a missing peer fails this module (never skips)
from datasets import Dataset  # noqa: E402

from gspo_kernels.integrations.trl import GRPOTrainer  # noqa: E402
from gspo_kernels.train.tasks import get_task, hf_tokenizer, trl_reward_function  # noqa: E402
from tests.support import save_tiny_policy  # noqa: E402

TASK = get_task("reverse")


def _dataset(n: int = 8) -> Dataset:
    gen = torch.Generator().manual_seed(0)
    return Dataset.from_dict({"prompt": [TASK.prompt_text(d) for d in TASK.sample(n, gen)]})


def _config(tmp_path, **overrides) -> "trl.GRPOConfig":
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=TASK.max_new_tokens,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        disable_dropout=True,
        seed=0,
    )
    kwargs.update(overrides)
    return trl.GRPOConfig(**kwargs)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A tiny Qwen3 saved to disk: with beta > 0, TRL builds its reference model from the path."""
    return save_tiny_policy(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE saved to disk (8 experts, 2 routed per token)."""
    return save_tiny_policy(tmp_path_factory.mktemp("tiny_qwen3_moe"), "moe", tokenizer=False)


def _trainer(cls, policy_dir, tmp_path, **config):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    return cls(
        model=model,
        reward_funcs=trl_reward_function(TASK),
        args=_config(tmp_path, **config),
        train_dataset=_dataset(),
        processing_class=hf_tokenizer(),
        **({"gspo_backend": "torch"} if cls is GRPOTrainer else {}),
    )


def _inputs(model, gen: torch.Generator, *, with_old: bool, beta: float, temperature: float = 1.0, band: float = 3e-4):
    """A hand-made TRL batch: left-padded prompts, ragged completions, old/ref log-probs near the policy's.

    The old log-probs sit at per-sequence offsets spread around the clip band (``band`` = epsilon_low),
    so that some responses (tokens) are clipped low, some high, some not.
    """
    B, P, C = 6, 5, TASK.max_new_tokens
    V = model.config.vocab_size
    prompt_ids = torch.randint(3, V, (B, P), generator=gen)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    prompt_mask[3, :1] = 0
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    completion_ids = torch.randint(3, V, (B, C), generator=gen)
    lengths = torch.tensor([C, 1, 3, C, 2, C])
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    device = model.device  # the CPU (use_cpu=True), or CUDA for the Triton backend where CUDA exists
    with torch.no_grad():
        ids = torch.cat([prompt_ids, completion_ids], 1)
        logits = model(input_ids=ids.to(device), attention_mask=torch.cat([prompt_mask, completion_mask], 1).to(device))
        logits = logits.logits.cpu()
        logp = torch.log_softmax(logits[:, -C - 1 : -1].double() / temperature, -1).gather(-1, completion_ids[..., None])[..., 0]
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.7, 0.4, -1.2, 0.9, -0.3]),
        "num_items_in_batch": completion_mask.sum().float(),
    }
    if with_old:
        offset = band / 3e-4 * torch.tensor([6e-4, -5e-4, 1e-4, 8e-4, -2e-3, 0.0], dtype=torch.float64)[:, None]
        noise = band / 3e-4 * 3e-5 * torch.randn(B, C, generator=gen, dtype=torch.float64)
        inputs["old_per_token_logps"] = ((logp - offset + noise) * completion_mask).float()
    if beta > 0:
        inputs["ref_per_token_logps"] = ((logp + 0.2 * torch.randn(B, C, generator=gen, dtype=torch.float64))
                                         * completion_mask).float()
    return {key: value.to(device) for key, value in inputs.items()}


def _loss_and_grads(trainer, inputs):
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 2  # set by Trainer.train(); both scale the loss by it
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    grads = {name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for name, p in model.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize(
    "level, loss_type, beta, epsilon, epsilon_high",
    [
        ("sequence", "grpo", 0.0, 3e-4, 4e-4),
        ("sequence", "grpo", 0.05, 3e-4, 4e-4),
        ("token", "grpo", 0.0, 0.2, 0.28),
        ("token", "dapo", 0.05, 0.2, 0.28),
        ("sequence", "bnpo", 0.0, 3e-4, 4e-4),
    ],
)
def test_compute_loss_matches_trl(policy_dir, tmp_path, level, loss_type, beta, epsilon, epsilon_high):
    config = dict(importance_sampling_level=level, loss_type=loss_type, beta=beta, epsilon=epsilon,
                  epsilon_high=epsilon_high, temperature=0.9)
    theirs = _trainer(trl.GRPOTrainer, policy_dir, tmp_path, **config)
    ours = _trainer(GRPOTrainer, policy_dir, tmp_path, **config)
    # identical weights in both trainers (both loaded from the same folder)
    for (n1, p1), (n2, p2) in zip(theirs.model.named_parameters(), ours.model.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    gen = torch.Generator().manual_seed(3)
    inputs = _inputs(theirs.model, gen, with_old=True, beta=beta, temperature=0.9, band=epsilon)

    loss_t, grads_t = _loss_and_grads(theirs, copy.deepcopy(inputs))
    loss_o, grads_o = _loss_and_grads(ours, copy.deepcopy(inputs))

    torch.testing.assert_close(loss_o, loss_t, rtol=1e-5, atol=1e-7)
    assert float(loss_t.abs()) > 1e-6, "a zero loss would make the comparison vacuous"
    nonzero = 0
    for name, g_t in grads_t.items():
        torch.testing.assert_close(grads_o[name], g_t, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        nonzero += int(g_t.abs().max() > 1e-6)
    assert nonzero >= len(grads_t) // 2, "most parameters must receive a gradient"
    clipped = theirs._metrics["train"]["clip_ratio/region_mean"][-1]
    assert 0 < clipped < 1, "the inputs must put some responses (tokens) inside the band and some outside"
    _assert_metrics_match(ours, theirs, beta)


def _assert_metrics_match(ours, theirs, beta):
    for name in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 "clip_ratio/low_min", "clip_ratio/high_max"):
        assert ours._metrics["train"][name][-1] == pytest.approx(theirs._metrics["train"][name][-1], abs=1e-6), name
    if beta > 0:
        assert ours._metrics["train"]["kl"][-1] == pytest.approx(theirs._metrics["train"]["kl"][-1], rel=1e-5)


@pytest.mark.parametrize(
    "level, options",
    [
        ("sequence", dict(top_entropy_quantile=0.4)),
        ("token", dict(top_entropy_quantile=0.5, entropy_coef=0.02)),
        ("sequence", dict(off_policy_mask_threshold=2e-4)),
        ("token", dict(off_policy_mask_threshold=1e-4, top_entropy_quantile=0.6, beta=0.05)),
    ],
)
def test_entropy_and_off_policy_masks_match_trl(policy_dir, tmp_path, level, options):
    """Formerly refused: entropy masking (top_entropy_quantile < 1) and the off-policy sequence mask."""
    epsilon, epsilon_high = (0.2, 0.28) if level == "token" else (3e-4, 4e-4)
    config = dict(importance_sampling_level=level, loss_type="grpo", epsilon=epsilon, epsilon_high=epsilon_high,
                  **options)
    theirs = _trainer(trl.GRPOTrainer, policy_dir, tmp_path, **config)
    ours = _trainer(GRPOTrainer, policy_dir, tmp_path, **config)
    inputs = _inputs(theirs.model, torch.Generator().manual_seed(8), with_old=True, beta=options.get("beta", 0.0),
                     band=epsilon)
    if "off_policy_mask_threshold" in options:  # a sampling policy far enough off for some responses to be dropped
        inputs["old_per_token_logps"] = inputs["old_per_token_logps"] + 4e-4 * torch.tensor(
            [[1.0], [3.0], [-1.0], [2.0], [0.5], [1.5]]) * inputs["completion_mask"]
    loss_t, grads_t = _loss_and_grads(theirs, copy.deepcopy(inputs))
    loss_o, grads_o = _loss_and_grads(ours, copy.deepcopy(inputs))
    torch.testing.assert_close(loss_o, loss_t, rtol=1e-5, atol=1e-7)
    for name, g_t in grads_t.items():
        torch.testing.assert_close(grads_o[name], g_t, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    _assert_metrics_match(ours, theirs, options.get("beta", 0.0))
    # the masks must change the loss here (else this test could not tell a masked loss from an unmasked one)
    plain = _trainer(GRPOTrainer, policy_dir, tmp_path, importance_sampling_level=level, loss_type="grpo",
                     epsilon=epsilon, epsilon_high=epsilon_high, beta=options.get("beta", 0.0),
                     entropy_coef=options.get("entropy_coef", 0.0))
    loss_p, _ = _loss_and_grads(plain, copy.deepcopy(inputs))
    assert float((loss_p - loss_o).abs()) > 1e-5


@pytest.mark.parametrize(
    "level, loss_type, ratio_shape, extra",
    [
        ("token", "dapo", "token", dict(delta=1.5, entropy_coef=0.01, beta=0.05, use_bias_correction_kl=False)),
        ("sequence", "grpo", "sequence", dict(entropy_coef=0.02, beta=0.05, use_bias_correction_kl=True)),
    ],
)
def test_vllm_ratio_delta_entropy_bonus_match_trl(policy_dir, tmp_path, level, loss_type, ratio_shape, extra):
    """The vLLM importance-sampling ratio ([B, T] or [B, 1]), two-sided clipping and the entropy bonus."""
    epsilon, epsilon_high = (0.2, 0.28) if level == "token" else (3e-4, 4e-4)
    config = dict(importance_sampling_level=level, loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high,
                  **extra)
    theirs = _trainer(trl.GRPOTrainer, policy_dir, tmp_path, **config)
    ours = _trainer(GRPOTrainer, policy_dir, tmp_path, **config)
    for trainer in (theirs, ours):  # as if generation ran in vLLM (TRL reads only these two flags here)
        trainer.use_vllm = True
        trainer.vllm_importance_sampling_correction = True
    gen = torch.Generator().manual_seed(11)
    inputs = _inputs(theirs.model, gen, with_old=True, beta=extra["beta"], band=epsilon)
    B, C = inputs["completion_ids"].shape
    shape = (B, C) if ratio_shape == "token" else (B, 1)
    inputs["importance_sampling_ratio"] = 0.5 + torch.rand(shape, generator=gen)

    loss_t, grads_t = _loss_and_grads(theirs, copy.deepcopy(inputs))
    loss_o, grads_o = _loss_and_grads(ours, copy.deepcopy(inputs))
    torch.testing.assert_close(loss_o, loss_t, rtol=1e-5, atol=1e-7)
    for name, g_t in grads_t.items():
        torch.testing.assert_close(grads_o[name], g_t, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert ours._metrics["train"]["policy_loss"][-1] == pytest.approx(theirs._metrics["train"]["policy_loss"][-1],
                                                                      rel=1e-5, abs=1e-7)


def test_moe_router_aux_loss_matches_trl(moe_dir, tmp_path):
    """A Qwen3-MoE policy with TRL's router load-balancing loss added to the GSPO loss."""
    config = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4,
                  router_aux_loss_coef=0.05)
    theirs = _trainer(trl.GRPOTrainer, moe_dir, tmp_path, **config)
    ours = _trainer(GRPOTrainer, moe_dir, tmp_path, **config)
    assert theirs.aux_loss_enabled and ours.aux_loss_enabled
    inputs = _inputs(theirs.model, torch.Generator().manual_seed(2), with_old=True, beta=0.0)
    loss_t, grads_t = _loss_and_grads(theirs, copy.deepcopy(inputs))
    loss_o, grads_o = _loss_and_grads(ours, copy.deepcopy(inputs))
    torch.testing.assert_close(loss_o, loss_t, rtol=1e-5, atol=1e-7)
    router = [name for name in grads_t if "gate.weight" in name or "router" in name]
    assert router and any(float(grads_t[name].abs().max()) > 1e-6 for name in router)
    for name, g_t in grads_t.items():
        torch.testing.assert_close(grads_o[name], g_t, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert ours._metrics["train"]["aux_loss"][-1] == pytest.approx(theirs._metrics["train"]["aux_loss"][-1], rel=1e-5)


def test_on_policy_inputs_without_old_logps(policy_dir, tmp_path):
    """TRL omits ``old_per_token_logps`` when the batch is on-policy: the ratio is exactly 1."""
    theirs = _trainer(trl.GRPOTrainer, policy_dir, tmp_path, importance_sampling_level="sequence", loss_type="grpo")
    ours = _trainer(GRPOTrainer, policy_dir, tmp_path, importance_sampling_level="sequence", loss_type="grpo")
    inputs = _inputs(theirs.model, torch.Generator().manual_seed(5), with_old=False, beta=0.0)
    loss_t, grads_t = _loss_and_grads(theirs, copy.deepcopy(inputs))
    loss_o, grads_o = _loss_and_grads(ours, copy.deepcopy(inputs))
    torch.testing.assert_close(loss_o, loss_t, rtol=1e-5, atol=1e-7)
    for name, g_t in grads_t.items():
        torch.testing.assert_close(grads_o[name], g_t, rtol=1e-4, atol=1e-6)


def test_unsupported_options_raise_naming_them(policy_dir, tmp_path):
    """What the drop-in cannot run is refused when the trainer is built, naming the option: a loss type TRL 1.16
    does not have, and TRL's CISPO cap below 1 (its default epsilon_high=epsilon=0.2 caps every weight below the
    on-policy 1; the library asks for the cap explicitly)."""
    ours = _trainer(GRPOTrainer, policy_dir, tmp_path, loss_type="sapo")
    ours.loss_type = "gmpo"
    with pytest.raises(ValueError, match="loss_type='gmpo'.*supported: grpo, dapo, dr_grpo, bnpo, cispo, sapo"):
        ours._check_supported()
    with pytest.raises(ValueError, match="epsilon_high is CISPO's absolute cap"):
        _trainer(GRPOTrainer, policy_dir, tmp_path, loss_type="cispo")
    _trainer(GRPOTrainer, policy_dir, tmp_path, loss_type="cispo", epsilon_high=5.0)  # TRL's recommended cap
    # vLLM importance sampling (vLLM is not installed: the flags are set after construction, then checked again)
    ours = _trainer(GRPOTrainer, policy_dir, tmp_path, loss_type="vespo")
    ours.use_vllm = ours.vllm_importance_sampling_correction = True
    ours.vllm_importance_sampling_mode = "token_mask"
    ours._check_supported()
    ours.vllm_importance_sampling_clip_min = ours.vllm_importance_sampling_clip_max = None
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='token_mask' without"):
        ours._check_supported()
    ours.vllm_importance_sampling_mode, ours.vllm_importance_sampling_clip_max = "sequence_mask", 3.0
    with pytest.raises(ValueError, match="loss_type='vespo'.*rollout_correction must be 'token_truncate'"):
        ours._check_supported()
    ours.vllm_importance_sampling_mode = "sequence_tis"
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='sequence_tis' \\(supported"):
        ours._check_supported()


def test_two_step_train_end_to_end(policy_dir, tmp_path):
    """Our trainer runs TRL's whole loop (generation, rewards, reference model, logging) for 2 steps."""
    trainer = _trainer(GRPOTrainer, policy_dir, tmp_path, importance_sampling_level="sequence", loss_type="grpo",
                       beta=0.02, epsilon=3e-4, epsilon_high=4e-4, gradient_accumulation_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logs) == 2
    for row in logs:
        for key in ("reward", "entropy", "kl", "clip_ratio/region_mean"):
            assert key in row and row[key] == row[key]  # present and not NaN
    moved = sum(int(not torch.equal(before[n], p)) for n, p in trainer.model.named_parameters())
    assert moved > 0


def test_deepspeed_zero3_head_that_cannot_be_gathered_is_refused_naming_zero3(policy_dir, tmp_path):
    """A ZeRO-3 partitioned lm_head the library cannot gather (here: no process group) gets the library's error
    naming ZeRO-3 and what to do, never a shape error from a kernel. (Under a DeepSpeed engine the drop-in trains as
    stock TRL does: ``tests/distributed/test_trl_deepspeed.py``.)"""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    ours = _trainer(GRPOTrainer, policy_dir, tmp_path, importance_sampling_level="sequence", loss_type="grpo")
    inputs = _inputs(ours.model, torch.Generator().manual_seed(5), with_old=True, beta=0.0)
    weight = ours.model.lm_head.weight
    weight.ds_id, weight.ds_shape, weight.ds_status = 0, weight.shape, ZeroParamStatus.NOT_AVAILABLE
    weight.data = torch.empty(0)  # as ZeRO-3 leaves a parameter between its uses
    ours.current_gradient_accumulation_steps = 1
    with pytest.raises(RuntimeError, match=r"DeepSpeed ZeRO-3: the weight parameter is partitioned .* not initialized"):
        ours._compute_loss(ours.model, inputs)


def test_unknown_backend_raises(policy_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="gspo_backend must be one of"):
        GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(policy_dir), reward_funcs=trl_reward_function(TASK),
                    args=_config(tmp_path), train_dataset=_dataset(), processing_class=hf_tokenizer(),
                    gspo_backend="cuda")


@pytest.mark.parametrize("value", [1, "yes", None])
def test_gspo_one_pass_must_be_a_bool(policy_dir, tmp_path, value):
    from transformers import AutoModelForCausalLM

    with pytest.raises(TypeError, match="gspo_one_pass must be a bool"):
        GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(policy_dir), reward_funcs=trl_reward_function(TASK),
                    args=_config(tmp_path), train_dataset=_dataset(), processing_class=hf_tokenizer(),
                    gspo_one_pass=value)


@pytest.mark.parametrize("budget", [-1, 1.5, "1GiB"])
def test_bad_memory_budget_raises_naming_it(policy_dir, tmp_path, budget):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="gspo_memory_budget"):
        GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(policy_dir), reward_funcs=trl_reward_function(TASK),
                    args=_config(tmp_path), train_dataset=_dataset(), processing_class=hf_tokenizer(),
                    gspo_memory_budget=budget)


def test_memory_budget_reaches_the_head_and_keeps_the_bits(policy_dir, tmp_path, monkeypatch):
    """``gspo_memory_budget`` is the ``memory_budget`` of every head call (old log-probs and the loss; by default
    ``CPU_MEMORY_BUDGET`` on CPU tensors), and the old log-probs, the loss and every gradient are the same bits for
    any budget (cpu backend)."""
    from transformers import AutoModelForCausalLM

    import gspo_kernels.integrations.trl as drop_in

    seen = []

    def spy_on(name):  # the old log-probs go through linear_logprobs, the loss through fused_linear_gspo_loss
        real = getattr(drop_in, name)

        def spy(*args, **kwargs):
            seen.append(kwargs["memory_budget"])
            return real(*args, **kwargs)

        monkeypatch.setattr(drop_in, name, spy)

    spy_on("linear_logprobs")
    spy_on("fused_linear_gspo_loss")
    results = []
    for budget in ("default", None, 0, 1 << 20, 1 << 30):
        seen.clear()
        extra = {} if budget == "default" else {"gspo_memory_budget": budget}
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32),
                              reward_funcs=trl_reward_function(TASK), args=_config(tmp_path), train_dataset=_dataset(),
                              processing_class=hf_tokenizer(), gspo_backend="cpu", **extra)
        inputs = _inputs(trainer.model, torch.Generator().manual_seed(5), with_old=True, beta=0.0)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            old, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, inputs["completion_ids"].shape[1])
        loss, grads = _loss_and_grads(trainer, inputs)
        expected = drop_in.CPU_MEMORY_BUDGET if budget in ("default", None) else budget
        assert len(seen) == 2 and all(b == expected for b in seen), (budget, seen)
        results.append((old, loss, grads))
    old0, loss0, grads0 = results[0]
    for old, loss, grads in results[1:]:
        assert torch.equal(old, old0) and torch.equal(loss, loss0)
        assert all(torch.equal(grads[name], grads0[name]) for name in grads0)


def test_default_head_budget_on_the_cpu_and_on_cuda():
    """The drop-in's defaults: 256 MiB of saved logits on the CPU; on CUDA the library's default for the log-prob
    calls and 1 GiB of Triton chunk buffers for the one-pass loss (gspo_one_pass: in a trainer they sit beside the
    model's activations, not the library's free-memory sizing); a given budget is kept."""
    from gspo_kernels.integrations.trl import CPU_MEMORY_BUDGET, ONE_PASS_MEMORY_BUDGET, head_memory_budget

    assert CPU_MEMORY_BUDGET == 256 << 20 and ONE_PASS_MEMORY_BUDGET == 1 << 30
    assert head_memory_budget(None, torch.device("cpu")) == CPU_MEMORY_BUDGET
    assert head_memory_budget(None, torch.device("cpu"), one_pass=True) == CPU_MEMORY_BUDGET
    assert head_memory_budget(None, torch.device("cuda", 1)) is None
    assert head_memory_budget(None, torch.device("cuda", 1), one_pass=True) == ONE_PASS_MEMORY_BUDGET
    assert head_memory_budget(7, torch.device("cuda"), one_pass=True) == 7
    assert head_memory_budget(0, torch.device("cuda")) == 0 and head_memory_budget(5, torch.device("cpu")) == 5
