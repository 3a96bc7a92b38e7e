"""The TRL drop-in in real ``train()`` runs under GRPOConfig's defaults (``bf16=True``) and in fp32.

The policy: a random 2-layer Qwen3 (hidden 128, vocabulary 2048 words of a ``tokenizers`` WordLevel
tokenizer) whose lm_head is rescaled so that its logits spread like a trained model's (std ~4 across
the vocabulary), not the near-zero logits of a fresh initialization, which would hide any precision gap.
GSPO settings: ``importance_sampling_level="sequence"``, ``epsilon=3e-4``, ``epsilon_high=4e-4``,
``steps_per_generation=4`` (TRL then computes ``old_per_token_logps`` itself), one mini-batch per
optimizer step, so log row ``k`` (1-based) is the first mini-batch of a generation when ``k % 4 == 1``.
"""

from __future__ import annotations

import math

import pytest
import torch
import trl
from datasets import Dataset

from gspo_kernels.integrations.trl import GRPOTrainer

VOCAB = 2048
HIDDEN = 128
SPECIAL = ("<pad>", "<eos>", "<bos>")
GSPO = dict(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4, steps_per_generation=4)


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = list(SPECIAL) + [f"w{i}" for i in range(VOCAB - len(SPECIAL))]
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    tok.padding_side = "left"
    return tok


def _reward(prompts, completions, **kwargs):
    """Share of completion words with an even index: varies within every group from the first rollout."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(int(w[1:]) % 2 == 0 for w in words if w.startswith("w")) / max(len(words), 1))
    return out


def _dataset(n: int = 16) -> Dataset:
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 3, (6,), generator=g)) for _ in range(n)]
    return Dataset.from_dict({"prompt": prompts})


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("trained_like_qwen3")
    tok = _tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, max_position_embeddings=64,
        tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    ))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 4.0 / math.sqrt(HIDDEN))  # the final RMSNorm output has ~unit entries
        ids = torch.randint(3, VOCAB, (4, 12))
        std = model(input_ids=ids).logits.std(-1).mean().item()
    assert 3.0 < std < 6.0, f"logits must spread like a trained model's (std of a few units), got {std:.2f}"
    model.config._name_or_path = str(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _trainer(cls, policy_dir, tmp_path, *, dtype=torch.float32, **overrides):
    from transformers import AutoModelForCausalLM

    kwargs = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4, max_completion_length=12,
        max_steps=8, learning_rate=3e-4, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_dropout=True, **GSPO,
    )
    kwargs.update(overrides)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=dtype)
    extra = {"gspo_backend": "cpu"} if cls is GRPOTrainer else {}
    return cls(model=model, reward_funcs=_reward, args=trl.GRPOConfig(**kwargs), train_dataset=_dataset(),
               processing_class=_tokenizer(), **extra)


def _rows(trainer):
    return [row for row in trainer.state.log_history if "loss" in row]


@pytest.mark.parametrize("policy_dtype", [torch.float32, torch.bfloat16], ids=["fp32-policy", "bf16-policy"])
def test_bf16_default_first_minibatch_is_on_policy(policy_dir, tmp_path, policy_dtype):
    """GRPOConfig's default bf16=True (autocast): the first mini-batch of every generation has weights 1."""
    trainer = _trainer(GRPOTrainer, policy_dir, tmp_path, dtype=policy_dtype)
    assert trainer.args.bf16, "GRPOConfig must default to bf16=True"
    trainer.train()
    rows = _rows(trainer)
    assert len(rows) == 8
    firsts = rows[0::4]
    assert len(firsts) == 2
    for row in firsts:
        assert row["clip_ratio/region_mean"] == 0.0, row
        assert abs(row["importance_weight/min"] - 1.0) <= 1e-6, row
        assert abs(row["importance_weight/max"] - 1.0) <= 1e-6, row
    # the later mini-batches are off-policy: the check above is not vacuous (the policy does move)
    later = [row for k, row in enumerate(rows) if k % 4 != 0]
    assert max(max(abs(r["importance_weight/min"] - 1), abs(r["importance_weight/max"] - 1)) for r in later) > 1e-4


def test_fp32_twenty_steps_match_trl(policy_dir, tmp_path):
    """fp32 (bf16=False): 20 steps of ours and stock TRL from the same weights and seed, step by step.

    Tolerances: loss within 1e-6 absolute over the first generation (the losses are O(0.1 - 1); the two heads
    differ only in summation order, ~1e-7 per token), then ``1e-6 sqrt(step / 4)``: from the second update on,
    the two runs' weights differ by rounding, and those independent per-step differences (2e-7 to 5e-7 in the
    loss at one step, measured) add up like a random walk (measured here with torch 2.13 / TRL 1.16: 1.01e-6 at
    step 19, where a fixed 1e-6 fails by chance); grad_norm within 1e-4 and entropy within 1e-5 relative (after a
    dozen updates the weights differ by fp32 rounding: entropy 2.8478467 vs 2.8478453 at step 13); clip
    ratios and rewards equal to 1e-6 (a clip decision that flipped, or a sampled token that changed,
    would show up as >= 1/16).
    """
    runs = {}
    for cls in (trl.GRPOTrainer, GRPOTrainer):
        trainer = _trainer(cls, policy_dir, tmp_path / cls.__module__, bf16=False, max_steps=20)
        trainer.train()
        runs[cls] = _rows(trainer)
    theirs, ours = runs[trl.GRPOTrainer], runs[GRPOTrainer]
    assert len(theirs) == len(ours) == 20
    clipped = 0
    for step, (t, o) in enumerate(zip(theirs, ours), start=1):
        drift = 1e-6 * max(1.0, math.sqrt(step / 4))
        assert o["loss"] == pytest.approx(t["loss"], abs=drift), f"step {step}: {o['loss']} vs {t['loss']}"
        assert o["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-4), f"step {step}"
        assert ("reward" in o) == ("reward" in t) == (step % 4 == 1)  # logged once per generation
        if "reward" in t:
            assert o["reward"] == pytest.approx(t["reward"], abs=1e-6), f"step {step}"
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                    "clip_ratio/high_max"):
            assert o[key] == pytest.approx(t[key], abs=1e-6), f"step {step}: {key}"
        assert o["entropy"] == pytest.approx(t["entropy"], rel=1e-5), f"step {step}"
        clipped += t["clip_ratio/region_mean"] > 0
    assert clipped >= 3, "some steps must clip, or the clip comparison is vacuous"


def test_bf16_loss_against_trl_within_measured_bound(policy_dir, tmp_path):
    """bf16 autocast: our head keeps fp32 logits of bf16 operands; TRL rounds its logits to bf16.

    Bound on the log-probs: a logit z rounded to bf16 moves by at most 2^-9 |z| (8 significant bits), so
    a log-prob ``z_y - logsumexp(z)`` moves by at most ``2^-8 max|z|``; the measured per-token gap must
    lie within it (measured: 2.8e-2 against a bound of 7.5e-2, logits up to 19).
    Bound on the loss (token level, ``grpo``): each token's term ``-min(w A, clip(w) A)`` is 1-Lipschitz
    in ``w`` times ``|A|``, and ``|w_ours - w_trl| = w_trl |e^gap_t - 1|``, so the loss moves by at most
    the per-sequence mean of ``|A| w_trl |e^gap_t - 1|`` averaged over sequences, computed from the
    measured gaps (measured: loss 0.04428 vs 0.04275, a difference of 1.6e-3 against a bound of 7.3e-3).
    """
    config = dict(importance_sampling_level="token", loss_type="grpo", epsilon=0.2, epsilon_high=0.28, bf16=True)
    theirs = _trainer(trl.GRPOTrainer, policy_dir, tmp_path, **config)
    ours = _trainer(GRPOTrainer, policy_dir, tmp_path, **config)
    g = torch.Generator().manual_seed(4)
    B, P, C = 8, 6, 12
    prompt_ids = torch.randint(3, VOCAB, (B, P), generator=g)
    completion_ids = torch.randint(3, VOCAB, (B, C), generator=g)
    lengths = torch.tensor([C, 3, 7, C, 1, C, 9, 5])
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), completion_mask], 1)
    with torch.no_grad():
        logp_t, _, _ = theirs._get_per_token_logps_and_entropies(theirs.model, ids, attn, C)
        logp_o, _, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, attn, C)
        logits = theirs.model(input_ids=ids, attention_mask=attn).logits[:, -C - 1:-1]
    m = completion_mask.bool()
    gap = (logp_o - logp_t)[m].abs().max().item()
    bound = 2.0 ** -8 * logits.abs().max().item()
    assert 0 < gap <= bound, (gap, bound)
    advantages = torch.tensor([1.0, -0.7, 0.4, -1.2, 0.9, -0.3, 0.6, -1.0])
    old = (logp_t + 0.05 * torch.randn(B, C, generator=g)) * completion_mask
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones(B, P, dtype=torch.long), completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=advantages, old_per_token_logps=old,
                  num_items_in_batch=completion_mask.sum().float())
    losses = {}
    for trainer in (theirs, ours):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        with torch.no_grad():
            losses[trainer] = trainer._compute_loss(trainer.model, dict(inputs)).item()
    w_t = torch.exp(logp_t - old)
    per_token = advantages[:, None].abs() * w_t * torch.expm1((logp_o - logp_t).abs()) * completion_mask
    tolerance = (per_token.sum(-1) / completion_mask.sum(-1)).mean().item()
    diff = abs(losses[ours] - losses[theirs])
    assert diff <= tolerance, (losses, diff, tolerance)
    assert diff > 1e-5, "the two heads do differ in bf16: a zero difference would mean the test compares one path"
