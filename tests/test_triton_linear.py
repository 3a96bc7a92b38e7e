"""Triton hidden-state path (``gspo_kernels/backends/triton/linear_*.py``) against float64 math.

On machines without CUDA the kernels run in the Triton interpreter (conftest sets ``TRITON_INTERPRET=1``)
with the small interpreter block sizes (16 rows x 32 vocabulary x 16 hidden), so every shape below spans
several row, vocabulary and hidden tiles with ragged last tiles. The interpreter's ``tl.dot`` is wrong
for bf16 operands (docs/kernels.md): the kernels then upcast their dot operands to fp32 (the ``UPCAST``
constexpr), so the bf16 tests here check the bf16 loads/stores and roundings, not bf16 tensor cores.

Tolerances: fp32 within 1e-5 relative to the largest reference entry (logp, entropy, dH, dW, dbias,
loss, metrics). fp16/bf16: the error must not exceed the plain half-precision PyTorch path's error
(half matmul, half log_softmax, half autograd) plus one rounding of the output dtype (2^-11 fp16, 2^-8 bf16).
"""

import os
import subprocess
import sys

import pytest
import torch

from gspo_kernels import backends
from gspo_kernels.backends.triton.autograd import linear_logprobs
from gspo_kernels.backends.triton.linear_forward import linear_logprobs_forward
from tests.cases import assert_zero_rows_get_zero_dh, check_against_reference, configs, linear_loss_vs_reference

RTOL = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0


def float64_math(hidden, weight, bias, labels, temperature, g_logp, g_ent):
    """logp, entropy and the gradients of ``sum(g_logp * logp + g_ent * entropy)``, all in float64."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    b = None if bias is None else bias.detach().double().requires_grad_()
    z = h.reshape(-1, h.shape[-1]) @ w.T
    if b is not None:
        z = z + b
    logp_all = (z / temperature).log_softmax(-1)
    logp = logp_all.gather(1, labels.reshape(-1, 1))[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (logp * g_logp.double() + entropy * g_ent.double()).sum().backward()
    return logp, entropy, h.grad, w.grad, (None if b is None else b.grad)


def make_hidden(layout, N_or_BT, H, dtype):
    """hidden in one of three layouts: contiguous [N, H], a strided [B, T, H] view, a row-strided [N, H]."""
    if layout == "rows":
        return torch.randn(N_or_BT[0] * N_or_BT[1], H, dtype=dtype)
    if layout == "batch_view":  # [B, T, H] = big[:, 1:] : B and T cannot be merged into one stride
        B, T = N_or_BT
        return torch.randn(B, T + 1, H, dtype=dtype)[:, 1:]
    big = torch.randn(N_or_BT[0] * N_or_BT[1], H + 5, dtype=dtype)  # row stride H + 5
    return big[:, 2 : 2 + H]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("H", [37, 32], ids=["H37", "H32"])
@pytest.mark.parametrize("layout,with_bias,temperature", [
    ("rows", True, 0.7),
    ("batch_view", False, 1.0),
    ("row_strided", True, 1.3),
])
def test_fp32_forward_backward(layout, with_bias, temperature, H, deterministic):
    B, T, V = 3, 11, 101  # N = 33 rows (3 row tiles), V = 101 (4 vocabulary tiles, last partial)
    hidden = make_hidden(layout, (B, T), H, torch.float32)
    weight = torch.randn(V, H) * 0.3
    bias = torch.randn(V) * 0.5 if with_bias else None
    N = B * T
    labels = torch.randint(0, V, (N,))
    g_logp, g_ent = torch.randn(N), torch.randn(N)
    g_logp[::3] = 0  # every third row carries no gradient at all
    g_ent[::3] = 0
    g_ent[1::3] = 0  # and some only through logp
    h = hidden.clone().requires_grad_() if layout == "rows" else hidden.requires_grad_()
    w, b = weight.clone().requires_grad_(), None if bias is None else bias.clone().requires_grad_()
    logp, entropy = linear_logprobs(h, w, b, labels, temperature=temperature, return_entropy=True,
                                    deterministic=deterministic)
    grads = torch.autograd.grad((logp * g_logp + entropy * g_ent).sum(), [t for t in (h, w, b) if t is not None])
    ref = float64_math(hidden, weight, bias, labels, temperature, g_logp, g_ent)
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32
    assert rel_err(logp, ref[0]) < RTOL
    assert rel_err(entropy, ref[1]) < RTOL
    assert grads[0].shape == hidden.shape
    for got, want in zip(grads, [g for g in ref[2:] if g is not None]):
        assert rel_err(got, want) < RTOL
    dh = grads[0].reshape(N, H)
    assert torch.all(dh[::3] == 0), "rows without gradient must get exactly zero dH"
    assert bool((dh[1::3] != 0).any())


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_vocabulary_splits_combine(num_splits):
    """The per-split partial statistics combine to the same log-probs for any number of splits."""
    N, H, V = 20, 16, 211
    hidden, weight = torch.randn(N, H), torch.randn(V, H)
    rows = torch.arange(N)
    labels = torch.randint(0, V, (N,))
    logp, entropy, lse = linear_logprobs_forward(hidden, weight, None, rows, labels, 1.0, num_splits=num_splits)
    z = hidden.double() @ weight.double().T
    assert rel_err(lse, z.logsumexp(-1)) < RTOL
    assert rel_err(logp, z.log_softmax(-1).gather(1, labels[:, None])[:, 0]) < RTOL
    assert rel_err(entropy, -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)) < RTOL


def test_active_rows_and_empty():
    N, H, V = 29, 24, 70
    hidden, weight = torch.randn(N, H).requires_grad_(), torch.randn(V, H).requires_grad_()
    labels = torch.randint(0, V, (N,))
    active = torch.rand(N) > 0.4
    poisoned = torch.full((N,), float("nan"))
    logp, _ = linear_logprobs(hidden, weight, None, labels, active=active)
    assert torch.all(logp[~active] == 0)
    ref = float64_math(hidden, weight, None, labels, 1.0, active.float(), torch.zeros(N))
    assert rel_err(logp[active], ref[0][active]) < RTOL
    logp.sum().backward()
    assert torch.all(hidden.grad[~active] == 0)
    assert rel_err(hidden.grad, ref[2]) < RTOL and rel_err(weight.grad, ref[3]) < RTOL
    # no active row at all: zeros, and zero gradients (no NaN from an empty launch)
    hidden.grad = weight.grad = None
    logp, entropy = linear_logprobs(hidden, weight, None, labels, active=torch.zeros(N, dtype=torch.bool),
                                    return_entropy=True)
    assert torch.all(logp == 0) and torch.all(entropy == 0)
    (logp * poisoned.nan_to_num(1.0)).sum().backward()
    assert torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)


def test_deterministic_default_follows_torch(monkeypatch):
    """``deterministic=None`` picks the atomic-free kernels when torch's deterministic mode is on."""
    from gspo_kernels.backends.triton import autograd as linear_function

    seen = []
    real = linear_function.linear_logprobs_backward

    def spy(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return real(*args, **kwargs)

    monkeypatch.setattr(linear_function, "linear_logprobs_backward", spy)
    hidden, weight = torch.randn(5, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    labels = torch.randint(0, 40, (5,))
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        for mode in (False, True):
            torch.use_deterministic_algorithms(mode)
            linear_logprobs(hidden, weight, None, labels)[0].sum().backward()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert seen == [False, True]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_no_worse_than_plain_pytorch(dtype):
    B, T, H, V = 2, 12, 48, 300
    hidden = torch.randn(B, T, H).to(dtype)
    weight = (torch.randn(V, H) * 0.2).to(dtype)
    bias = (torch.randn(V) * 0.3).to(dtype)
    N = B * T
    labels = torch.randint(0, V, (N,))
    g_logp, g_ent = torch.randn(N), torch.randn(N) * 0.1
    g_logp[::4] = 0
    g_ent[::4] = 0
    ref = float64_math(hidden, weight, bias, labels, 0.9, g_logp, g_ent)
    margin = 2**-11 if dtype == torch.float16 else 2**-8

    # the plain half-precision PyTorch path: half matmul, half log_softmax, autograd in half
    ph, pw, pb = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    plain_all = ((ph.reshape(N, H) @ pw.T + pb) / 0.9).log_softmax(-1)
    plain_logp = plain_all.gather(1, labels[:, None])[:, 0].float()
    plain_ent = -(plain_all.exp() * plain_all).sum(-1).float()
    plain_grads = torch.autograd.grad((plain_logp * g_logp + plain_ent * g_ent).sum(), (ph, pw, pb))

    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    logp, entropy = linear_logprobs(h, w, b, labels, temperature=0.9, return_entropy=True)
    grads = torch.autograd.grad((logp * g_logp + entropy * g_ent).sum(), (h, w, b))
    assert logp.dtype == torch.float32
    assert rel_err(logp, ref[0]) <= rel_err(plain_logp, ref[0]) + margin
    assert rel_err(entropy, ref[1]) <= rel_err(plain_ent, ref[1]) + margin
    for got, plain, want in zip(grads, plain_grads, ref[2:]):
        assert got.dtype == dtype
        assert rel_err(got, want) <= rel_err(plain, want) + margin
    assert torch.all(grads[0].reshape(N, H)[::4] == 0)


def test_gradient_filtering_error_is_bounded():
    """Filtering (off by default) drops tiles whose softmax entries are all below ``filter_eps``.

    Confident rows (labels among the first 8 tokens, hidden aligned with the label's weight row) make
    most tiles negligible. Measured with this seed: relative dH/dW error vs float64 of 3e-3 at
    filter_eps = 2^-10 and 5e-4 at 2^-13 (about 4 * filter_eps), against 3e-6 for the exact path.
    The test asserts error < 8 * filter_eps, and that the filter really dropped something.
    """
    torch.manual_seed(0)
    N, H, V = 24, 16, 320
    weight = torch.randn(V, H)
    labels = torch.randint(0, 8, (N,))
    hidden = 1.5 * weight[labels] + 0.3 * torch.randn(N, H)
    g_logp = torch.randn(N)
    ref = float64_math(hidden, weight, None, labels, 1.0, g_logp, torch.zeros(N))
    errors = {}
    for eps in (None, 2.0**-13):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, _ = linear_logprobs(h, w, None, labels, filter_eps=eps)
        dh, dw = torch.autograd.grad((logp * g_logp).sum(), (h, w))
        errors[eps] = (rel_err(dh, ref[2]), rel_err(dw, ref[3]))
    assert max(errors[None]) < RTOL
    filtered = max(errors[2.0**-13])
    assert filtered > 10 * max(errors[None]), "the filter dropped nothing: the test would not see an error"
    assert filtered < 8 * 2.0**-13, errors


def triton_backend_or_skip():
    if backends.load("triton") is None:
        pytest.skip(f"backend 'triton' unavailable: {backends.unavailable_reason('triton')}")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("config", configs(), ids=lambda c: f"{c.importance_sampling_level}-{c.loss_type}")
def test_fused_linear_gspo_loss_triton_fp32(config, packed):
    triton_backend_or_skip()
    out, expected, grads, ref_grads = linear_loss_vs_reference("triton", config, packed)
    check_against_reference(out, expected, grads, ref_grads)
    assert_zero_rows_get_zero_dh(config, grads, ref_grads)


_STATIC_CHECK = r"""
import os, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gspo_kernels.tools import h100_report
from gspo_kernels.backends.triton import linear_forward as linear_logprobs, linear_backward as linear_logprobs_backward
for cfg in linear_logprobs.H100_CONFIGS + linear_logprobs_backward.H100_CONFIGS:
    fn = cfg["fn"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in cfg["aligned"]}
    k = triton.compile(ASTSource(fn, cfg["signature"], cfg["constexprs"], attrs), target=GPUTarget(*h100_report.TARGET),
                       options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        open(path, "wb").write(k.asm["cubin"])
        run = lambda flag: subprocess.run([h100_report._cuobjdump(), flag, path], check=True, capture_output=True,
                                          text=True).stdout
        usage, sass = h100_report._resource_usage(run("--dump-resource-usage")), run("--dump-sass")
    print(cfg["name"], usage["REG"], usage.get("STACK", 0), usage.get("LOCAL", 0), sass.count("STL"),
          int("HGMMA" in sass or not cfg["uses_dot"]), k.metadata.shared)
"""


def test_h100_static_report_linear_kernels():
    """sm_90a compile of every launch configuration: no spills (LOCAL, stack frame, STL), HGMMA present,
    and shared memory within the H100's 227 KB per block (a larger request fails only at launch).

    ptxas places register spills in the stack frame: ``LOCAL`` in cuobjdump's resource line stays 0 while
    ``STACK`` > 0 and the SASS holds ``STL`` stores, so all three are checked.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _STATIC_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()]
    assert len(rows) == 10  # 6 bf16 configurations (HGMMA required) + 4 fp32 ones (exact FMA products)
    for name, regs, stack, local, stl, hgmma, smem in rows:
        assert int(local) == 0 and int(stack) == 0 and int(stl) == 0, f"{name} spills ({regs} registers)"
        assert int(hgmma) == 1, f"{name} calls tl.dot but its SASS has no HGMMA"
        assert int(smem) <= 227 * 1024, f"{name} needs {smem} B of shared memory (H100: 227 KB per block)"


@pytest.mark.gpu
def test_deterministic_backward_is_bitwise_repeatable():
    torch.manual_seed(0)
    N, H, V = 1000, 512, 5003
    hidden = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(V, H, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (N,), device="cuda")
    g = torch.randn(N, device="cuda")
    runs = []
    for _ in range(2):
        logp, _ = linear_logprobs(hidden, weight, None, labels, deterministic=True)
        runs.append(torch.autograd.grad((logp * g).sum(), (hidden, weight)))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
