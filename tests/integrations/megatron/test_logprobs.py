"""``integrations.megatron.linear_logprobs`` against megatron-core itself: 2 gloo processes, tensor-parallel size 2.

One launch runs every check (:func:`_checks`); the tests read its results. Megatron's side is the model's own
logits (``GPTModel`` without labels, ``parallel_output=True``: each rank's ``[B, S, V / 2]`` shard), its
``vocab_parallel_cross_entropy`` for the log-probs and, for the entropy, the shards gathered with megatron's
``gather_from_tensor_model_parallel_region`` (differentiable) and the entropy of the full logits in PyTorch (megatron's cross entropy shifts its input in place: it gets a copy). The
library's side reads the output layer's input (captured by a forward pre-hook) and the model. Both sides backward
the same random weighting of log-probs and entropies through the whole model; the output-layer shard's gradient and
the word embedding's (the hidden states' gradient, through every layer) are compared, on each rank.

The vocabulary is padded as megatron-based trainers pad it (61 ids, ``make_vocab_size_divisible_by=16`` times
``tp=2``: 64 rows, the padded rows in the softmax); labels are drawn from the 61 real ids.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.integrations.megatron.harness import column_parallel_head, gpt_inputs, run_ranks, tiny_gpt
from tests.support import rel_err

TRUE_VOCAB, DIVISIBLE_BY, TP = 61, 16, 2
VOCAB = math.ceil(TRUE_VOCAB / (DIVISIBLE_BY * TP)) * DIVISIBLE_BY * TP  # megatron's padded vocabulary: 64
B, S, HIDDEN = 2, 8, 32
# fp32: both sides compute the same fp32 logits' log-softmax (megatron's from materialized logits, the library's in
# chunks), so they agree to a few fp32 roundings (2^-24 relative) of values of size |logit| + log V (measured: 1e-7 to
# 1e-6 relative, gradients included).
FP32_TOL = 1e-5


def _labels(seed: int) -> torch.Tensor:
    return torch.randint(0, TRUE_VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def _entropy_full(logits_shard: torch.Tensor) -> torch.Tensor:
    """Entropy ``[B, S]`` (fp32) of megatron's logits shard gathered over the tensor-parallel group (differentiable)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(logits_shard).float()
    logp = torch.log_softmax(full, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _weights(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, generator=gen), torch.randn(B, S, generator=gen)


def _grads(model, tied: bool) -> dict:
    out = model.output_layer.weight if not tied else None
    grads = {"embedding": model.embedding.word_embeddings.weight.grad.float().clone()}
    if out is not None:
        grads["output_layer"] = out.grad.float().clone()
    model.zero_grad(set_to_none=True)
    return grads


def _model_case(tied: bool, dtype: torch.dtype) -> dict:
    """Megatron's log-probs / entropy / gradients and the library's, on one tiny GPTModel."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from gspo_kernels.integrations import megatron as gm

    model = tiny_gpt(vocab=VOCAB, hidden=HIDDEN, seq_len=S, tied=tied, params_dtype=dtype, seed=3)
    ids, pos, mask, _ = gpt_inputs(B, S, TRUE_VOCAB, seed=4)
    labels = _labels(5)
    w_lp, w_ent = _weights(6)

    logits = model(ids, pos, mask)  # [B, S, V / tp]
    ref_lp = -vocab_parallel_cross_entropy(logits.float().clone(), labels)
    ref_ent = _entropy_full(logits)
    ((w_lp * ref_lp).sum() + (w_ent * ref_ent).sum()).backward()
    ref_grads = _grads(model, tied)

    captured = {}
    handle = model.output_layer.register_forward_pre_hook(lambda mod, args: captured.setdefault("hidden", args[0]))
    model(ids, pos, mask)
    handle.remove()
    lp, ent = gm.linear_logprobs(captured["hidden"], model, labels, return_entropy=True)
    ((w_lp * lp).sum() + (w_ent * ent).sum()).backward()
    grads = _grads(model, tied)

    result = {"lp": (lp.detach(), ref_lp.detach()), "ent": (ent.detach(), ref_ent.detach()),
              "dtype": (lp.dtype, ent.dtype), "shape": tuple(lp.shape)}
    result.update({f"grad_{k}": (grads[k], ref_grads[k]) for k in ref_grads})
    # The library's log-probs against float64 math on the same (bf16 or fp32) operands: the library accumulates in
    # fp32, megatron rounds its logits to the parameters' dtype first.
    h = captured["hidden"].detach().double()
    weight = (model.shared_embedding_or_output_weight() if tied else model.output_layer.weight).detach().double()
    result["max_logit"] = float((h @ weight.t()).abs().max())
    return result


def _temperature_case() -> dict:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from gspo_kernels.integrations import megatron as gm

    model = tiny_gpt(vocab=VOCAB, hidden=HIDDEN, seq_len=S, seed=7)
    ids, pos, mask, _ = gpt_inputs(B, S, TRUE_VOCAB, seed=8)
    labels = _labels(9)
    captured = {}
    model.output_layer.register_forward_pre_hook(lambda mod, args: captured.setdefault("hidden", args[0]))
    with torch.no_grad():
        logits = model(ids, pos, mask)
        ref = -vocab_parallel_cross_entropy(logits.float() / 0.7, labels)
        got = gm.linear_logprobs(captured["hidden"], model, labels, temperature=0.7)
    return {"lp": (got, ref)}


def _sequence_parallel_case() -> dict:
    """A ``ColumnParallelLinear(sequence_parallel=True)`` head: each rank passes its ``[S / 2, B, H]`` slice."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from gspo_kernels.integrations import megatron as gm

    head = column_parallel_head(VOCAB, HIDDEN, sequence_parallel=True, seed=10)
    rank = parallel_state.get_tensor_model_parallel_rank()
    full = torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(11))
    labels = _labels(12)
    w_lp, w_ent = _weights(13)
    results = {}
    for side in ("megatron", "library"):
        hidden = full.chunk(TP, dim=0)[rank].clone().requires_grad_(True)
        if side == "megatron":
            logits = head(hidden)[0].transpose(0, 1).contiguous()  # [B, S, V / tp]
            lp = -vocab_parallel_cross_entropy(logits.float().clone(), labels)
            ent = _entropy_full(logits)
        else:
            lp, ent = gm.linear_logprobs(hidden, head, labels, return_entropy=True)
        ((w_lp * lp).sum() + (w_ent * ent).sum()).backward()
        results[side] = (lp.detach(), ent.detach(), hidden.grad.clone(), head.weight.grad.clone())
        head.weight.grad = None
    names = ("lp", "ent", "grad_hidden", "grad_weight")
    return {name: (results["library"][i], results["megatron"][i]) for i, name in enumerate(names)}


def _checks(rank: int) -> dict:
    return {
        "fp32": _model_case(tied=False, dtype=torch.float32),
        "fp32_tied": _model_case(tied=True, dtype=torch.float32),
        "bf16": _model_case(tied=False, dtype=torch.bfloat16),
        "temperature": _temperature_case(),
        "sequence_parallel": _sequence_parallel_case(),
    }


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_checks, world=2, tp=2)


def _assert_close(pair, tol, name):
    got, want = pair
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = rel_err(got.double(), want.double())
    assert err < tol, f"{name}: relative error {err:.2e} (tolerance {tol:.0e})"


@pytest.mark.parametrize("case", ["fp32", "fp32_tied"])
def test_logprobs_entropy_and_gradients_match_megatron_on_a_gpt_model(ranks, case):
    for rank, result in enumerate(ranks):
        r = result[case]
        assert r["dtype"] == (torch.float32, torch.float32) and r["shape"] == (B, S)
        for name in ("lp", "ent", "grad_embedding") + (("grad_output_layer",) if case == "fp32" else ()):
            _assert_close(r[name], FP32_TOL, f"rank {rank} {case} {name}")
    # every tensor-parallel rank returns the same log-probs
    assert torch.equal(ranks[0][case]["lp"][0], ranks[1][case]["lp"][0])


def test_bf16_parameters_match_megatron_within_its_logits_rounding(ranks):
    for rank, result in enumerate(ranks):
        r = result["bf16"]
        # megatron rounds each logit to bf16 (relative 2^-9) before its fp32 log-softmax; the log-prob moves by at
        # most twice the largest logit's rounding. The library's fp32 accumulation is closer to the exact value.
        bound = 2 * r["max_logit"] * 2.0 ** -9 + 1e-5
        for name in ("lp", "ent"):
            got, want = r[name]
            assert (got - want).abs().max() <= bound, (rank, name, float((got - want).abs().max()), bound)
        # both backwards run the same bf16 model; the head's dlogits differ by the same rounding, and the bf16
        # gradients themselves are rounded to 2^-9 relative in each of the two layers' matmuls
        for name in ("grad_embedding", "grad_output_layer"):
            _assert_close(r[name], 3e-2, f"rank {rank} bf16 {name}")


def test_temperature_divides_megatron_logits(ranks):
    for rank, result in enumerate(ranks):
        _assert_close(result["temperature"]["lp"], FP32_TOL, f"rank {rank} temperature")


def test_sequence_parallel_head_gathers_and_reduce_scatters_like_megatron(ranks):
    for rank, result in enumerate(ranks):
        for name, pair in result["sequence_parallel"].items():
            _assert_close(pair, FP32_TOL, f"rank {rank} sequence parallel {name}")
