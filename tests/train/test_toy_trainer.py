"""The toy trainer: toy tasks, rollouts, and reference-loss vs fused-loss parity.

Parity tolerance (fp32 policy): with the same seed, the first rollout is bit-identical; old log-probs
agree to 2e-6 (float64 oracle vs fp32 fused; observed <= 5e-7); after 3 AdamW steps (lr 1e-3, the
2nd and 3rd off-policy, with clipping) every parameter agrees to 5e-6 absolute (observed <= 1.1e-6:
Adam divides each gradient by its own magnitude, so fp32 rounding in near-zero gradients shows up at
~1e-3 of the step size) while the parameters moved by >= 1e-3 (observed 2.7e-3 to 3e-3).
"""

import functools
import json
import math

import pytest
import torch

from gspo_kernels import available_backends
from gspo_kernels.train.tasks import TASKS, ToyTokenizer, get_task, hf_tokenizer
from gspo_kernels.train.toy_trainer import (
    TrainConfig,
    _reward_summary,
    add_arguments,
    build_policy,
    completion_mask_of,
    describe_reward_change,
    routing_change,
    run,
    train,
)

FUSED = [name for name in ("torch", "cpu") if name in available_backends("cpu")]


def test_task_rewards_and_tokenizers():
    tok = ToyTokenizer()
    hf = hf_tokenizer()
    assert len(hf) == len(tok)
    gen = torch.Generator().manual_seed(0)
    for task in TASKS.values():
        for digits in task.sample(5, gen):
            prompt = task.prompt_text(digits)
            assert hf(prompt).input_ids == tok.encode(prompt)
            target = task.target_ids(digits, tok)
            assert len(target) <= task.max_new_tokens
            assert task.reward(digits, target + [tok.pad_token_id], tok) == 1.0
            assert task.reward(digits, [], tok) == 0.0
            words = tok.decode(target[:-1])
            assert task.reward_text(prompt, words) == 1.0
    # hand-checked cases: reverse of 3 1 4 is 4 1 3; sort; sum with a carry
    assert get_task("reverse").reward([3, 1, 4], tok.encode("4 1 3 <eos>"), tok) == 1.0
    assert get_task("reverse").reward([3, 1, 4], tok.encode("4 9 3 <eos>"), tok) == 0.75
    assert get_task("sort").reward([3, 1, 4, 1], tok.encode("1 1 3 4 <eos>"), tok) == 1.0
    assert get_task("sum").reward([7, 8], tok.encode("1 5 <eos>"), tok) == 1.0
    assert get_task("sum").reward_text("sum 7 8 =", "1 5 0") == pytest.approx(2 / 3)


def test_completion_mask_stops_after_first_eos():
    eos = 1
    ids = torch.tensor([[5, 1, 1, 0], [1, 5, 5, 5], [5, 5, 5, 5]])
    want = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    assert torch.equal(completion_mask_of(ids, eos), want)


def test_routing_change_counts_changed_expert_sets():
    P = 2  # prompt length; completion tokens are predicted at positions P-1 .. L-2
    old = [torch.tensor([[[0, 1], [2, 3], [0, 3], [1, 2]]])]  # [S=1, L=4, k=2]
    new = [torch.tensor([[[0, 1], [2, 3], [0, 2], [1, 2]]])]
    mask = torch.tensor([[1.0, 1.0]])  # completion positions 1 and 2
    assert float(routing_change(old, new, mask, P)) == pytest.approx(0.5)


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def _parity_run(policy: str, loss: str):
    """One 1-step run (6 prompts x 4 samples, 3 mini-batches = 3 AdamW steps), cached across backends."""
    return train(TrainConfig(task="reverse", policy=policy, loss=loss, steps=1, prompts_per_step=6, group_size=4,
                             num_minibatches=3, lr=1e-3, hidden_size=32, seed=1, max_grad_norm=None))


@pytest.mark.parametrize("policy", ["dense", "moe"])
@pytest.mark.parametrize("backend", FUSED)
def test_reference_and_fused_loss_train_alike(policy, backend):
    ref = _parity_run(policy, "reference")
    fused = _parity_run(policy, backend)

    a, b = ref.first_rollout, fused.first_rollout
    for name in ("input_ids", "completion_ids", "completion_mask", "rewards", "advantages"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert float(a.rewards.std()) > 0, "the rollout must carry a learning signal"
    torch.testing.assert_close(b.old_logprobs, a.old_logprobs, rtol=0, atol=2e-6)

    initial = _params(build_policy(policy, ToyTokenizer(), hidden_size=32, seed=1))
    p_ref, p_fused = _params(ref.model), _params(fused.model)
    moved = max(float((p_ref[n] - initial[n]).abs().max()) for n in initial)
    assert moved > 1e-3, "3 AdamW steps at lr 1e-3 must move the parameters"
    for name in initial:
        torch.testing.assert_close(p_fused[name], p_ref[name], rtol=0, atol=5e-6, msg=lambda m, n=name: f"{n}: {m}")
    h_ref, h_fused = ref.history[0], fused.history[0]
    assert h_ref["clip_ratio/region_mean"] == pytest.approx(h_fused["clip_ratio/region_mean"], abs=1e-6)
    assert h_ref["loss"] == pytest.approx(h_fused["loss"], rel=1e-4, abs=1e-7)
    if policy == "moe":
        assert 0 < h_ref["routing_change"] <= 1  # after two updates some routed experts have changed


def test_beta_and_metrics_are_logged(tmp_path):
    log = tmp_path / "log.jsonl"
    cfg = TrainConfig(task="sum", policy="dense", loss=FUSED[0], steps=2, prompts_per_step=4, group_size=4,
                      hidden_size=32, beta=0.1, seed=3)
    result = train(cfg, log_path=log)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 2 and rows == json.loads(json.dumps(result.history))
    for key in ("reward_mean", "loss", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "importance_weight/mean", "importance_weight/min", "importance_weight/max", "entropy", "kl",
                "tokens_per_s"):
        assert key in rows[0] and math.isfinite(rows[0][key]), key
    assert rows[0]["importance_weight/min"] <= rows[0]["importance_weight/mean"] <= rows[0]["importance_weight/max"]
    assert rows[1]["kl"] > 0  # the policy has left the reference after the first step's updates


def test_cli_compare_writes_logs_and_chart(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--compare", "--steps", "2", "--task", "copy", "--prompts-per-step", "2",
                              "--group-size", "4", "--hidden-size", "32", "--loss", FUSED[0],
                              "--out", str(tmp_path)])
    assert run(args) == 0
    out = capsys.readouterr().out
    for algorithm in ("gspo", "grpo"):
        lines = (tmp_path / f"{algorithm}_copy_dense_seed0.jsonl").read_text().splitlines()
        assert len(lines) == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {"gspo/seed0", "grpo/seed0"}
    assert summary["gspo/seed0"]["window"] == 1  # 2 steps: step 0 against step 1, never a step with itself
    assert "gspo/seed0: mean reward first 1 steps" in out and "last 1 steps" in out
    try:
        import matplotlib  # noqa: F401

        assert (tmp_path / "compare.png").stat().st_size > 0
    except ImportError:
        assert "chart skipped" in out


def test_reward_summary_compares_windows_that_share_no_step():
    history = [{"reward_mean": float(step)} for step in range(10)]
    summary = _reward_summary(history)
    assert (summary["window"], summary["first"], summary["last"]) == (5, 2.0, 7.0)  # steps 0-4 against 5-9
    assert _reward_summary(history * 3)["window"] == 10
    assert "first 5 steps 2.000 -> last 5 steps 7.000 (+5.000, 10 steps)" in describe_reward_change(summary)
    short = _reward_summary(history[:1])
    assert (short["first"], short["last"], short["window"]) == (None, None, 0)
    assert "too short to compare" in describe_reward_change(short)


def test_every_train_option_has_help_text():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    missing = [a.option_strings for a in parser._actions if not (a.help or "").strip()]
    assert not missing, f"options without help text: {missing}"


def test_bad_options_raise():
    with pytest.raises(ValueError, match="loss must be one of"):
        train(TrainConfig(loss="fast"))
    with pytest.raises(ValueError, match="algorithm must be one of"):
        TrainConfig(algorithm="ppo").loss_config()
    with pytest.raises(ValueError, match="task must be one of"):
        get_task("chess")
