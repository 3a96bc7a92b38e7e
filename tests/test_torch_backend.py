"""backend="torch" specifics (the shared behaviours of every backend are in test_conformance.py).

Tolerances: fp32 inputs within 1e-5 relative (of the largest reference entry).
"""

import torch

import gspo_kernels as gk
from gspo_kernels import reference
from gspo_kernels.backends import pytorch as torch_backend
from tests.cases import RTOL, rel_err


def test_backward_visits_only_rows_with_gradient(monkeypatch):
    visited = []
    original = torch_backend._logit_grad

    def spy(z, *args):
        visited.append(z.shape[0])
        return original(z, *args)

    monkeypatch.setattr(torch_backend, "_logit_grad", spy)
    monkeypatch.setattr(torch_backend, "LINEAR_VOCAB_BLOCK", 10**9)
    B, T, V, H = 8, 4, 30, 8
    hidden, weight = torch.randn(B, T, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (B, T))
    adv = torch.zeros(B)
    adv[:3] = 1.0  # 3 of 8 responses carry gradient, the others have zero advantage
    out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, backend="torch")
    out.loss.backward()
    assert sum(visited) == 3 * T
    assert torch.all(hidden.grad[3:] == 0) and torch.any(hidden.grad[:3] != 0)


def test_vocab_of_one_and_minus_inf_logits():
    logits = torch.randn(4, 1, requires_grad=True)
    logp = gk.token_logprobs(logits, torch.zeros(4, dtype=torch.long), backend="torch")
    assert torch.all(logp == 0)
    masked = torch.randn(3, 10)
    masked[:, 5:] = float("-inf")  # vocabulary masking with -inf must not make NaN
    x = masked.clone().requires_grad_()
    lp, ent = gk.token_logprobs(x, torch.tensor([0, 1, 2]), return_entropy=True, backend="torch")
    rl, re = reference.token_logprobs(masked.double(), torch.tensor([0, 1, 2]), return_entropy=True)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert rel_err(lp, rl) < RTOL
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(x.grad).all() and torch.all(x.grad[:, 5:] == 0)
