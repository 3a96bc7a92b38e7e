"""Tensor and context parallelism together: 4 gloo processes (megatron's TP=2 x CP=2) against one process holding
the whole batch and the whole output layer.

``integrations.megatron.fused_linear_gspo_loss`` on a ``ColumnParallelLinear`` head (each TP rank holds half the
vocabulary), each CP rank holding half the positions of every row in megatron's padded layout (``hidden [S_r, B,
H]``, ``labels [B, S_r]``), with the head plain and sequence-parallel (then each TP rank passes its ``[S_r / 2, B,
H]`` slice of its CP rank's positions). A few configs (GSPO sequence level, GRPO token level with KL and entropy,
an objective with a rollout correction) on random inputs with masked tokens. Checked, on every rank: the CP ranks'
losses add up to the one-process loss (every rank returns the same share, ``L / cp``); the metrics are the
one-process metrics; the hidden-state gradient of the rank's slice is the one-process gradient there; the weight
gradient of the rank's vocabulary shard, summed over the CP ranks, is the one-process gradient of those rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gspo_kernels import GSPOConfig
from tests.integrations.megatron.harness import column_parallel_head, run_ranks
from tests.support import RTOL, rel_err

V, H, B, S, TP, CP = 48, 16, 3, 8, 2, 2
CONFIGS = {
    "gspo_sequence": GSPOConfig(),
    "grpo_token_kl_entropy": GSPOConfig(importance_sampling_level="token", loss_type="dapo", beta=0.04,
                                        entropy_coef=0.01, temperature=0.7),
    "cispo_rollout": GSPOConfig(loss_type="cispo", importance_sampling_level="token", epsilon_high=1.0001,
                                rollout_correction="token_truncate", rollout_correction_max=1.5),
}


def _gathered(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def _inputs(config, weight: torch.Tensor, seed: int) -> dict:
    """One batch ``[B, S]`` (the same on every rank): hidden ``[B, S, H]``, labels, old / reference / rollout
    log-probs near the current ones, per-response advantages, a mask with holes."""
    import gspo_kernels as gk

    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    mask = (torch.rand(B, S, generator=gen) > 0.25).float()
    mask[:, 0] = 1.0
    current = gk.linear_logprobs(hidden, weight, labels, temperature=config.temperature)
    old = current + 2e-4 * torch.randn(B, S, generator=gen)
    kw = {"mask": mask}
    if config.beta > 0:
        kw["ref_logprobs"] = current + 0.3 * torch.randn(B, S, generator=gen)
    if config.rollout_correction is not None:
        kw["rollout_logprobs"] = old + 0.4 * torch.randn(B, S, generator=gen)
    return dict(hidden=hidden, labels=labels, advantages=torch.randn(B, generator=gen), old=old, kw=kw)


def _case(config, seed: int, sequence_parallel: bool) -> dict:
    from megatron.core import parallel_state

    import gspo_kernels as gk
    from gspo_kernels.integrations import megatron as gm

    tp_group, cp_group = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group()
    tp_rank, cp_rank = dist.get_rank(tp_group), dist.get_rank(cp_group)
    head = column_parallel_head(V, H, sequence_parallel=sequence_parallel, seed=41)
    with torch.no_grad():
        head.weight.mul_(0.3)
    weight = _gathered(head.weight.detach(), tp_group)
    x = _inputs(config, weight, seed)

    h_ref, w_ref = x["hidden"].clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = gk.fused_linear_gspo_loss(h_ref, w_ref, x["labels"], x["advantages"], x["old"], config=config, **x["kw"])
    ref.loss.backward()

    cols = torch.arange(cp_rank * (S // CP), (cp_rank + 1) * (S // CP))  # this CP rank's positions of every row
    if sequence_parallel:  # and this TP rank's slice of them
        cols = cols.chunk(TP)[tp_rank]
    positions = torch.arange(cp_rank * (S // CP), (cp_rank + 1) * (S // CP))
    mine = lambda t: t[:, positions]  # noqa: E731
    h_r = x["hidden"][:, cols].transpose(0, 1).contiguous().requires_grad_(True)  # [S_r(/tp), B, H]
    out = gm.fused_linear_gspo_loss(h_r, head, mine(x["labels"]), x["advantages"], mine(x["old"]), config=config,
                                    cp_group=cp_group, **{k: mine(v) for k, v in x["kw"].items()})
    out.loss.backward()
    total = out.loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    dw = head.weight.grad.clone()
    dist.all_reduce(dw, group=cp_group)
    shard = slice(tp_rank * (V // TP), (tp_rank + 1) * (V // TP))
    metrics = max((abs(float(out.metrics[k]) - float(v)) / max(1.0, abs(float(v))) for k, v in ref.metrics.items()),
                  default=0.0) if set(ref.metrics) <= set(out.metrics) else float("inf")
    return {"loss_sum": abs(total.item() - ref.loss.item()) / max(abs(ref.loss.item()), 1.0),
            "share": out.loss.item(), "metrics": metrics,
            "dH": rel_err(h_r.grad.transpose(0, 1), h_ref.grad[:, cols]), "dW": rel_err(dw, w_ref.grad[shard]),
            "dH_norm": h_r.grad.norm().item(), "tokens": h_r.shape[0]}


def _checks(rank: int) -> dict:
    results = {}
    for i, (name, config) in enumerate(CONFIGS.items()):
        for sp in (False, True):
            results[(name, sp)] = _case(config, seed=300 + i, sequence_parallel=sp)
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_checks, world=TP * CP, tp=TP, cp=CP)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain_head", "sequence_parallel_head"])
def test_tensor_and_context_parallel_loss_matches_one_process(ranks, sequence_parallel):
    for rank, result in enumerate(ranks):
        for (name, sp), errors in result.items():
            if sp != sequence_parallel:
                continue
            for key in ("loss_sum", "metrics", "dH", "dW"):
                assert errors[key] < RTOL, (rank, name, key, errors[key])
            assert errors["dH_norm"] > 0, (rank, name)  # the slice carried a gradient
            assert errors["tokens"] == (S // CP // TP if sp else S // CP), (rank, name, errors["tokens"])
    # every rank returns the same share, L / cp (documented: losses that add over the CP ranks to the one-process loss)
    for name in CONFIGS:
        shares = [result[(name, sequence_parallel)]["share"] for result in ranks]
        assert max(shares) - min(shares) <= RTOL * max(abs(shares[0]), 1.0), (name, shares)
