"""The hidden-state functions with a DeepSpeed ZeRO-3 partitioned lm_head (``gspo_kernels.distributed.zero3``).

Multi-process tests (marker ``deepspeed``, ``make test-deepspeed``): two processes (``torchrun``, DeepSpeed's CPU
accelerator, gloo), each run under a time limit so that a rank that hangs in a collective fails the test. Every
case of ``zero3_cases.CASES`` (three backends, both routes, ranks whose rows are all masked, all clipped, at zero
advantage, or uneven in responses and chunks, and bf16 operands under autocast) is trained for a few steps with the
lm_head partitioned between calls; the test takes the same steps in one process without DeepSpeed and compares the
parameters. The documented example (``examples/deepspeed_zero3.py``) is checked the same way. The single-process
tests at the end (errors for a partitioned parameter that cannot be gathered) run in ``make test``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from gspo_kernels.distributed import zero3
from tests.distributed import zero3_cases as cases
from tests.support import run_launch

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ENV = {"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
# fp32 steps on both sides: the same products, summed over the ranks in another order
ATOL, RTOL = 2e-6, 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3")
    run_launch(TORCHRUN + [str(ROOT / "tests" / "distributed" / "zero3_cases.py"), str(out)], timeout=400, env=ENV)
    calls = [json.loads((out / f"calls{rank}.json").read_text()) for rank in range(cases.WORLD)]
    return torch.load(out / "states.pt"), calls


@pytest.mark.deepspeed
@pytest.mark.parametrize("case", cases.CASES, ids=cases.case_name)
def test_zero3_steps_equal_one_process_steps(trained, case):
    """The parameters after the steps under ZeRO-3 equal those of the same steps in one process."""
    states, _ = trained
    expected = cases.train_in_one_process(case)
    got = states[cases.case_name(case)]
    initial = cases.build_policy(tied=case[2] == "tied").state_dict()
    moved = max((expected[n] - initial[n]).abs().max().item() for n in expected)
    assert moved > 1e-3, "the steps must move the parameters"
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.deepspeed
@pytest.mark.parametrize("case", cases.CASES, ids=cases.case_name)
def test_every_rank_gathers_alike_and_nothing_outlives_the_call(trained, case):
    """Per call: one all-gather of the head in the forward and one in the backward, the same on both ranks whatever
    their rows; the head partitioned again after each (in the backward, as soon as its gradient is accumulated:
    before the body's backward starts); no storage of the gathered head (or its cast) left alive by the forward."""
    _, calls = trained
    per_rank = [c[cases.case_name(case)] for c in calls]
    assert [[call["gathers"] for call in rank] for rank in per_rank[1:]] == [[c["gathers"] for c in per_rank[0]]]
    if case[2] == "tied":  # the embedding's module holds the parameter at times: DeepSpeed releases it then
        for rank in per_rank:
            for call in rank:
                assert call["outlived"] == 0 and max(call["gathers"]) <= 1, call
            assert rank[-1]["partitioned"], rank[-1]  # after the last backward
        return
    for rank in per_rank:
        for call in rank:
            # forward: the old log-probs' call and the loss's (each gathers once); backward: once
            assert call["gathers"] == ([1, 1] if call["what"] == "forward" else [1]), call
            assert call["partitioned"], call
            assert call["outlived"] == 0, call
            if call["what"] == "backward":  # released once its gradient is accumulated, before the body's backward
                assert call["head_partitioned_in_body_backward"] is True, call


@pytest.mark.deepspeed
def test_documented_example_equals_one_process(trained):
    """The loop of ``examples/deepspeed_zero3.py`` (ZeRO-3, ``fused_linear_gspo_loss`` on ``model.lm_head.weight``,
    run by the worker in the same processes): its parameters after three rollouts of two updates each equal the same
    updates in one process without DeepSpeed."""
    states, _ = trained
    example = cases.load_example()
    model = example.build_policy()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=3e-4)
    clipped = []
    for index in range(cases.EXAMPLE_ROLLOUTS):
        batches = [example.rollout(rank, index) for rank in range(cases.WORLD)]
        olds = [example.old_logprobs(model, model.lm_head, b) for b in batches]
        for _ in range(cases.EXAMPLE_UPDATES):
            opt.zero_grad()
            outs = [example.gspo_loss(model, model.lm_head, b, old) for b, old in zip(batches, olds)]
            clipped += [o.metrics["clip_ratio/region_mean"].item() for o in outs]
            (sum(o.loss for o in outs) / cases.WORLD).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    assert 0 < max(clipped) < 1, "some responses clip in the off-policy updates, not all"
    got = states["example"]
    for name, p in model.named_parameters():
        assert (p - initial[name]).abs().max() > 0
        torch.testing.assert_close(got[name], p.detach(), atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")


# ---- a partitioned parameter the library cannot gather: one process, no DeepSpeed engine ---------------------------


def _partitioned(shape=(11, 8)):
    """A stand-in with the attributes DeepSpeed ZeRO-3 gives a partitioned parameter."""
    param = torch.nn.Parameter(torch.empty(0))
    param.ds_id, param.ds_shape = 7, torch.Size(shape)

    class Status:  # DeepSpeed's ZeroParamStatus, as the error message reads it
        name = "NOT_AVAILABLE"

    param.ds_status = Status()
    return param


def test_partitioned_weight_without_a_process_group_names_zero3():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    import gspo_kernels as gk

    weight = _partitioned()
    weight.ds_status = ZeroParamStatus.NOT_AVAILABLE
    hidden, labels = torch.randn(3, 8), torch.randint(0, 11, (3,))
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"DeepSpeed ZeRO-3: the weight parameter is partitioned .*\(11, 8\) in full"
                                           r".*torch.distributed, which is not initialized.*GatheredParameters"):
        gk.linear_logprobs(hidden, weight, labels)
    with pytest.raises(RuntimeError, match="DeepSpeed ZeRO-3: the weight parameter"):
        gk.fused_linear_gspo_loss(hidden, weight, labels, torch.ones(3), mask=torch.ones(3),
                                  cu_seqlens=torch.tensor([0, 3], dtype=torch.int32))


def test_partitioned_weight_without_deepspeed_names_zero3(monkeypatch):
    import gspo_kernels as gk

    for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    hidden, labels = torch.randn(3, 8), torch.randint(0, 11, (3,))
    with pytest.raises(RuntimeError, match=r"DeepSpeed ZeRO-3: the weight parameter is partitioned \(shape \(0,\), "
                                           r"\(11, 8\) in full\) but deepspeed cannot be imported"):
        gk.linear_logprobs(hidden, _partitioned(), labels)


def test_plain_tensors_import_nothing_of_deepspeed():
    """Without a ZeRO-3 parameter the hidden-state functions neither import DeepSpeed nor change anything."""
    code = ("import sys, torch, gspo_kernels as gk; h = torch.randn(3, 8, requires_grad=True); "
            "w = torch.randn(11, 8, requires_grad=True); gk.linear_logprobs(h, w, torch.tensor([1, 2, 3])).sum()"
            ".backward(); assert 'deepspeed' not in sys.modules, 'deepspeed imported'; print('ok')")
    out = run_launch([sys.executable, "-c", code], timeout=120, env={"PYTHONPATH": str(ROOT)})
    assert out.strip().endswith("ok")
    assert zero3.is_zero3_param(_partitioned()) and not zero3.is_zero3_param(torch.zeros(2))

