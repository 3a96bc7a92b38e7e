"""verl's Megatron route (``integrations.verl.linear_cross_entropy`` with the tensor-parallel group) against
megatron-core itself: 2 gloo processes, TP = 2, a sequence-parallel ``ColumnParallelLinear`` output layer.

verl's Megatron forward (``verl.models.mcore.model_forward_fused``) gathers the sequence-parallel hidden states with
megatron's ``gather_from_sequence_parallel_region`` and passes them, sequence-first ``[T, 1, H]``, with its packed
``[1, T]`` labels, the output layer's weight shard and the tensor-parallel group to ``linear_cross_entropy``; the
routed call leaves ``dH`` partial and megatron's gather reduce-scatters it. The same shards go through megatron's
own path: the output layer's logits, ``vocab_parallel_cross_entropy`` on them (the log-probs) and the entropy of
the gathered logits; both are also compared with a float64 computation of the whole matrix in one process.
Parameters in fp32 and bf16; one launch runs every check.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gspo_kernels.testing import rel_err
from tests.integrations.megatron.harness import run_ranks

V, H, T = 70, 24, 16  # V/tp = 35 rows per rank
TEMPERATURE = 0.7


def sequence_parallel_head(dtype: torch.dtype):
    """A megatron ``ColumnParallelLinear`` output layer ``[V / tp, H]`` (no bias, ``gather_output=False``) with
    ``sequence_parallel=True``: its input is this rank's ``[T / tp, B, H]`` rows, gathered inside the layer."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    tp = dist.get_world_size()
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=tp, use_cpu_initialization=True,
                               params_dtype=dtype, tensor_model_parallel_size=tp, sequence_parallel=True,
                               transformer_impl="local")
    return ColumnParallelLinear(H, V, config=config, init_method=torch.nn.init.normal_, bias=False,
                                gather_output=False)


def _megatron_path(head, hidden_shard, labels, w1, w2):
    """megatron's own logits path: the output layer's ``[T, 1, V/tp]`` logits, ``vocab_parallel_cross_entropy``
    for the log-probs, the entropy of the logits gathered over the group."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region, vocab_parallel_cross_entropy

    logits, _ = head(hidden_shard)
    scaled = logits.float() / TEMPERATURE
    full = gather_from_tensor_model_parallel_region(scaled)
    entropy = -(full.softmax(-1) * full.log_softmax(-1)).sum(-1)[:, 0]
    logp = -vocab_parallel_cross_entropy(scaled.clone(), labels.t().contiguous())[:, 0]  # it works in place
    return logp, entropy, (logp * w1 + entropy * w2).sum()


def _verl_path(head, hidden_shard, labels, w1, w2):
    """verl's route with the library in place of verl's kernel (``route_fused_kernels`` installs this function)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    from gspo_kernels.integrations import verl as gk_verl

    hidden = gather_from_sequence_parallel_region(hidden_shard)
    logp, entropy = gk_verl.linear_cross_entropy(hidden, head.weight, labels, TEMPERATURE, "none",
                                                 parallel_state.get_tensor_model_parallel_group())
    return logp, entropy, (logp * w1 + entropy * w2).sum()


def _float64_path(weight, hidden, labels, w1, w2):
    """The whole vocabulary in one process, float64."""
    weight = weight.detach().double().requires_grad_()
    hidden = hidden.detach().double().requires_grad_()
    logits = (hidden[:, 0] @ weight.t()) / TEMPERATURE
    log_softmax = logits.log_softmax(-1)
    logp = log_softmax.gather(-1, labels[0][:, None])[:, 0]
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    (logp * w1.double() + entropy * w2.double()).sum().backward()
    return logp, entropy, hidden.grad, weight.grad


def _run(path, head, hidden, labels, w1, w2, rank):
    local = T // dist.get_world_size()
    shard = hidden[rank * local:(rank + 1) * local].clone().requires_grad_()
    head.weight.grad = None
    logp, entropy, loss = path(head, shard, labels, w1, w2)
    loss.backward()
    return logp.detach(), entropy.detach(), shard.grad, head.weight.grad.clone()


def _compare(rank: int, dtype: torch.dtype) -> dict:
    head = sequence_parallel_head(dtype)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, 1, H, generator=gen).to(dtype)  # the same on every rank; each takes its T/tp rows
    labels = torch.randint(0, V, (1, T), generator=gen)
    w1, w2 = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    shards = [torch.empty_like(head.weight) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, head.weight.detach().contiguous())
    full_weight = torch.cat(shards)
    rows = slice(rank * (V // 2), (rank + 1) * (V // 2))
    local = slice(rank * (T // 2), (rank + 1) * (T // 2))

    ref_logp, ref_ent, ref_dh, ref_dw = _float64_path(full_weight, hidden, labels, w1, w2)
    ref = (ref_logp, ref_ent, ref_dh[local], ref_dw[rows])
    meg = _run(_megatron_path, head, hidden, labels, w1, w2, rank)
    ours = _run(_verl_path, head, hidden, labels, w1, w2, rank)
    names = ("logp", "entropy", "dH", "dW")
    return {"shapes": [tuple(t.shape) for t in ours[:2]],
            "ours_vs_megatron": {n: rel_err(o, m) for n, o, m in zip(names, ours, meg)},
            "ours_vs_float64": {n: rel_err(o, r) for n, o, r in zip(names, ours, ref)},
            "megatron_vs_float64": {n: rel_err(m, r) for n, m, r in zip(names, meg, ref)}}


def _ranks(rank: int) -> dict:
    return {"fp32": _compare(rank, torch.float32), "bf16": _compare(rank, torch.bfloat16)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_ranks, world=2, tp=2)


def test_verl_megatron_route_returns_verl_kernel_shapes_for_sequence_first_hidden_states(results):
    """verl passes ``[T, 1, H]`` hidden states with ``[1, T]`` labels; its kernel returns ``[T]`` (it flattens both)."""
    for rank in results:
        assert rank["fp32"]["shapes"] == [(T,), (T,)]


def test_verl_megatron_route_matches_megatron_in_fp32(results):
    """Log-probs, entropy, this rank's hidden-state rows' gradient (partial dH reduce-scattered by megatron's
    gather) and the weight shard's gradient: within fp32 rounding of megatron's own path and of float64."""
    for rank in results:
        for name, err in rank["fp32"]["ours_vs_megatron"].items():
            assert err < 2e-5, (name, err)
        for name, err in rank["fp32"]["ours_vs_float64"].items():
            assert err < 2e-5, (name, err)


def test_verl_megatron_route_in_bf16_is_no_worse_than_megatron(results):
    """bf16 parameters: the library's error against float64 (on the same bf16 parameters) is at most megatron's own
    (bf16 logits, fp32 cross entropy) plus one bf16 rounding of the largest entry (2^-8)."""
    for rank in results:
        for name, err in rank["bf16"]["ours_vs_float64"].items():
            assert err <= rank["bf16"]["megatron_vs_float64"][name] + 2 ** -8, (name, err, rank["bf16"])
