"""The two-pass hidden-state backward over slices of the vocabulary (``backend="triton"``, vendor GEMMs): taken when
the rows are few against the vocabulary (``V >= 4 N``, an RL micro-batch against a 150k vocabulary), it casts the
lm_head slice by slice instead of keeping the precision policy's whole-head copy, writes each ``dW`` slice once and
accumulates ``dH`` in fp32. Every gradient is compared with float64 autograd on fresh random inputs; the memory it
holds is counted by benchmarks/memory_trace.py against bytes worked out by hand."""

from __future__ import annotations

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import backends
from gspo_kernels.options import CallOptions
from gspo_kernels.testing import gradient_tolerance
from tests.support import RTOL, TRITON_DEVICE, rel_err

pytestmark = pytest.mark.skipif(backends.load("triton") is None or not backends.load("triton").supports(
    torch.device(TRITON_DEVICE)), reason="triton backend unavailable here")

NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
         torch.float64: "fp32"}  # fp64: held to the fp32 bound


def _narrow_slices(monkeypatch, columns: int) -> None:
    """Slices of ``columns`` columns (and passes of fewer rows when the budget says so) at test sizes."""
    from gspo_kernels.backends.triton import configs

    monkeypatch.setattr(configs, "VOCAB_SLICE_MULTIPLE", 1)
    monkeypatch.setattr(configs, "VOCAB_SLICE_MIN_COLUMNS", columns)
    monkeypatch.setattr(configs, "VOCAB_SLICE_MAX_COLUMNS", columns)
    monkeypatch.setattr(configs, "GEMM_ROW_MULTIPLE", 1)
    monkeypatch.setattr(configs, "GEMM_MIN_CHUNK_ROWS", 1)


def _float64_gradients(hidden, weight, bias, labels, active, grad_logp, grad_entropy, temperature, softcap):
    """``d/d(hidden, weight, bias)`` of ``sum(grad_logp * logp + grad_entropy * entropy)`` over the active rows,
    in float64 autograd from the same (rounded) inputs."""
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    h = leaves[0][active]
    z = h @ leaves[1].t() + (leaves[2] if bias is not None else 0.0)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = (z / temperature).log_softmax(-1)
    logp = log_p.gather(-1, labels[active][:, None])[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    total = (grad_logp[active].double() * logp).sum() + (grad_entropy[active].double() * entropy).sum()
    return torch.autograd.grad(total, leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("columns,budget_rows", [(None, None), (13, None), (13, 4)],
                         ids=["one-slice", "slices", "slices-and-row-passes"])
@pytest.mark.parametrize("with_bias,softcap", [(False, None), (True, None), (True, 4.0)], ids=["plain", "bias", "softcap"])
def test_sliced_backward_against_float64(monkeypatch, dtype, columns, budget_rows, with_bias, softcap):
    """Gradients of the log-probs and entropies (both incoming gradients nonzero, one row without either, one
    inactive row holding NaN) within the hidden-state path's tolerance of float64, whether the vocabulary is one
    slice, several (13 columns: a ragged last one), or several with passes of 4 rows (the budget)."""
    N, H, V = 9, 16, 61  # V >= 4 N: the sliced backward
    budget = None
    if columns is not None:
        _narrow_slices(monkeypatch, columns)
        per = {torch.float32: 4, torch.bfloat16: 6, torch.float16: 6, torch.float64: 8}[dtype]
        budget = (budget_rows or N) * columns * per
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(N, H, generator=g).to(TRITON_DEVICE, dtype)
    hidden[5] = float("nan")  # an inactive row's garbage must not reach dW
    hidden.requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(TRITON_DEVICE, dtype).requires_grad_()
    bias = (torch.randn(V, generator=g) * 0.5).to(TRITON_DEVICE, dtype).requires_grad_() if with_bias else None
    labels = torch.randint(0, V, (N,), generator=g).to(TRITON_DEVICE)
    labels[0], labels[1] = 0, V - 1  # the first and last columns (first and ragged last slice)
    active = torch.ones(N, dtype=torch.bool, device=TRITON_DEVICE)
    active[5] = False
    grad_logp = torch.randn(N, generator=g).to(TRITON_DEVICE)
    grad_entropy = torch.randn(N, generator=g).to(TRITON_DEVICE)
    grad_logp[3] = grad_entropy[3] = 0.0  # a row without gradient: a zero dZ row
    temperature = 0.7
    logp, entropy = backends.load("triton").linear_logprobs(hidden, weight, bias, labels, active=active, options=CallOptions(return_entropy=True, temperature=temperature, memory_budget=budget, softcap=softcap))
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    got = torch.autograd.grad((logp * grad_logp).sum() + (entropy * grad_entropy).sum(), leaves)
    want = _float64_gradients(hidden, weight, bias, labels, active, grad_logp, grad_entropy, temperature, softcap)
    tol = gradient_tolerance(NAMES[dtype], "linear")
    for name, a, b in zip(("dH", "dW", "dB"), got, want):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        assert rel_err(a, b) < tol, (name, rel_err(a, b), tol)
    assert (got[0][5] == 0).all()  # the inactive row


def test_the_rows_decide_the_route():
    """Sliced exactly when ``V >= 4 N``; and the sizes: every row in one pass at the client's shape, slices within
    ``[2048, 8192]`` columns, the buffers within the budget (exactly as given), rows cut only under a small one."""
    from gspo_kernels.backends.triton import configs

    assert configs.vocab_sliced(8192, 151936) and configs.vocab_sliced(37984, 151936)
    assert not configs.vocab_sliced(37985, 151936) and not configs.vocab_sliced(30, 37)
    bf16, fp32 = torch.bfloat16, torch.float32
    r, s = configs.vocab_slice_sizes(8192, 151936, bf16, None)  # 256 MiB over 8192 rows of 6 bytes a column
    assert (r, s) == (8192, 5376) and r * s * 6 <= configs.VOCAB_SLICE_BUDGET
    assert configs.vocab_slice_sizes(1024, 151936, bf16, None) == (1024, 8192)  # the widest slice
    r, s = configs.vocab_slice_sizes(32768, 151936, bf16, None)  # the narrowest slice, fewer rows
    assert s == 2048 and r == (256 << 20) // (2048 * 6) // 16 * 16 and r < 32768
    for budget in (1 << 24, 3 << 26, 1 << 30):
        r, s = configs.vocab_slice_sizes(16384, 151936, fp32, budget)  # fp32 operands: dZ over the logits
        assert r * s * 4 <= budget and (r == 16384 or s == 2048)
    assert configs.vocab_slice_sizes(16, 1000, bf16, 1) == (16, 1000)  # the minimums, and never more than V


def test_the_vocabulary_window_of_the_backward_kernel():
    """``logprobs_backward(vocab_window=(offset, total))`` on columns ``[offset, offset + S)`` of rows whose stats
    are the whole rows': the same values as those columns of the whole rows' gradient (the label's one-hot only in
    the window that holds it); a label outside ``[0, total)`` poisons its row (NaN), as on whole rows."""
    from gspo_kernels.backends.triton.logits import logprobs_backward, logprobs_forward

    g = torch.Generator().manual_seed(5)
    N, V = 6, 50
    z = torch.randn(N, V, generator=g).to(TRITON_DEVICE)
    labels = torch.tensor([0, 10, 19, 20, 49, 33], device=TRITON_DEVICE)
    gl, ge = torch.randn(N, generator=g).to(TRITON_DEVICE), torch.randn(N, generator=g).to(TRITON_DEVICE)
    _, entropy, stats = logprobs_forward(z, labels, return_entropy=True)
    whole = logprobs_backward(z.clone(), labels, stats, entropy, gl, ge)
    for offset, width in ((0, 20), (20, 20), (40, 10)):
        part = logprobs_backward(z[:, offset:offset + width].contiguous(), labels, stats, entropy, gl, ge,
                                 vocab_window=(offset, V))
        assert rel_err(part, whole[:, offset:offset + width]) < RTOL, offset
    bad = labels.clone()
    bad[2] = V  # out of the vocabulary: not merely out of the window
    part = logprobs_backward(z[:, :20].contiguous(), bad, stats, entropy, gl, ge, vocab_window=(0, V))
    assert torch.isnan(part[2]).all() and torch.isfinite(part[[0, 1, 3, 4, 5]]).all()


def test_no_whole_head_copy_lives_through_the_backward(monkeypatch):
    """Under bf16 autocast on an fp32 head (the TRL drop-in's route), alive at the backward's peak: the fp32 dW
    (4 V H), one bf16 head slice (2 S H), the buffers (R S fp32 logits, R S bf16 dZ), the fp32 dH (4 N H), the
    masked bf16 hidden rows and the hidden states' bf16 copy (2 N H each), [N] vectors (under 64 bytes a row):
    nothing [V, H] in bf16."""
    from benchmarks.memory_trace import MemoryTrace, as_on_cuda

    N, H, V, S = 32, 64, 1024, 128
    _narrow_slices(monkeypatch, S)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(TRITON_DEVICE).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / 8).to(TRITON_DEVICE).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g).to(TRITON_DEVICE)
    trace = MemoryTrace(stack_depth=3)
    with as_on_cuda(trace, trl=False), trace:  # the forward too: what it keeps for the backward is counted
        with torch.autocast(torch.device(TRITON_DEVICE).type, dtype=torch.bfloat16):
            logp, entropy = gk.linear_logprobs(hidden, weight, labels, backend="triton", return_entropy=True,
                                               memory_budget=N * S * 6)
        loss = (logp * torch.linspace(-1, 1, N, device=TRITON_DEVICE)).sum() + 0.1 * entropy.sum()
        loss.backward()
    bound = 4 * V * H + 2 * S * H + 6 * N * S + 4 * N * H + 2 * 2 * N * H + 64 * N
    assert trace.peak_bytes <= bound, trace.report(min_bytes=0)
    assert trace.peak_bytes > 4 * V * H + 6 * N * S  # the buffers were counted
    assert not [r for r in trace.peak_live.values() if r.shape == (V, H) and r.dtype == torch.bfloat16], trace.report()
    assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    want = _float64_gradients(hidden.bfloat16(), weight.bfloat16(), None, labels,
                              torch.ones(N, dtype=torch.bool, device=TRITON_DEVICE),
                              torch.linspace(-1, 1, N, device=TRITON_DEVICE), torch.full((N,), 0.1, device=TRITON_DEVICE),
                              1.0, None)
    tol = gradient_tolerance("bf16", "linear")  # bf16 operands; the fp32 gradients hold the bf16 dZ's rounding
    assert rel_err(hidden.grad, want[0]) < tol and rel_err(weight.grad, want[1]) < tol


def test_the_sliced_backward_reads_nothing_back(monkeypatch):
    """Nothing in the sliced backward waits on the device: no ``.item()``, ``.tolist()``, ``nonzero``, ``bool()``
    of a tensor from the backward's start to its gradients (slices and row passes on the host from shapes alone)."""
    from tests.support import record_host_reads

    N, H, V = 8, 16, 96
    _narrow_slices(monkeypatch, 40)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(N, H, generator=g).to(TRITON_DEVICE).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(TRITON_DEVICE).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g).to(TRITON_DEVICE)
    logp, entropy = gk.linear_logprobs(hidden, weight, labels, backend="triton", return_entropy=True,
                                       memory_budget=4 * 40 * 4)  # 3 slices, 2 passes of 4 rows
    loss = logp.sum() + 0.5 * entropy.sum()
    reads = record_host_reads(monkeypatch)
    loss.backward()
    assert reads == []
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
