"""The TRL drop-in under DDP, FSDP2 (lm_head its own ``fully_shard`` unit) and FSDP1 (``use_orig_params=True``).

Two processes with the gloo backend, started here with ``torch.multiprocessing`` (``accelerate launch
--cpu`` would run one process and drop FSDP on the CPU). Each rank gets its own batch; in every setting
both stock ``trl.GRPOTrainer`` and the drop-in compute the old log-probs through the wrapped model, then
``_compute_loss`` and ``backward``. Checked on the full (unsharded) gradients:

- the drop-in's loss (per rank), its old log-probs and every parameter's gradient equal stock TRL's in
  the same setting (fp32: loss ``rtol 1e-5``, gradients ``atol 1e-6 + rtol 1e-4``), with one exception
  that is stock TRL's bug: under FSDP2 with lm_head its own unit, TRL 1.16 leaves each rank the shard of
  its *own* lm_head gradient (never reduced across ranks), which a test below pins down;
- the drop-in's gradients are the same in all three settings (the rank average DDP computes): the
  sharded lm_head's gradient is reduced across ranks as FSDP reduces every other gradient.

DeepSpeed ZeRO-2 / ZeRO-3: ``tests/distributed/test_trl_deepspeed.py`` (``make test-deepspeed``). An lm_head
that is its own FSDP1 unit is refused with an error naming FSDP.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from tests.support import spawn_within

WORLD = 2
# The spawn fails past this (a rank hung in a collective): it took 12 s alone on the 2-core development machine
SPAWN_TIMEOUT_S = 300
SETTINGS = ("ddp", "fsdp2", "fsdp1")
RUNS = ("local",) + SETTINGS  # "local": no wrapper, each rank's own gradient (to explain stock TRL under FSDP2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wrap(model, setting):
    if setting == "local":
        return model
    if setting == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if setting == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model.lm_head)  # the lm_head its own unit: DTensor weight, Shard(0)
        fully_shard(model)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))


def _full_grads(model, wrapped, setting):
    from torch.distributed.tensor import DTensor

    if setting == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(wrapped, with_grads=True):
            return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        if isinstance(g, DTensor):
            assert isinstance(p, DTensor) and g.placements == p.placements, name  # gradients land sharded
            g = g.full_tensor()
        out[name.replace("module.", "")] = g.detach().clone()
    return out


def _worker(rank, port, policy_dir, out_dir):
    # CPU processes over gloo (use_cpu=True): on a machine with one GPU, the rank-1 process must not let accelerate /
    # transformers pick cuda:1 (nothing has touched CUDA in this fresh process yet, so hiding it here holds)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    import torch.distributed as dist
    import trl
    from transformers import AutoModelForCausalLM

    from gspo_kernels.integrations.trl import GRPOTrainer
    from gspo_kernels.train.tasks import hf_tokenizer, trl_reward_function
    from tests.integrations.test_trl_integration import TASK, _config, _dataset, _inputs

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {}
    for setting in RUNS:
        for cls in (trl.GRPOTrainer, GRPOTrainer):
            model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
            trainer = cls(
                model=model, reward_funcs=trl_reward_function(TASK), train_dataset=_dataset(),
                args=_config(__import__("pathlib").Path(out_dir) / f"r{rank}", importance_sampling_level="sequence",
                             loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4),
                processing_class=hf_tokenizer(), **({"gspo_backend": "cpu"} if cls is GRPOTrainer else {}),
            )
            gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
            inputs = _inputs(model, gen, with_old=True, beta=0.0)
            if rank == 1:  # fewer tokens on rank 1: token-weighted metrics differ from a mean of per-rank means
                inputs["completion_mask"][:, 3:] = 0
            wrapped = _wrap(trainer.model, setting)
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            with torch.no_grad():  # the old-log-prob pass, through the wrapper
                old, ent, _ = trainer._get_per_token_logps_and_entropies(wrapped, ids, attn, ids.shape[1] - 5,
                                                                         compute_entropy=True)
            local_entropy = ((ent * inputs["completion_mask"]).sum(), inputs["completion_mask"].sum())
            offsets = torch.tensor([[6e-4], [-5e-4], [1e-4], [8e-4], [-2e-3], [0.0]])
            inputs["old_per_token_logps"] = (old - offsets) * inputs["completion_mask"]
            model.train()
            trainer.current_gradient_accumulation_steps = 1
            loss = trainer._compute_loss(wrapped, inputs)
            loss.backward()
            results[(setting, cls.__module__.split(".")[0], rank)] = dict(
                loss=loss.detach(), old=old, grads=_full_grads(model, wrapped, setting),
                clip=trainer._metrics["train"]["clip_ratio/region_mean"][-1],
                metrics={k: v[-1] for k, v in trainer._metrics["train"].items()}, local_entropy=local_entropy,
            )
    # an lm_head that is its own FSDP1 unit: refused with an error naming FSDP
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=trl_reward_function(TASK), train_dataset=_dataset(),
                          args=_config(__import__("pathlib").Path(out_dir) / f"r{rank}"),
                          processing_class=hf_tokenizer(), gspo_backend="cpu")
    inputs = _inputs(model, torch.Generator().manual_seed(1), with_old=True, beta=0.0)
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m is model.lm_head)
    wrapped = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"),
                                       auto_wrap_policy=policy)
    try:
        trainer._compute_loss(wrapped, inputs)
        results["fsdp1_own_unit_error"] = None
    except ValueError as exc:
        results["fsdp1_own_unit_error"] = str(exc)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.support import save_tiny_policy

    path = save_tiny_policy(tmp_path_factory.mktemp("dist_policy"))
    out = tmp_path_factory.mktemp("dist_out")
    spawn_within(_worker, (_free_port(), str(path), str(out)), nprocs=WORLD, timeout=SPAWN_TIMEOUT_S)
    merged = {}
    for rank in range(WORLD):
        merged.update(torch.load(out / f"rank{rank}.pt", weights_only=False))
    return merged


@pytest.mark.parametrize("setting", SETTINGS)
def test_loss_and_gradients_match_stock_trl(results, setting):
    for rank in range(WORLD):
        theirs, ours = results[(setting, "trl", rank)], results[(setting, "gspo_kernels", rank)]
        torch.testing.assert_close(ours["old"], theirs["old"], rtol=1e-5, atol=1e-6)  # the old-log-prob pass
        torch.testing.assert_close(ours["loss"], theirs["loss"], rtol=1e-5, atol=1e-7)
        assert ours["clip"] == pytest.approx(theirs["clip"], abs=1e-6)
        assert set(ours["grads"]) == set(theirs["grads"])
        assert any("lm_head" in name for name in ours["grads"])
        for name, g in theirs["grads"].items():
            if setting == "fsdp2" and name.startswith("lm_head"):
                continue  # stock TRL does not reduce it across ranks: test_stock_trl_fsdp2_lm_head_gradient_...
            torch.testing.assert_close(ours["grads"][name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    clip = results[(setting, "trl", 0)]["clip"]
    assert 0 < clip < 1, "some responses must clip and some not"


@pytest.mark.parametrize("setting", SETTINGS)
def test_metrics_across_processes_weighted_as_trl(results, setting):
    """Every metric TRL logs, equal on both ranks to stock TRL's; the entropy is token-weighted over ranks."""
    for rank in range(WORLD):
        theirs, ours = results[(setting, "trl", rank)]["metrics"], results[(setting, "gspo_kernels", rank)]["metrics"]
        assert set(theirs) <= set(ours)
        for name, value in theirs.items():
            assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    (s0, n0), (s1, n1) = (results[(setting, "gspo_kernels", r)]["local_entropy"] for r in range(WORLD))
    weighted, per_rank_mean = float((s0 + s1) / (n0 + n1)), float((s0 / n0 + s1 / n1) / 2)
    # (a tiny random policy: entropies near log V everywhere, so the two readings differ by ~6e-5)
    assert abs(weighted - per_rank_mean) > 2e-5, "the ranks must hold different token counts"
    assert results[(setting, "gspo_kernels", 0)]["metrics"]["entropy"] == pytest.approx(weighted, abs=2e-6)


@pytest.mark.parametrize("setting", ("fsdp2", "fsdp1"))
def test_sharded_gradients_are_the_rank_average(results, setting):
    """The drop-in under FSDP reduces the gradient across ranks exactly as DDP averages it."""
    ddp = results[("ddp", "gspo_kernels", 0)]["grads"]
    for rank in range(WORLD):
        got = results[(setting, "gspo_kernels", rank)]["grads"]
        for name, g in ddp.items():
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_stock_trl_fsdp2_lm_head_gradient_is_not_reduced(results):
    """Stock TRL 1.16 under FSDP2 with lm_head its own unit: each rank keeps its shard of *its own* gradient
    (``full_tensor()`` without gradient placements), never reduced across ranks; the drop-in averages it."""
    theirs = results[("fsdp2", "trl", 0)]["grads"]["lm_head.weight"]
    local = [results[("local", "trl", rank)]["grads"]["lm_head.weight"] for rank in range(WORLD)]
    half = theirs.shape[0] // WORLD
    torch.testing.assert_close(theirs, torch.cat([local[0][:half], local[1][half:]]), rtol=1e-4, atol=1e-6)
    ours = results[("fsdp2", "gspo_kernels", 0)]["grads"]["lm_head.weight"]
    torch.testing.assert_close(ours, (local[0] + local[1]) / 2, rtol=1e-4, atol=1e-6)


def test_fsdp1_lm_head_own_unit_raises_naming_the_wrapper(results):
    message = results["fsdp1_own_unit_error"]
    assert message is not None and "its own FSDP (FullyShardedDataParallel) unit" in message
