"""The TRL drop-in under ``GRPOConfig(torch_compile=True)`` trains as stock TRL with the same setting.

TRL hands ``torch_compile`` to accelerate, which wraps the policy in ``torch.compile`` (not ``fullgraph``); the
drop-in's head runs inside the policy's forward, so it is traced with it. Backend ``aot_eager`` (the cheapest that
still traces forward and backward through AOTAutograd) keeps the test short on a CPU.
"""

from __future__ import annotations

import pytest
import torch
import trl

import gspo_kernels.integrations.trl as trl_drop_in
from tests.integrations.test_trl_training import _rows, _trainer, policy_dir  # noqa: F401 (a fixture)

COMPILED = dict(bf16=False, max_steps=4, torch_compile=True, torch_compile_backend="aot_eager")


def test_compiled_drop_in_trains_as_compiled_trl(policy_dir, tmp_path, monkeypatch):  # noqa: F811
    """One generation (4 optimizer steps, fp32) of stock TRL and of the drop-in, both compiled, from the same
    weights and seed: the same logged values step by step and the same weights after.

    Tolerances as in ``test_trl_training.py``'s fp32 comparison (the two heads differ in summation order only):
    loss within 1e-6, grad_norm within 1e-4 and entropy within 1e-5 relative, rewards and clip shares within 1e-6
    (one flipped clip decision or sampled token moves them by >= 1/16). Weights: 4 Adam steps of lr 3e-4 from
    gradients equal to ~1e-6 relative move some weights by up to 7.5e-4 (measured, torch 2.13 / TRL 1.16); Adam
    normalizes each coordinate, so a coordinate whose gradient is near zero can take a visibly different step from a
    rounding-sized gradient difference: the largest difference measured was 3.8e-6 (mean 3e-10); bounds 5e-5 (1/15 of
    the largest move) and a mean of 1e-8.
    """
    traced = []
    library_head = trl_drop_in.linear_logprobs

    def spy(*args, **kwargs):  # records whether the head is being traced by Dynamo or runs eagerly
        traced.append((torch.is_grad_enabled(), torch.compiler.is_compiling()))
        return library_head(*args, **kwargs)

    monkeypatch.setattr(trl_drop_in, "linear_logprobs", spy)
    runs, weights = {}, {}
    for cls in (trl.GRPOTrainer, trl_drop_in.GRPOTrainer):
        torch._dynamo.reset()
        trainer = _trainer(cls, policy_dir, tmp_path / cls.__module__, **COMPILED)
        trainer.train()
        assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule), type(trainer.model_wrapped)
        runs[cls] = _rows(trainer)
        weights[cls] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    torch._dynamo.reset()
    # TRL calls the unwrapped policy for the old log-probs (no_grad, eager in both trainers); the loss steps call the
    # compiled one: the drop-in's head must be traced there
    loss_steps = [compiling for grad, compiling in traced if grad]
    assert len(loss_steps) >= 4 and all(loss_steps), f"(grad enabled, traced by Dynamo) per head call: {traced}"
    theirs, ours = runs[trl.GRPOTrainer], runs[trl_drop_in.GRPOTrainer]
    assert len(theirs) == len(ours) == 4
    clipped = 0
    for step, (t, o) in enumerate(zip(theirs, ours), start=1):
        assert o["loss"] == pytest.approx(t["loss"], abs=1e-6), f"step {step}: {o['loss']} vs {t['loss']}"
        assert o["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-4), f"step {step}"
        assert o["entropy"] == pytest.approx(t["entropy"], rel=1e-5), f"step {step}"
        if "reward" in t:
            assert o["reward"] == pytest.approx(t["reward"], abs=1e-6), f"step {step}"
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert o[key] == pytest.approx(t[key], abs=1e-6), f"step {step}: {key}"
        clipped += t["clip_ratio/region_mean"] > 0
    assert clipped >= 1, "some step must clip, or the clip comparison is vacuous"
    mine, stock = weights[trl_drop_in.GRPOTrainer], weights[trl.GRPOTrainer]
    assert mine.keys() == stock.keys()
    worst = max((mine[k] - stock[k]).abs().max().item() for k in stock)
    mean = sum((mine[k] - stock[k]).abs().sum().item() for k in stock) / sum(v.numel() for v in stock.values())
    moved = max((stock[k] - w).abs().max().item() for k, w in _initial_weights(policy_dir).items())
    assert worst <= 5e-5 and mean <= 1e-8, (worst, mean)
    assert moved > 3e-4, "training must move the weights, or the weight comparison is vacuous"


def _initial_weights(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
