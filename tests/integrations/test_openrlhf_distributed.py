"""The OpenRLHF integration across processes (marker ``deepspeed``: ``make test-deepspeed``; ``make test`` leaves
them out): two ranks under ``torchrun`` (gloo, DeepSpeed's CPU accelerator), each comparing the library's Actor
with OpenRLHF's (``tests/integrations/openrlhf_workers.py``); and a real Ray worker started with the hook :func:`enable` adds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gspo_kernels.testing import FP32_RTOL
from tests.integrations.openrlhf_env import subprocess_env
from tests.support import run_launch

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


MODES = ("ring", "zero2-tied", "zero3", "zero3-tied")


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Every mode of ``tests/integrations/openrlhf_workers.py`` in one launch of two ranks; the output folder."""
    out = tmp_path_factory.mktemp("openrlhf_workers")
    env = {**subprocess_env(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    run_launch(TORCHRUN + [str(ROOT / "tests" / "integrations" / "openrlhf_workers.py"), ",".join(MODES), str(out)], timeout=500, env=env)
    return out


def _ranks(mode: str, out) -> list:
    return [json.loads((out / f"{mode}{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.deepspeed
def test_actor_under_a_ring_attention_group_matches_openrlhf(workers):
    """Packed samples sliced over a ring-attention group of two ranks: the gathered action log-probs and entropies
    and each rank's parameter gradients equal OpenRLHF's Actor's (fp32 rounding)."""
    for rank in _ranks("ring", workers):
        assert rank["logp"] < FP32_RTOL and rank["entropy"] < FP32_RTOL and rank["grads"] < FP32_RTOL, rank


def _check_zero(ranks, stage: int) -> None:
    for rank in ranks:
        assert rank["moved"] > 1e-3, rank  # the steps moved the parameters
        assert rank["partitioned"] == (stage == 3), rank  # ZeRO-3: the head partitioned where the library reads it
        assert rank["old"] < FP32_RTOL and rank["logp"] < FP32_RTOL and rank["entropy"] < 1e-4, rank
        assert rank["params"] < 1e-6, rank


@pytest.mark.deepspeed
def test_actor_under_zero2_matches_openrlhf(workers):
    """DeepSpeed ZeRO-2, the lm_head tied to the embeddings (Qwen2.5-0.5B's layout), each rank its own batches: the
    old and the current log-probs, the entropies, and the parameters after two SGD steps (gradients reduced over
    the ranks) equal those of OpenRLHF's Actor."""
    _check_zero(_ranks("zero2-tied", workers), 2)


@pytest.mark.deepspeed
def test_actor_under_zero3_matches_openrlhf(workers):
    """DeepSpeed ZeRO-3: the lm_head partitioned between its uses, gathered by the library in its forward and
    backward (``gspo_kernels.distributed``); the same comparisons as under ZeRO-2."""
    _check_zero(_ranks("zero3", workers), 3)


@pytest.mark.deepspeed
def test_actor_under_zero3_with_a_tied_lm_head_matches_openrlhf(workers):
    """A tied lm_head (the embedding's weight, Qwen2.5-0.5B to 3B): the library leaves it to DeepSpeed when a module
    holds it in the backward (released with that module, not by the library)."""
    _check_zero(_ranks("zero3-tied", workers), 3)


_RAY_WORKER = r"""
from gspo_kernels.integrations import openrlhf as gko
gko.enable(backend="torch")
import ray
ray.init(num_cpus=1, include_dashboard=False)


@ray.remote
def trainer_classes():
    import openrlhf.trainer.ray.launcher as launcher
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from gspo_kernels.integrations import openrlhf as gko
    return (ppo_actor.ActorPPOTrainer.__init__.__globals__["PolicyLoss"] is gko.PolicyLoss,
            ppo_actor.Actor is gko.Actor, launcher.Actor is gko.Actor, gko.PolicyLoss.backend)


print("worker", ray.get(trainer_classes.remote()))
ray.shutdown()
"""


@pytest.mark.deepspeed
def test_a_ray_worker_of_an_enabled_driver_holds_the_library_classes():
    """``enable()`` in the driver, then ``ray.init``: a Ray worker process (started by Ray, not by the test) imports
    OpenRLHF's trainer modules and finds the library's classes there, with the driver's backend."""
    out = run_launch([sys.executable, "-c", _RAY_WORKER], timeout=300, env=subprocess_env())
    assert "worker (True, True, True, 'torch')" in out, out[-3000:]


@pytest.mark.deepspeed
def test_the_launcher_module_runs_train_ppo_ray_with_the_library_on():
    """``python -m gspo_kernels.integrations.openrlhf ARGS`` is ``python -m openrlhf.cli.train_ppo_ray ARGS`` (here
    ``--help``: its parser's options are printed) after :func:`enable` in the real module (not a ``__main__`` copy)."""
    code = ("import runpy, sys; sys.argv = ['x', '--help']\n"
            "from gspo_kernels.integrations import openrlhf as gko\n"
            "try:\n    runpy.run_module('gspo_kernels.integrations.openrlhf', run_name='__main__')\n"
            "except SystemExit as exit:\n    assert exit.code == 0\n"
            "import openrlhf.trainer.ray.ppo_actor as p\n"
            "print('held', p.PolicyLoss is gko.PolicyLoss, p.Actor is gko.Actor)\n")
    out = run_launch([sys.executable, "-c", code], timeout=300, env=subprocess_env())
    assert "--actor.policy_loss_type" in out and "held True True" in out, out[-3000:]
