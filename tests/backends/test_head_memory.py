"""What the lm_head's backward holds at its peak (the TRL drop-in's default route: ``linear_logprobs`` under bf16
autocast on an fp32 head), counted by benchmarks/memory_trace.py against byte counts worked out by hand.

The tensors are on ``tests.support.TRITON_DEVICE``: CUDA where it exists (the compiled kernels), else the CPU,
where the Triton backend runs in the interpreter (conftest sets ``TRITON_INTERPRET=1``) and its torch buffers are
those of a CUDA run, except the fp32 copies the CPU stand-ins of the half-precision GEMMs make (``chunk_logits`` /
``accumulate_dw``: on CUDA one GEMM writes fp32 into the given tensor), which are not counted.
"""

import contextlib

import pytest
import torch

import gspo_kernels
from benchmarks.memory_trace import MemoryTrace, as_on_cuda
from tests.support import TRITON_DEVICE

N, H, V = 256, 64, 320
ROWS = 16  # the two-pass backward's logits rows for the budget below (its dZ store: 4 x ROWS bf16 rows)
BUDGET = ROWS * V * (4 + 4 * 2)


@contextlib.contextmanager
def traced_as_on_cuda():
    trace = MemoryTrace(stack_depth=3)
    with as_on_cuda(trace, trl=False), trace:
        yield trace


def _head(hidden_dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(TRITON_DEVICE, hidden_dtype).requires_grad_()
    # fp32: autocast gives the GEMMs a bf16 copy
    weight = (torch.randn(V, H, generator=g) / 8).to(TRITON_DEVICE).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g).to(TRITON_DEVICE)
    with torch.autocast(torch.device(TRITON_DEVICE).type, dtype=torch.bfloat16):
        logp, entropy = gspo_kernels.linear_logprobs(hidden, weight, labels, backend="triton", return_entropy=True,
                                                     memory_budget=BUDGET)
    loss = (logp * torch.linspace(-1, 1, N, device=TRITON_DEVICE)).sum() + 0.1 * entropy.sum()
    return hidden, weight, loss


def test_the_backward_frees_its_chunk_buffers_before_casting_dh_to_the_hiddens_dtype():
    """Alive at once in the backward, at most: the fp32 dW (4 V H), the chunk buffers (ROWS fp32 logits rows and
    4 ROWS bf16 dZ rows: the budget), dH in the operand dtype (2 N H), or, after the loop, dW, dH and its fp32 copy
    for the fp32 hidden state (4 N H) without the buffers, plus [N]-sized vectors (masks, incoming gradients:
    under 64 bytes a row). Holding the buffers through the cast (the code before) adds them to the second sum."""
    hidden, weight, loss = _head()
    with traced_as_on_cuda() as trace:
        loss.backward()
    dw, buffers, dh16, dh32 = 4 * V * H, BUDGET, 2 * N * H, 4 * N * H
    bound = max(dw + buffers + dh16, dw + dh16 + dh32) + 64 * N
    assert trace.peak_bytes <= bound, trace.report(min_bytes=0)
    assert trace.peak_bytes > dw + buffers  # the buffers were counted: the bound is not met by counting nothing
    assert sum(trace.uncounted.values()) == 0
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    # the gradient the backward returns for the fp32 head is its fp32 accumulator itself: no copy in .grad
    grads = [r for r in trace.peak_live.values() if r.shape == (V, H)]
    assert [(r.dtype, r.bytes) for r in grads] == [(torch.float32, dw)], trace.report()


def test_a_bf16_hidden_state_gets_its_gradient_without_a_copy():
    """A bf16 hidden state (a bf16 backbone under autocast): dH is returned as made, nothing N x H beside it."""
    hidden, weight, loss = _head(torch.bfloat16)
    with traced_as_on_cuda() as trace:
        loss.backward()
    assert trace.peak_bytes <= 4 * V * H + BUDGET + 2 * N * H + 64 * N, trace.report()
    assert hidden.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_memory_trace_refuses_a_bad_stack_depth(bad):
    with pytest.raises(ValueError, match="stack_depth"):
        MemoryTrace(stack_depth=bad)


def test_the_trl_drop_in_step_holds_at_its_peak_what_the_formula_says(monkeypatch):
    """The drop-in's default route, one loss step of benchmarks/trl_step.py's tiny shape (V = 512, H = 64, 2 x 16
    completion tokens: V >= 4 N, the vocabulary-sliced backward) under bf16 autocast: the lm_head's share of the
    peak, by hand (docs/trl.md's formula) with slices of 128 columns and a budget of all 32 rows of them."""
    import trl  # noqa: F401  (make test installs it: missing, this is an error, not a skip)

    from benchmarks.memory_trace import classify, trace_trl_step
    from gspo_kernels.backends.triton import configs

    v, h, n, s = 512, 64, 32, 128
    monkeypatch.setattr(configs, "VOCAB_SLICE_MIN_COLUMNS", s)
    monkeypatch.setattr(configs, "VOCAB_SLICE_MAX_COLUMNS", s)
    out = trace_trl_step("gspo", backend="triton", shape="tiny", memory_budget=n * s * (4 + 2), device=TRITON_DEVICE)
    parts = classify(out["components"])
    assert parts["lm_head dW (fp32 gradient)"] == 4 * v * h  # the .grad itself: no bf16 dW, no copy
    assert "bf16 copy of the lm_head" not in parts  # cast slice by slice in the backward: one slice alive
    assert parts["sliced: bf16 lm_head slice"] == 2 * s * h
    assert parts["sliced: logits buffer (fp32)"] == 4 * n * s
    assert parts["sliced: dZ buffer (bf16)"] == 2 * n * s
    assert parts["sliced: fp32 dH"] == 4 * n * h  # the hidden state is fp32: the accumulator is its gradient
    assert parts["hidden states' bf16 copy"] == parts["sliced: masked bf16 hidden rows"] == 2 * n * h
    assert "dH cast to the hidden state's fp32" not in parts
    assert out["uncounted"] == 0
