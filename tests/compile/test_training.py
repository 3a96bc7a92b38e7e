"""Compiled training: a hand-written step (a tiny Hugging Face model's backbone + ``fused_linear_gspo_loss``)
compiles whole with no graph break on every backend, and ``GSPOTrainer(compile=...)`` trains as the eager one."""

from __future__ import annotations

import copy

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.backends import BACKENDS as ALL_BACKENDS
from gspo_kernels.train import GSPOTrainer, GSPOTrainerConfig
from tests.support import device_for
from tests.train.hf_models import tiny_model, word_tokenizer

BACKENDS = [b for b in ALL_BACKENDS if b in gk.available_backends(device_for(b))]
CONFIG = gk.GSPOConfig(importance_sampling_level="token", loss_type="dapo", beta=0.04)


def _step_inputs(vocab: int, device: str):
    g = torch.Generator().manual_seed(0)
    B, T = 3, 7
    ids = torch.randint(3, vocab, (B, T + 1), generator=g)
    mask = torch.ones(B, T)
    mask[1, 5:] = 0
    t = dict(ids=ids, labels=ids[:, 1:].contiguous(), adv=torch.randn(B, generator=g), mask=mask,
             old=-2.5 + 0.1 * torch.randn(B, T, generator=g), ref=-2.5 + 0.1 * torch.randn(B, T, generator=g))
    return {k: v.to(device) for k, v in t.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_written_step_compiles_with_no_graph_break(backend):
    """``torch._dynamo.explain`` of the step: one graph, zero breaks, on every backend; the compiled step
    (``fullgraph=True``, forward and backward; backend ``cpu``) gives the eager loss and gradients to fp32 rounding."""
    tok = word_tokenizer()
    model = tiny_model("qwen3", tok).to(device_for(backend))
    t = _step_inputs(len(tok), device_for(backend))

    def step(ids, labels, adv, old, ref, mask):
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
        return gk.fused_linear_gspo_loss(hidden, model.get_output_embeddings().weight, labels, adv, old, mask=mask,
                                         ref_logprobs=ref, num_items_in_batch=12, config=CONFIG,
                                         backend=backend).loss

    args = (t["ids"], t["labels"], t["adv"], t["old"], t["ref"], t["mask"])
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    if backend != "cpu":  # the compiled step against eager: once (each backend's loss is compared in test_compile.py)
        return
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        model.zero_grad()
        loss = fn(*args)
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-6)


def test_trainer_compile_option_trains_as_the_eager_trainer():
    """A step (two mini-batches: two optimizer updates) of ``GSPOTrainer(compile={"backend": "aot_eager", "fullgraph": True})`` (the backbone and the
    loss compiled together; packed mini-batches) against the same trainer eager: the same metrics and weights to
    fp32 rounding; a bad ``compile`` option is refused naming it."""
    tok = word_tokenizer()
    base = tiny_model("qwen3", tok)
    options = dict(learning_rate=3e-3, group_size=3, max_new_tokens=4, num_minibatches=2, backend="torch",
                   importance_sampling_level="token", loss_type="dapo", max_grad_norm=None)
    runs = []
    for compile_option in (False, {"backend": "aot_eager", "fullgraph": True}):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        trainer = GSPOTrainer(model, tok, GSPOTrainerConfig(compile=compile_option, **options))
        metrics = [trainer.train_step(["3 + 4 =", "9 ="], lambda p, c: [float(len(x)) for x in c])]
        runs.append((metrics, [p.detach().clone() for p in model.parameters()]))
    (m_eager, w_eager), (m_comp, w_comp) = runs
    assert {"loss", "importance_weight/mean", "grad_norm"} <= set(m_eager[0])
    for a, b in zip(m_eager, m_comp):
        assert a.keys() == b.keys()
        for k in (k for k in a if not (k.endswith("_s") or "per_s" in k)):  # not the clocks
            assert abs(a[k] - b[k]) <= 1e-5 * (1 + abs(a[k])), (k, a[k], b[k])
    for a, b in zip(w_eager, w_comp):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="compile must be a bool or a dict"):
        GSPOTrainerConfig(compile="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_compiled_step_replays_as_cuda_graphs(backend):
    """``torch.compile(mode="reduce-overhead")`` (inductor, CUDA graphs) of a loss step, forward and backward, replayed
    on fresh inputs of one shape: each replay equals eager (fp32 rounding: inductor fuses the PyTorch parts). GPU only
    (``gpu-check``'s gpu-tests step runs it); never ran on this project's CPU machines."""
    torch._dynamo.reset()
    V, H, B, T = 1000, 64, 4, 33

    def step(hidden, weight, labels, adv, old, mask):
        return gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, config=CONFIG,
                                         ref_logprobs=old, backend=backend).loss

    def with_grads(fn, *args):
        loss = fn(*args)
        return (loss.detach().clone(), *torch.autograd.grad(loss, args[:2]))

    gk.available_backends("cuda")  # loaded before compiling
    compiled = torch.compile(step, mode="reduce-overhead")
    for _ in range(4):  # the first calls record, the later ones replay
        hidden = torch.randn(B, T, H, device="cuda", requires_grad=True)
        weight = (0.1 * torch.randn(V, H, device="cuda")).requires_grad_()
        args = (hidden, weight, torch.randint(0, V, (B, T), device="cuda"), torch.randn(B, device="cuda"),
                -6.9 + 0.1 * torch.randn(B, T, device="cuda"), (torch.rand(B, T, device="cuda") > 0.2).float())
        for comp, eager in zip(with_grads(compiled, *args), with_grads(step, *args)):
            torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-6)
