"""NeMo-RL's signatures (``integrations.megatron.nemo_rl``) against megatron-core and a float64 computation.

NeMo-RL itself is not installed (``nemo-rl`` on PyPI is an empty placeholder; NeMo-RL installs from its repository
with CUDA-only dependencies): its functions are not called here. What is checked, in one launch of 4 gloo processes
(tensor-parallel 2 x context-parallel 2, megatron's parallel state):

* ``from_parallel_hidden_states_to_logprobs`` on sequence-parallel hidden-state shards in NeMo-RL's load-balanced
  context-parallel layout, and without context parallelism: log-probs and entropy against float64 on the whole
  matrix; against megatron's ``vocab_parallel_cross_entropy`` on the logits of the same shards (forward, and the
  hidden-state and weight-shard gradients through megatron's sequence-parallel gather);
* ``from_parallel_logits_to_logprobs`` on ``[B, S/cp, V/tp]`` logits: log-probs, entropy and the logits' gradient
  against float64;
* bad input: a clear error naming the argument, on every rank.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.distributed as dist

from gspo_kernels.testing import rel_err
from tests.integrations.megatron.harness import run_ranks

V, H, B = 70, 24, 2
S = 13  # tokens per sequence; padded to 16 = 2 cp x 4 positions per chunk
S_PAD = 16
TP = CP = 2


def _groups():
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(),
            ps.get_context_parallel_group(), ps.get_context_parallel_rank())


def _cp_positions(cp_rank: int, total: int, cp: int) -> torch.Tensor:
    """NeMo-RL's load-balanced layout: rank r holds chunks r and 2 cp - 1 - r of 2 cp."""
    chunk = total // (2 * cp)
    first, second = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def _float64(hidden, weight, target, g_logp, g_ent):
    """Log-probs of ``target[:, t + 1]`` and entropies at ``t < S - 1`` from ``hidden [S_pad, B, H]`` and the whole
    ``weight``; the gradients of ``sum(logp * g_logp + entropy * g_ent)``."""
    hidden = hidden.double().requires_grad_()
    weight = weight.double().requires_grad_()
    seq = target.shape[1]
    logits = torch.einsum("sbh,vh->bsv", hidden[:seq - 1], weight)
    logits.retain_grad()
    log_softmax = logits.log_softmax(-1)
    logp = log_softmax.gather(-1, target[:, 1:, None])[..., 0]
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    (logp * g_logp.double() + entropy * g_ent.double()).sum().backward()
    return logp, entropy, hidden.grad, weight.grad, logits.grad


def _inputs(seed: int, seq: int, seq_pad: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(seq_pad, B, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / H ** 0.5
    target = torch.randint(0, V, (B, seq), generator=gen)
    g_logp, g_ent = torch.randn(CP, B, seq - 1, generator=gen), torch.randn(CP, B, seq - 1, generator=gen)
    return hidden, weight, target, g_logp, g_ent


def _hidden_path_with_cp(out: dict) -> None:
    """Sequence-parallel shards of each context-parallel rank's positions; the upstream gradient differs between the
    context-parallel ranks (NeMo-RL sums it over the group in the backward), so the float64 loss is their sum."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region, vocab_parallel_cross_entropy

    from gspo_kernels.integrations.megatron import nemo_rl

    tp_group, tp_rank, cp_group, cp_rank = _groups()
    hidden, weight, target, g_logp, g_ent = _inputs(11, S, S_PAD)
    ref = _float64(hidden, weight, target, g_logp.sum(0), g_ent.sum(0))
    pos = _cp_positions(cp_rank, S_PAD, CP)
    rows = slice(tp_rank * (V // TP), (tp_rank + 1) * (V // TP))
    local = slice(tp_rank * (len(pos) // TP), (tp_rank + 1) * (len(pos) // TP))
    shard = hidden[pos][local].clone().requires_grad_()
    w_shard = weight[rows].clone().requires_grad_()
    logp, entropy = nemo_rl.from_parallel_hidden_states_to_logprobs(
        shard, w_shard, None, target, rows.start, rows.stop, tp_group, cp_group=cp_group, return_entropy=True)
    (logp * g_logp[cp_rank] + entropy * g_ent[cp_rank]).sum().backward()
    dw = w_shard.grad.clone()
    dist.all_reduce(dw, group=cp_group)  # each rank's dW covers its own positions: summed over the group
    out["cp"] = {"shape": tuple(logp.shape), "logp": rel_err(logp, ref[0]), "entropy": rel_err(entropy, ref[1]),
                 "dH": rel_err(shard.grad, ref[2][pos][local]), "dW": rel_err(dw, ref[3][rows])}

    # megatron's own path on the same shards: the gathered rows' logits, vocab_parallel_cross_entropy on them
    valid = pos < S - 1
    next_tokens = torch.nn.functional.pad(target[:, 1:], (0, S_PAD - S + 1))[:, pos].t().contiguous()
    m_shard, m_weight = shard.detach().clone().requires_grad_(), w_shard.detach().clone().requires_grad_()
    logits = gather_from_sequence_parallel_region(m_shard) @ m_weight.t()
    m_logp = -vocab_parallel_cross_entropy(logits, next_tokens)  # [S_local, B]
    upstream = torch.nn.functional.pad(g_logp.sum(0), (0, S_PAD - S + 1))[:, pos].t()
    (m_logp * upstream * valid[:, None]).sum().backward()
    o_shard, o_weight = shard.detach().clone().requires_grad_(), w_shard.detach().clone().requires_grad_()
    o_logp = nemo_rl.from_parallel_hidden_states_to_logprobs(o_shard, o_weight, None, target, rows.start,
                                                            rows.stop, tp_group, cp_group=cp_group)
    (o_logp * g_logp[cp_rank]).sum().backward()
    out["cp_vs_megatron"] = {"logp": rel_err(o_logp[:, pos[valid]].t(), m_logp[valid]),
                             "dH": rel_err(o_shard.grad, m_shard.grad), "dW": rel_err(o_weight.grad, m_weight.grad)}


def _hidden_path_without_cp(out: dict) -> None:
    """NeMo-RL's own setting: no context parallelism, each context-parallel rank its own batch."""
    from gspo_kernels.integrations.megatron import nemo_rl

    tp_group, tp_rank, _, cp_rank = _groups()
    seq = 8
    hidden, weight, target, g_logp, g_ent = _inputs(20 + cp_rank, seq, seq)
    ref = _float64(hidden, weight, target, g_logp[0], g_ent[0])
    rows = slice(tp_rank * (V // TP), (tp_rank + 1) * (V // TP))
    local = slice(tp_rank * (seq // TP), (tp_rank + 1) * (seq // TP))
    shard, w_shard = hidden[local].clone().requires_grad_(), weight[rows].clone().requires_grad_()
    logp, entropy = nemo_rl.from_parallel_hidden_states_to_logprobs(
        shard, w_shard, None, target, rows.start, rows.stop, tp_group, return_entropy=True)
    (logp * g_logp[0] + entropy * g_ent[0]).sum().backward()
    out["no_cp"] = {"shape": tuple(logp.shape), "logp": rel_err(logp, ref[0]), "entropy": rel_err(entropy, ref[1]),
                    "dH": rel_err(shard.grad, ref[2][local]), "dW": rel_err(w_shard.grad, ref[3][rows])}
    with torch.no_grad():
        again = nemo_rl.from_parallel_hidden_states_to_logprobs(shard, w_shard, None, target, rows.start, rows.stop,
                                                               tp_group, inference_only=True)
    out["inference_only"] = {"requires_grad": again.requires_grad, "logp": rel_err(again, ref[0])}


def _logits_path(out: dict) -> None:
    from gspo_kernels.integrations.megatron import nemo_rl

    tp_group, tp_rank, cp_group, cp_rank = _groups()
    hidden, weight, target, g_logp, g_ent = _inputs(31, S, S_PAD)
    ref = _float64(hidden, weight, target, g_logp.sum(0), g_ent.sum(0))
    pos = _cp_positions(cp_rank, S_PAD, CP)
    rows = slice(tp_rank * (V // TP), (tp_rank + 1) * (V // TP))
    logits = torch.einsum("sbh,vh->bsv", hidden[pos], weight[rows]).requires_grad_()
    logp, entropy = nemo_rl.from_parallel_logits_to_logprobs(logits, target, rows.start, rows.stop, tp_group,
                                                             cp_group=cp_group, return_entropy=True)
    (logp * g_logp[cp_rank] + entropy * g_ent[cp_rank]).sum().backward()
    valid = pos < S - 1
    ref_dlogits = ref[4][:, pos[valid], rows]
    out["logits"] = {"shape": tuple(logp.shape), "logp": rel_err(logp, ref[0]), "entropy": rel_err(entropy, ref[1]),
                     "dlogits": rel_err(logits.grad[:, valid], ref_dlogits),
                     "dlogits_padding": float(logits.grad[:, ~valid].abs().sum())}


def _bad_input(out: dict) -> None:
    from gspo_kernels.integrations.megatron import nemo_rl

    tp_group, tp_rank, cp_group, _ = _groups()
    rows = (tp_rank * (V // TP), (tp_rank + 1) * (V // TP))
    shard, w_shard = torch.randn(4, B, H), torch.randn(V // TP, H)
    target = torch.randint(0, V, (B, S))
    cases = {
        "short hidden": lambda: nemo_rl.from_parallel_hidden_states_to_logprobs(
            shard, w_shard, None, torch.randint(0, V, (B, 40)), *rows, tp_group, cp_group=cp_group),
        "batch": lambda: nemo_rl.from_parallel_hidden_states_to_logprobs(
            shard, w_shard, None, target[:1], *rows, tp_group, cp_group=cp_group),
        "2-D hidden": lambda: nemo_rl.from_parallel_hidden_states_to_logprobs(
            shard[:, 0], w_shard, None, target, *rows, tp_group, cp_group=cp_group),
        "label": lambda: nemo_rl.from_parallel_hidden_states_to_logprobs(
            shard, w_shard, None, target + V, *rows, tp_group, cp_group=cp_group),
        "top-k": lambda: nemo_rl.from_parallel_logits_to_logprobs(
            torch.randn(B, 8, V // TP), target, *rows, tp_group, cp_group=cp_group,
            sampling_params=types.SimpleNamespace(top_k=5, top_p=1.0)),
    }
    errors = {}
    for name, call in cases.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors


def _ranks(rank: int) -> dict:
    out: dict = {}
    _hidden_path_with_cp(out)
    _hidden_path_without_cp(out)
    _logits_path(out)
    _bad_input(out)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_ranks, world=TP * CP, tp=TP, cp=CP)


FP32 = 2e-5  # fp32 sums over H = 24 and V = 70 terms, against float64: a few units of 1e-7 each, 10x margin


def test_hidden_states_to_logprobs_with_context_parallelism_matches_float64(results):
    """NeMo-RL refuses context parallelism on its fused path; here each rank's gradient is the one-process one at its
    positions, and the weight gradients summed over the context-parallel group are the one-process gradient."""
    for rank in results:
        assert rank["cp"].pop("shape") == (B, S - 1)
        for name, err in rank["cp"].items():
            assert err < FP32, (name, err)


def test_hidden_states_to_logprobs_matches_megatron_vocab_parallel_cross_entropy(results):
    for rank in results:
        for name, err in rank["cp_vs_megatron"].items():
            assert err < FP32, (name, err)


def test_hidden_states_to_logprobs_without_context_parallelism_matches_float64(results):
    for rank in results:
        assert rank["no_cp"].pop("shape") == (B, 7)
        for name, err in rank["no_cp"].items():
            assert err < FP32, (name, err)
        assert rank["inference_only"] == {"requires_grad": False, "logp": rank["inference_only"]["logp"]}
        assert rank["inference_only"]["logp"] < FP32


def test_logits_to_logprobs_with_context_parallelism_matches_float64(results):
    for rank in results:
        assert rank["logits"].pop("shape") == (B, S - 1)
        assert rank["logits"].pop("dlogits_padding") == 0.0  # padded positions are cut off: no gradient
        for name, err in rank["logits"].items():
            assert err < FP32, (name, err)


@pytest.mark.parametrize("case, names", [
    ("short hidden", "tensor_parallel_hidden_states"), ("batch", "target"),
    ("2-D hidden", "tensor_parallel_hidden_states"), ("label", "label"), ("top-k", "sampling_params")])
def test_bad_input_raises_on_every_rank_naming_the_argument(results, case, names):
    for rank in results:
        message = rank["errors"][case]
        assert message is not None and names in message, (case, message)


def test_route_nemo_rl_replaces_and_restores_nemo_rl_functions(monkeypatch):
    """On stand-in modules with NeMo-RL's module path (NeMo-RL is not installed): both functions replaced where
    NeMo-RL's patched GPTModel.forward and its loss utilities look them up, and restored."""
    from gspo_kernels.integrations.megatron import nemo_rl

    model_utils = types.ModuleType("nemo_rl.distributed.model_utils")
    originals = {"from_parallel_hidden_states_to_logprobs": object(), "from_parallel_logits_to_logprobs": object()}
    for name, value in originals.items():
        setattr(model_utils, name, value)
    for name in ("nemo_rl", "nemo_rl.distributed"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "nemo_rl.distributed.model_utils", model_utils)
    restore = nemo_rl.route_nemo_rl()
    assert model_utils.from_parallel_hidden_states_to_logprobs is nemo_rl.from_parallel_hidden_states_to_logprobs
    assert model_utils.from_parallel_logits_to_logprobs is nemo_rl.from_parallel_logits_to_logprobs
    restore()
    for name, value in originals.items():
        assert getattr(model_utils, name) is value
