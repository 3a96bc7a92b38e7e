"""What the input policies cost: the double-backward guard and ``check_finite=True``, side by side.

``gspo_loss`` forward + backward on the auto backend for this device, three ways in one group:
as shipped (guard on, ``check_finite=False``), with the guard replaced by an identity (the cost of the
one autograd node that refuses ``create_graph=True``), and with ``check_finite=True`` (one extra pass of
row maxima over the logits and one more host sync). Run: ``pytest benchmarks/test_guard_overhead.py
--benchmark-only``.
"""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import loss as loss_module

SHAPES = {"B8-T512-V8192": (8, 512, 8192)}


@pytest.mark.parametrize("variant", ["shipped", "no-guard", "check-finite"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_policy_overhead(benchmark, bench_device, monkeypatch, shape, variant):
    B, T, V = SHAPES[shape]
    torch.manual_seed(0)
    logits = torch.randn(B, T, V, device=bench_device)
    labels = torch.randint(0, V, (B, T), device=bench_device)
    adv = torch.randn(B, device=bench_device)
    old = torch.randn(B, T, device=bench_device) - 9.0
    mask = (torch.rand(B, T, device=bench_device) > 0.1).float()
    if variant == "no-guard":
        monkeypatch.setattr(loss_module, "first_order_only", lambda *tensors: tensors)
    x = logits.clone().requires_grad_()

    def fwd_bwd():
        x.grad = None
        out = gk.gspo_loss(x, labels, adv, old, mask=mask, check_finite=variant == "check-finite")
        out.loss.backward()
        if bench_device.type == "cuda":
            torch.cuda.synchronize()
        return out.loss

    benchmark.group = f"policies {shape}"
    benchmark.pedantic(fwd_bwd, rounds=7, warmup_rounds=1, iterations=1)
