"""``fused_linear_gspo_loss(..., logprobs_out=t)``: the per-token log-probs the loss was computed from, for a
caller's metrics (the TRL drop-in's importance-weight metrics), on every backend and both routes (the one-pass
loss with gradient, the two-pass path without), compared with the float64 reference; and its argument checks."""

from __future__ import annotations

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import GSPOConfig, backends, reference
from tests.support import RTOL, device_for, rel_err

BACKENDS = [b for b in ("triton", "cpu", "torch")
            if backends.load(b) is not None and backends.load(b).supports(torch.device(device_for(b)))]


def _case(backend, seed=0, B=4, T=6, H=16, V=41, packed=False):
    g = torch.Generator().manual_seed(seed)
    device = device_for(backend)
    shape = (B * T,) if packed else (B, T)
    hidden = torch.randn(*shape, H, generator=g).to(device).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(device).requires_grad_()
    labels = torch.randint(0, V, shape, generator=g).to(device)
    adv = torch.randn(B, generator=g).to(device)
    old = (torch.randn(shape, generator=g) * 0.1 - 3.0).to(device)
    mask = torch.ones(shape)
    mask.view(-1)[[1, 7, 8, 20]] = 0
    cu = torch.tensor([0, 5, 6, 15, B * T]).to(device) if packed else None
    return hidden, weight, labels, adv, old, mask.to(device), cu


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("grad", [True, False], ids=["with-grad", "no-grad"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_out_holds_the_losss_logprobs(backend, grad, packed):
    hidden, weight, labels, adv, old, mask, cu = _case(backend, packed=packed)
    cfg = GSPOConfig(importance_sampling_level="sequence")
    kept = torch.full(labels.shape, float("nan"), device=labels.device)  # every entry must be written
    with torch.set_grad_enabled(grad):
        out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, cu_seqlens=cu, config=cfg,
                                        backend=backend, logprobs_out=kept)
        plain = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, cu_seqlens=cu, config=cfg,
                                          backend=backend)
    want = reference.linear_logprobs(hidden.detach().double().cpu(), weight.detach().double().cpu(), labels.cpu())
    want = torch.where(mask.cpu() > 0, want, 0.0)
    assert kept.dtype == torch.float32 and not kept.requires_grad
    assert torch.equal(kept.cpu()[mask.cpu() == 0], torch.zeros(int((mask == 0).sum())))
    assert rel_err(kept.cpu().double(), want) < RTOL
    assert torch.equal(out.loss.detach(), plain.loss.detach())  # keeping them changes nothing
    if grad:  # the gradients too
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out.loss, (hidden, weight)),
                                                     torch.autograd.grad(plain.loss, (hidden, weight))))


@pytest.mark.parametrize("bad, error, match", [
    (lambda labels: torch.zeros(labels.shape, dtype=torch.long), TypeError, "logprobs_out must be a floating"),
    (lambda labels: [0.0], TypeError, "logprobs_out must be a floating"),
    (lambda labels: torch.zeros(labels.shape[0], labels.shape[1] + 1), ValueError, "logprobs_out must have labels' shape"),
    (lambda labels: torch.zeros(labels.shape[1], labels.shape[0]).t(), ValueError, "contiguous"),
    (lambda labels: torch.zeros(labels.shape, requires_grad=True), ValueError, "not require grad"),
], ids=["integer", "not-a-tensor", "shape", "strided", "requires-grad"])
def test_a_bad_logprobs_out_is_an_error_naming_it(bad, error, match):
    hidden, weight, labels, adv, old, mask, _ = _case("torch")
    with pytest.raises(error, match=match):
        gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, backend="torch",
                                  logprobs_out=bad(labels).to(labels.device) if torch.is_tensor(bad(labels))
                                  else bad(labels))
