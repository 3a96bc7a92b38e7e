"""The TRL drop-in under DeepSpeed ZeRO-3 and ZeRO-2 trains as stock TRL does (marker ``deepspeed``).

``accelerate launch`` with a DeepSpeed config (two processes, DeepSpeed's CPU accelerator, gloo; the launch under a
time limit), ``trainer.train()`` for four optimizer steps (two generations, the second step of each off-policy) of
stock ``trl.GRPOTrainer`` and of ``gspo_kernels.integrations.trl.GRPOTrainer`` from the same weights and seed, for
GSPO (also with the drop-in's loss inside the model's forward, ``gspo_one_pass=True``), GSPO-token, GRPO with ``dapo``
and with ``bnpo`` and a KL term (a reference model under DeepSpeed too) under ZeRO-3, and GSPO and GRPO ``dapo`` under
ZeRO-2 (``trl_deepspeed_worker.RUNS``). Per step, every value stock TRL logs
(the loss, the gradient norm, the rewards, the clip shares, the entropy, the KL, the completion statistics) equals
the drop-in's. Under ZeRO-3 DeepSpeed keeps the lm_head partitioned between steps and, the head being read inside
the model's forward, gathers it itself for the model's forward and backward (an *external parameter*); the library's
own gather (``gspo_kernels.distributed.zero3``) is checked outside any forward by ``test_zero3.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.distributed import trl_deepspeed_worker as worker
from tests.support import run_launch

ROOT = Path(__file__).resolve().parents[2]
# fp32 on both sides; the same products in other orders (the library's head against TRL's chunked one), summed over
# the ranks by DeepSpeed in the same way
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    from tests.support import save_tiny_policy

    out = tmp_path_factory.mktemp("trl_deepspeed")
    policy = save_tiny_policy(out / "policy")
    for stage in (2, 3):
        (out / f"zero{stage}.json").write_text(json.dumps(worker.ds_config(stage)))
    (out / "accelerate.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
        f"deepspeed_config:\n  deepspeed_config_file: {out / 'zero3.json'}\n  zero3_init_flag: true\n"
        "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nrdzv_backend: static\nsame_network: true\n"
        "main_process_port: 0\nuse_cpu: false\n")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(out / "accelerate.yaml"),
               str(ROOT / "tests" / "distributed" / "trl_deepspeed_worker.py"), str(out), str(policy)]
    run_launch(command, timeout=400, env={"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return json.loads((out / "rows.json").read_text())


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", list(worker.RUNS))
def test_drop_in_trains_as_stock_trl_under_deepspeed(logged, name):
    stage = worker.RUNS[name][0]
    stock_name = worker.SAME_STOCK_RUN.get(name, name)
    stock, ours = logged["rows"][f"{stock_name}/trl"], logged["rows"][f"{name}/gspo_kernels"]
    assert len(stock) == len(ours) == worker.STEPS
    for step, (theirs, mine) in enumerate(zip(stock, ours)):
        assert set(theirs) <= set(mine), set(theirs) - set(mine)
        for key, value in theirs.items():
            if key in ("step_time", "epoch") or key.startswith("profiling/"):
                continue
            assert mine[key] == pytest.approx(value, rel=RTOL, abs=ATOL), f"step {step + 1}: {key}"
    assert any(row["clip_ratio/region_mean"] > 0 for row in stock), "some responses must clip"
    assert stock[1]["grad_norm"] != stock[0]["grad_norm"]
    weight, full = logged["lm_head_shapes"][f"{name}/gspo_kernels"]
    assert (tuple(weight) == (0,)) == (stage == 3), (weight, full)  # ZeRO-3: partitioned between the steps
