"""Context parallelism: 2 gloo processes (megatron's CP=2, TP=1) against one process holding the whole batch.

One launch runs every config of ``tests.support.configs()`` and ``objective_configs()`` on :func:`make_case`'s packed
responses (lengths 0 to 5, masked tokens, per-token advantages for even configs and per-response ones for odd), each
split between the two ranks two ways: contiguous halves, and megatron's load-balanced split (each sequence cut in
``2 * cp`` chunks, rank ``r`` holding chunks ``r`` and ``2 * cp - 1 - r``). Each rank passes only its tokens (its
``[T_r, 1, H]`` hidden states, ``[1, T_r]`` labels and inputs, its own ``cu_seqlens``) with ``cp_group``. The padded
layout is checked too (``[B, T]`` responses, each rank holding half the positions of every row: ``hidden
[T_r, B, H]``, ``labels [B, T_r]``, per-response advantages). The
one-process reference is ``gspo_kernels.fused_linear_gspo_loss`` on the whole batch. Checked, on each rank: the
ranks' losses add up to the one-process loss; the metrics are the one-process metrics; the rank's hidden-state
gradient equals the one-process gradient at its tokens; the weight gradients summed over the ranks equal the
one-process weight gradient; ``logprobs_out`` holds the rank's log-probs.

The same launch checks a batch whose sequences differ between the ranks (another count of sequences on one rank,
another advantage for one sequence on one rank): every rank raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.integrations.megatron.harness import column_parallel_head, run_ranks
from tests.support import CASE_LENGTHS, CASE_T, RTOL, configs, make_case, objective_configs, objective_id, rel_err

V, H, CP = 48, 16, 2
CONFIGS = configs() + objective_configs()
SPLITS = ("halves", "load_balanced", "padded")


def _chunks(length: int, split: str, rank: int):
    """Positions ``[0, length)`` of one sequence held by ``rank``, in the order the rank holds them."""
    if split == "halves":
        edges = [0, (length + 1) // 2, length]
        return list(range(edges[rank], edges[rank + 1]))
    n = 2 * CP
    edges = [length * k // n for k in range(n + 1)]
    return [p for c in (rank, n - 1 - rank) for p in range(edges[c], edges[c + 1])]


def _rank_index(split: str, rank: int):
    """This rank's token indices into the packed batch and its ``cu_seqlens``."""
    index, cu, start = [], [0], 0
    for length in CASE_LENGTHS:
        mine = [start + p for p in _chunks(length, split, rank)]
        index.extend(mine)
        cu.append(cu[-1] + len(mine))
        start += length
    return torch.tensor(index, dtype=torch.int64), torch.tensor(cu, dtype=torch.int32)


def _cp_case(i: int, config, split: str, head, cp_group) -> dict:
    """One config on one split: this rank's errors against the one process (``split`` "padded": megatron's padded
    layout, each rank holding half the positions of every row)."""
    import gspo_kernels as gk
    from gspo_kernels import reference
    from gspo_kernels.integrations import megatron as gm

    weight = head.weight.detach()
    torch.manual_seed(200 + i)
    hidden = None
    packed = split != "padded"

    def logp_of(labels):
        nonlocal hidden
        hidden = torch.randn(*labels.shape, H)
        return reference.linear_logprobs(hidden, weight, labels, temperature=config.temperature,
                                         final_logit_softcapping=config.final_logit_softcapping)

    case = make_case(logp_of, V, packed=packed, per_token_adv=packed and i % 2 == 0)
    kw = case.kwargs(config.beta > 0, config)
    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = gk.fused_linear_gspo_loss(h_ref, w_ref, case.labels, case.advantages, case.old_logprobs, config=config, **kw)
    ref.loss.backward()

    rank = dist.get_rank(cp_group)
    shape = tuple(case.labels.shape)
    if packed:
        index, cu = _rank_index(split, rank)
        mine = lambda t: t[index][None] if isinstance(t, torch.Tensor) and tuple(t.shape) == shape else t  # noqa: E731
        h_r = hidden[index][:, None].clone().requires_grad_(True)
        ref_dh = h_ref.grad[index]
    else:
        index = torch.tensor(_chunks(shape[1], "halves", rank))  # this rank's positions of every row
        mine = lambda t: t[:, index] if isinstance(t, torch.Tensor) and tuple(t.shape) == shape else t  # noqa: E731
        h_r = hidden[:, index].transpose(0, 1).contiguous().requires_grad_(True)
        ref_dh = h_ref.grad[:, index]
    local = {k: mine(v) for k, v in kw.items()}
    if packed:
        local["cu_seqlens"] = cu
    labels = mine(case.labels)
    logprobs_out = torch.zeros(labels.shape)
    out = gm.fused_linear_gspo_loss(h_r, head, labels, mine(case.advantages), mine(case.old_logprobs),
                                    config=config, cp_group=cp_group, logprobs_out=logprobs_out, **local)
    out.loss.backward()
    total = out.loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    dw = head.weight.grad.clone()
    dist.all_reduce(dw, group=cp_group)
    head.weight.grad = None
    lp = gk.linear_logprobs(hidden, weight, case.labels.clamp(min=0), temperature=config.temperature,
                            final_logit_softcapping=config.final_logit_softcapping)
    lp = mine(torch.where(case.mask != 0, lp, 0))
    dh = h_r.grad[:, 0] if packed else h_r.grad.transpose(0, 1)
    return {"loss_sum": abs(total.item() - ref.loss.item()) / max(abs(ref.loss.item()), 1.0),
            "metrics": _metric_errors(out.metrics, ref.metrics),
            "dH": rel_err(dh, ref_dh) if index.numel() else 0.0,
            "dW": rel_err(dw, w_ref.grad), "logprobs_out": rel_err(logprobs_out, lp),
            "tokens": labels.numel()}


def _metric_errors(got: dict, want: dict) -> float:
    if set(want) - set(got):
        return float("inf")
    return max((abs(float(got[k]) - float(v)) / max(1.0, abs(float(v))) for k, v in want.items()), default=0.0)


def _raises(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def _bad_batches(head, cp_group) -> dict:
    """Sequences that differ between the ranks: each rank's error message (or "no error")."""
    from gspo_kernels.integrations import megatron as gm

    rank = dist.get_rank(cp_group)
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 2, 4]
    T = sum(lengths)
    hidden = torch.randn(T, 1, H, generator=gen)
    labels = torch.randint(0, V, (1, T), generator=gen)
    old = torch.randn(1, T, generator=gen) - 3
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    adv = torch.tensor([1.0, -0.5, 0.25])
    fewer = (lambda: gm.fused_linear_gspo_loss(hidden[:5], head, labels[:, :5], adv[:2], old[:, :5],
                                                cu_seqlens=cu[:3], cp_group=cp_group)) if rank == 1 else \
        (lambda: gm.fused_linear_gspo_loss(hidden, head, labels, adv, old, cu_seqlens=cu, cp_group=cp_group))
    other_adv = adv.clone()
    if rank == 1:
        other_adv[1] = 0.5
    return {"count": _raises(fewer),
            "advantages": _raises(lambda: gm.fused_linear_gspo_loss(hidden, head, labels, other_adv, old,
                                                                     cu_seqlens=cu, cp_group=cp_group))}


def _checks(rank: int) -> dict:
    from megatron.core import parallel_state

    cp_group = parallel_state.get_context_parallel_group()
    head = column_parallel_head(V, H, seed=31)
    with torch.no_grad():
        head.weight.mul_(0.3)
    results = {"bad": _bad_batches(head, cp_group)}
    for i, config in enumerate(CONFIGS):
        for split in SPLITS:
            results[(objective_id(config), split)] = _cp_case(i, config, split, head, cp_group)
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_checks, world=2, tp=1, cp=CP)


@pytest.mark.parametrize("split", SPLITS)
def test_context_parallel_ranks_add_up_to_one_process(ranks, split):
    for rank, result in enumerate(ranks):
        cases = {k: v for k, v in result.items() if isinstance(k, tuple) and k[1] == split}
        assert len(cases) == len(CONFIGS)
        for name, errors in cases.items():
            for key in ("loss_sum", "metrics", "dH", "dW", "logprobs_out"):
                assert errors[key] < RTOL, (rank, name, key, errors[key])
    # each rank held part of the batch, not all of it
    one = next(v for k, v in ranks[0].items() if isinstance(k, tuple) and k[1] == split)["tokens"]
    two = next(v for k, v in ranks[1].items() if isinstance(k, tuple) and k[1] == split)["tokens"]
    assert one + two == (sum(CASE_LENGTHS) if split != "padded" else len(CASE_LENGTHS) * CASE_T) and one and two


def test_context_parallel_batches_that_differ_between_ranks_raise_on_every_rank(ranks):
    for result in ranks:
        bad = result["bad"]
        assert bad["count"].startswith("cu_seqlens:") and "3 sequences" in bad["count"] and "2" in bad["count"], bad
        assert bad["advantages"].startswith("advantages:") and "sequence 1" in bad["advantages"], bad
