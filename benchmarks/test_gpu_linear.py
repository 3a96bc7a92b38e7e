"""GPU benchmark of the Triton hidden-state path (``backend="triton"``, logits never formed). GPU-only.

Shape: N = 16384 tokens, H = 4096, V = 151936 (Qwen), bf16 hidden and lm_head weight.
FLOP formulas: forward ``2 N H V`` (one GEMM); backward ``6 N H V`` (logits recompute + dH + dW), so a
training step is ``8 N H V`` (81.6 TFLOP here). Rows report TFLOP/s against ``6 N H V`` (the useful work of
a forward + backward, the convention of Liger's and Cut Cross-Entropy's reports: the forward's logits would
be reused by a kernel that forms the gradient during the forward) and against ``8 N H V`` (the work this
implementation does), and the backward alone against its ``6 N H V``.
The backward is also timed with 100 %, 50 % and 25 % of the rows carrying gradient (the others get
``grad_logp = 0``, as masked, clipped or zero-advantage tokens do): it should scale with the share.
Peak memory of the backward is measured for several ``memory_budget`` values.
Baselines when importable: TRL ``ChunkedLogProbFunction`` (the same quantity: log-probs of hidden @ W.T),
Liger ``LigerFusedLinearGRPOLoss`` (GRPO loss over hidden states, forward + backward in one call) and
Cut Cross-Entropy ``linear_cross_entropy`` (cross-entropy, the same 8NHV work).

Run on a CUDA machine: ``python -m pytest benchmarks/test_gpu_linear.py -s``. Every row prints the device and
versions; ``GSPO_BENCH_JSON=path`` also appends the rows as JSON lines. Without CUDA every test skips with a
reason: these numbers have never been measured. ``smoke()`` runs the same code paths on tiny shapes (the CPU
interpreter included); it is not a measurement.
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
H100_BF16_TFLOPS = 790.0  # dense bf16 GEMM rate measured with cuBLAS on this workplace's H100s


def nhv(n: int = N, h: int = H, v: int = V) -> float:
    return float(n) * h * v


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
    """Median seconds of ``fn()`` (synchronized before and after)."""
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


def scattered_gradient(n: int, share: float, device: str) -> torch.Tensor:
    """``grad_logp`` with ``share`` of the rows non-zero, scattered through the batch."""
    g = torch.zeros(n, device=device)
    g[: int(n * share)] = 1.0
    return g[torch.randperm(n, device=device)]


def triton_step(hidden, weight, labels, grad_logp: torch.Tensor, memory_budget: Optional[int] = None):
    """Forward seconds, backward seconds of the Triton path for one incoming gradient."""
    from gspo_kernels.backends.triton.linear import linear_logprobs

    state = {}

    def fwd():
        state["logp"], _ = linear_logprobs(hidden, weight, None, labels, memory_budget=memory_budget)

    def bwd():
        torch.autograd.grad(state["logp"], (hidden, weight), grad_logp, retain_graph=True)

    t_fwd = timed(fwd)
    fwd()
    t_bwd = timed(bwd)
    return t_fwd, t_bwd


def test_triton_forward_backward_tflops():
    hidden, weight, labels = make_inputs()
    t_fwd, t_bwd = triton_step(hidden, weight, labels, torch.ones(N, device="cuda"))
    total = t_fwd + t_bwd
    report(impl="gspo_kernels triton", N=N, H=H, V=V, dtype="bf16", fwd_ms=t_fwd * 1e3, bwd_ms=t_bwd * 1e3,
           tflops_6nhv=6 * nhv() / total / 1e12, tflops_8nhv=8 * nhv() / total / 1e12,
           fwd_tflops_2nhv=2 * nhv() / t_fwd / 1e12, bwd_tflops_6nhv=6 * nhv() / t_bwd / 1e12,
           share_of_peak_8nhv=8 * nhv() / total / 1e12 / H100_BF16_TFLOPS)


def test_backward_scales_with_active_rows():
    hidden, weight, labels = make_inputs()
    times = {}
    for share in (1.0, 0.5, 0.25):
        _, times[share] = triton_step(hidden, weight, labels, scattered_gradient(N, share, "cuda"))
        report(impl="gspo_kernels triton backward", active_share=share, N=N, H=H, V=V, dtype="bf16",
               bwd_ms=times[share] * 1e3, bwd_tflops_6nhv_active=6 * nhv() * share / times[share] / 1e12,
               ratio_to_full=times[share] / times[1.0])


@pytest.mark.parametrize("budget_mib", [256, 1024, 4096])
def test_backward_memory_budget(budget_mib):
    """Peak memory above the inputs during the backward, and its time, for a chunk-buffer budget."""
    hidden, weight, labels = make_inputs()
    budget = budget_mib << 20
    t_fwd, t_bwd = triton_step(hidden, weight, labels, torch.ones(N, device="cuda"), memory_budget=budget)
    from gspo_kernels.backends.triton.linear import linear_logprobs

    logp, _ = linear_logprobs(hidden, weight, None, labels, memory_budget=budget)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(logp, (hidden, weight), torch.ones(N, device="cuda"))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    gradient_bytes = sum(g.numel() * g.element_size() for g in grads)
    fp32_dw_bytes = V * H * 4
    report(impl="gspo_kernels triton backward", memory_budget_mib=budget_mib, N=N, H=H, V=V, dtype="bf16",
           bwd_ms=t_bwd * 1e3, peak_extra_mib=peak / 2**20,
           peak_minus_grads_and_fp32_dw_mib=(peak - gradient_bytes - fp32_dw_bytes) / 2**20)


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
    total = t_fwd + t_bwd
    report(impl="trl ChunkedLogProbFunction", N=N, H=H, V=V, dtype="bf16", fwd_ms=t_fwd * 1e3, bwd_ms=t_bwd * 1e3,
           tflops_6nhv=6 * nhv() / total / 1e12, tflops_8nhv=8 * nhv() / total / 1e12)


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
           step_ms=t * 1e3, tflops_6nhv=6 * nhv() / t / 1e12, tflops_8nhv=8 * nhv() / t / 1e12)


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
           step_ms=t * 1e3, tflops_6nhv=6 * nhv() / t / 1e12, tflops_8nhv=8 * nhv() / t / 1e12)


def smoke(n: int = 40, h: int = 32, v: int = 97, device: Optional[str] = None) -> None:
    """Run the benchmark's own code paths on tiny shapes (CPU interpreter or GPU); not a measurement."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    hidden, weight, labels = make_inputs(n, h, v, device=device, dtype=torch.float32)
    for share in (1.0, 0.5, 0.25):
        print("smoke", share, triton_step(hidden, weight, labels, scattered_gradient(n, share, device), 1 << 12))
