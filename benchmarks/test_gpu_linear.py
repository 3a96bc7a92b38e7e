"""GPU benchmark of the Triton hidden-state path (``backend="triton"``, logits never formed).

Shape: N = 16384 tokens, H = 4096, V = 151936 (Qwen), bf16 hidden and lm_head weight.
FLOP formula: forward ``2 N H V`` (one GEMM), backward ``6 N H V`` (recompute + dH + dW), so a full
training step is ``8 N H V`` = 81.6 TFLOP here; TFLOP/s = 8 N H V / (forward + backward seconds).
The backward is also timed with 100 %, 50 % and 25 % of the rows carrying gradient (the others get
``grad_logp = 0``, as masked, clipped or zero-advantage tokens do); it should scale with the share.
Baselines when installed: TRL ``ChunkedLogProbFunction`` (same quantity: log-probs of hidden @ W.T),
Liger ``LigerFusedLinearGRPOLoss`` (sequence-level GRPO loss over hidden states) and Cut Cross-Entropy
``linear_cross_entropy`` (cross-entropy, the same 8NHV work).

Run on a CUDA machine: ``python -m pytest benchmarks/test_gpu_linear.py -s``. Every row prints the
device and versions; set ``GSPO_BENCH_JSON=path`` to also append the rows as JSON lines. On machines
without CUDA every test skips with a reason: these numbers were never measured there.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Optional

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU benchmark: no CUDA device here (never ran)"),
]

N, H, V = 16384, 4096, 151936
H100_BF16_TFLOPS = 790.0  # measured dense bf16 peak on this workplace's H100 (docs/kernels.md)


def step_flops(n: int = N, h: int = H, v: int = V) -> float:
    """Forward 2NHV + backward 6NHV."""
    return 8.0 * n * h * v


def versions() -> dict:
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__}
    for name in ("trl", "liger_kernel", "cut_cross_entropy"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # optional baselines
            out[name] = None
    return out


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def timed(fn: Callable[[], object], reps: int = 3, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` (synchronized)."""
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def report(**row) -> None:
    row.update(device=device_name(), **versions())
    print(json.dumps(row))
    path = os.environ.get("GSPO_BENCH_JSON")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def make_inputs(n: int = N, h: int = H, v: int = V, device: str = "cuda", dtype=torch.bfloat16):
    torch.manual_seed(0)
    hidden = (torch.randn(n, h, device=device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=device) * h**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), device=device)
    return hidden, weight, labels


def triton_step(hidden, weight, labels, grad_logp: torch.Tensor, deterministic: bool = False):
    """Forward seconds, backward seconds of the Triton path for one incoming gradient."""
    from gspo_kernels.backends.triton.autograd import linear_logprobs

    state = {}

    def fwd():
        state["logp"], _ = linear_logprobs(hidden, weight, None, labels, deterministic=deterministic)

    def bwd():
        fwd_out = state["logp"]
        torch.autograd.grad(fwd_out, (hidden, weight), grad_logp, retain_graph=True)

    t_fwd = timed(fwd)
    fwd()
    t_bwd = timed(bwd)
    return t_fwd, t_bwd


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_triton_forward_backward_tflops(deterministic):
    hidden, weight, labels = make_inputs()
    t_fwd, t_bwd = triton_step(hidden, weight, labels, torch.ones(N, device="cuda"), deterministic)
    tflops = step_flops() / (t_fwd + t_bwd) / 1e12
    report(impl=f"gspo_kernels triton ({'deterministic' if deterministic else 'atomic'})", N=N, H=H, V=V,
           dtype="bf16", fwd_ms=t_fwd * 1e3, bwd_ms=t_bwd * 1e3, tflops_8nhv=tflops,
           fwd_tflops_2nhv=2 * N * H * V / t_fwd / 1e12, bwd_tflops_6nhv=6 * N * H * V / t_bwd / 1e12,
           share_of_790=tflops / H100_BF16_TFLOPS)


def test_backward_scales_with_active_rows():
    hidden, weight, labels = make_inputs()
    times = {}
    for share in (1.0, 0.5, 0.25):
        g = torch.zeros(N, device="cuda")
        g[: int(N * share)] = 1.0
        g = g[torch.randperm(N, device="cuda")]  # active rows scattered through the batch
        _, times[share] = triton_step(hidden, weight, labels, g)
        report(impl="gspo_kernels triton backward", active_share=share, N=N, H=H, V=V, dtype="bf16",
               bwd_ms=times[share] * 1e3, bwd_tflops_6nhv_active=6 * N * share * H * V / times[share] / 1e12,
               ratio_to_full=times[share] / times.get(1.0, times[share]))


def test_baseline_trl_chunked_logprob():
    try:
        from trl.kernels import ChunkedLogProbFunction
    except Exception as exc:
        pytest.skip(f"TRL ChunkedLogProbFunction not importable: {exc}")
    hidden, weight, labels = make_inputs()
    state = {}

    def fwd():
        state["logp"] = ChunkedLogProbFunction.apply(hidden, weight, None, labels, 1.0, 4096, None, 1.0, ())[0]

    def bwd():
        torch.autograd.grad(state["logp"], (hidden, weight), torch.ones(N, device="cuda"), retain_graph=True)

    t_fwd = timed(fwd)
    fwd()
    t_bwd = timed(bwd)
    report(impl="trl ChunkedLogProbFunction", N=N, H=H, V=V, dtype="bf16", fwd_ms=t_fwd * 1e3, bwd_ms=t_bwd * 1e3,
           tflops_8nhv=step_flops() / (t_fwd + t_bwd) / 1e12)


def test_baseline_liger_fused_linear_grpo():
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as exc:
        pytest.skip(f"Liger LigerFusedLinearGRPOLoss not importable: {exc}")
    hidden, weight, labels = make_inputs()
    B, T = 16, N // 16
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, importance_sampling_level="sequence",
                                       loss_type="grpo", epsilon_low=3e-4, epsilon_high=4e-4)
    h3 = hidden.detach().view(B, T, H).requires_grad_()
    mask = torch.ones(B, T, device="cuda", dtype=torch.long)
    adv = torch.randn(B, device="cuda")

    def step():  # on-policy (old log-probs = detached current ones), like the Triton rows above
        out = loss_fn(h3, weight, labels.view(B, T), mask, adv)
        loss = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(loss, (h3, weight))

    t = timed(step)
    report(impl="liger LigerFusedLinearGRPOLoss (fwd+bwd, one call)", N=N, H=H, V=V, dtype="bf16",
           step_ms=t * 1e3, tflops_8nhv=step_flops() / t / 1e12)


def test_baseline_cut_cross_entropy():
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as exc:
        pytest.skip(f"cut_cross_entropy not importable: {exc}")
    hidden, weight, labels = make_inputs()

    def step():
        loss = linear_cross_entropy(hidden, weight, labels, reduction="sum", filter_eps=None)
        torch.autograd.grad(loss, (hidden, weight))

    t = timed(step)
    report(impl="cut_cross_entropy linear_cross_entropy (no filtering)", N=N, H=H, V=V, dtype="bf16",
           step_ms=t * 1e3, tflops_8nhv=step_flops() / t / 1e12)


def smoke(n: int = 40, h: int = 32, v: int = 97, device: Optional[str] = None) -> None:
    """Run the benchmark's own code paths on tiny shapes (CPU interpreter or GPU); not a measurement."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    hidden, weight, labels = make_inputs(n, h, v, device=device, dtype=torch.float32)
    g = torch.zeros(n, device=device)
    g[: n // 2] = 1.0
    for det in (False, True):
        print("smoke", det, triton_step(hidden, weight, labels, g, det))
