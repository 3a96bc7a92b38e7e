"""``integrations.megatron.enable`` / ``disable`` / ``capture`` on a tiny megatron ``GPTModel`` (2 gloo processes, TP=2)
against the same model unpatched.

One launch, each rank: the unpatched model's per-token cross entropy with labels and its gradients (a random weighting
of the ``[B, S]`` losses backpropagated: output-layer shard and word embedding); then, after ``enable``, the same call
(values and gradients), a call without labels (megatron's logits, bit for bit), ``capture``'s log-probs (minus the
loss) and entropies (against the entropy of the unpatched logits gathered by megatron), a model with tied
embeddings, and after ``disable`` megatron's own methods back (no instance attribute left).
"""

from __future__ import annotations

import pytest
import torch

from tests.integrations.megatron.harness import gpt_inputs, run_ranks, tiny_gpt
from tests.support import rel_err

V, B, S = 64, 2, 8
TOL = 1e-5  # fp32 on both sides (measured errors ~1e-7, see test_logprobs)


def _loss_and_grads(model, call, weights):
    loss = call()
    (loss * weights).sum().backward()
    grads = {"embedding": model.embedding.word_embeddings.weight.grad.clone()}
    if not model.share_embeddings_and_output_weights:
        grads["output_layer"] = model.output_layer.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _model_checks(tied: bool) -> dict:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from gspo_kernels.integrations import megatron as gm

    model = tiny_gpt(vocab=V, seq_len=S, tied=tied, seed=41)
    ids, pos, mask, labels = gpt_inputs(B, S, V, seed=42)
    weights = torch.randn(B, S, generator=torch.Generator().manual_seed(43))
    call = lambda: model(ids, pos, mask, labels=labels)  # noqa: E731
    ref_loss, ref_grads = _loss_and_grads(model, call, weights)
    with torch.no_grad():
        ref_logits = model(ids, pos, mask)
        full = torch.log_softmax(gather_from_tensor_model_parallel_region(ref_logits).float(), dim=-1)
        ref_entropy = -(full.exp() * full).sum(-1)

    gm.enable(model)
    out = {"patched": sorted(k for k in ("forward", "compute_language_model_loss") if k in model.__dict__)}
    loss, grads = _loss_and_grads(model, call, weights)
    out["loss"] = (loss, ref_loss)
    out["dtype"] = loss.dtype
    out.update({f"grad_{k}": (grads[k], ref_grads[k]) for k in ref_grads})
    with torch.no_grad():
        out["logits_equal"] = torch.equal(model(ids, pos, mask), ref_logits)
    with gm.capture(model) as got:
        captured_loss = call()
    out["capture_logprobs"] = (got.logprobs.detach(), -captured_loss.detach())
    out["capture_entropy"] = (got.entropy.detach(), ref_entropy)
    out["capture_records"] = len(got.records)
    gm.disable(model)
    out["left_after_disable"] = sorted(k for k in ("forward", "compute_language_model_loss", "_gspo_kernels_megatron")
                                       if k in model.__dict__) + \
        (["output_layer.forward"] if "forward" in model.output_layer.__dict__ else [])
    with torch.no_grad():
        out["after_disable"] = (model(ids, pos, mask, labels=labels), ref_loss)
    return out


def _checks(rank: int) -> dict:
    return {"untied": _model_checks(tied=False), "tied": _model_checks(tied=True)}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_checks, world=2, tp=2)


def _close(pair, name):
    got, want = pair
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = rel_err(got.double(), want.double())
    assert err < TOL, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("case", ["untied", "tied"])
def test_enabled_model_returns_megatrons_cross_entropy_and_gradients(ranks, case):
    for rank, result in enumerate(ranks):
        r = result[case]
        assert r["patched"] == ["compute_language_model_loss", "forward"]
        assert r["dtype"] == torch.float32
        for name in ("loss", "grad_embedding") + (("grad_output_layer",) if case == "untied" else ()):
            _close(r[name], f"rank {rank} {case} {name}")


@pytest.mark.parametrize("case", ["untied", "tied"])
def test_enabled_model_without_labels_returns_megatrons_logits(ranks, case):
    assert all(result[case]["logits_equal"] for result in ranks)


def test_capture_hands_over_logprobs_and_entropy_of_the_same_forward(ranks):
    for rank, result in enumerate(ranks):
        r = result["untied"]
        assert r["capture_records"] == 1
        assert torch.equal(*r["capture_logprobs"])
        _close(r["capture_entropy"], f"rank {rank} entropy")


@pytest.mark.parametrize("case", ["untied", "tied"])
def test_disable_restores_megatrons_methods(ranks, case):
    for rank, result in enumerate(ranks):
        r = result[case]
        assert r["left_after_disable"] == []
        _close(r["after_disable"], f"rank {rank} {case} loss after disable")
