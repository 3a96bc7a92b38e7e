"""backend="torch" (the portable chunked heavy stage + the PyTorch objective) against the float64 oracle.

Tolerances: fp32 inputs within 1e-5 relative (of the largest reference entry) for loss, metrics and
gradients. bf16 inputs: our error must not exceed the plain bf16 PyTorch path's error (bf16
log_softmax + gather, then the same objective) plus one bf16 rounding of the output (2^-8 relative).
"""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import reference
from gspo_kernels.backends import pytorch as torch_backend
from tests.cases import (
    RTOL,
    assert_bf16_no_worse_than_plain_bf16,
    assert_zero_rows_get_zero_dh,
    check_against_reference,
    configs,
    linear_loss_vs_reference,
    logits_loss_vs_reference,
    rel_err,
)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("config", configs(), ids=lambda c: f"{c.importance_sampling_level}-{c.loss_type}")
def test_logits_path_fp32(config, packed, monkeypatch):
    monkeypatch.setattr(torch_backend, "LOGITS_BLOCK_ELEMENTS", 3 * 97)  # blocks of 3 rows (V = 97)
    check_against_reference(*logits_loss_vs_reference("torch", config, packed))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("config", configs(), ids=lambda c: f"{c.importance_sampling_level}-{c.loss_type}")
def test_linear_path_fp32(config, packed, monkeypatch):
    monkeypatch.setattr(torch_backend, "LINEAR_VOCAB_BLOCK", 32)
    monkeypatch.setattr(torch_backend, "LINEAR_ROW_BLOCK", 5)
    out, expected, grads, ref_grads = linear_loss_vs_reference("torch", config, packed)
    check_against_reference(out, expected, grads, ref_grads)
    assert_zero_rows_get_zero_dh(config, grads, ref_grads)


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_bf16_no_worse_than_plain_bf16(path):
    assert_bf16_no_worse_than_plain_bf16("torch", path)


def test_all_masked_batch_gives_zero_not_nan():
    V = 11
    logits = torch.randn(3, 4, V, requires_grad=True)
    labels = torch.full((3, 4), -100)
    mask = torch.zeros(3, 4)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        cfg = gk.GSPOConfig(loss_type=loss_type, max_completion_length=4, beta=0.1, entropy_coef=0.1)
        old = torch.full((3, 4), float("-inf"))  # padding values must never leak into exp
        out = gk.gspo_loss(logits, labels, torch.randn(3), old, mask=mask, ref_logprobs=old, config=cfg,
                           backend="torch")
        (grad,) = torch.autograd.grad(out.loss, logits)
        assert out.loss.item() == 0.0
        assert torch.all(grad == 0)
        for name, value in out.metrics.items():
            assert torch.isfinite(value), name


def test_empty_packed_batch():
    logits = torch.randn(0, 7, requires_grad=True)
    out = gk.gspo_loss(logits, torch.zeros(0, dtype=torch.long), torch.randn(2), None,
                       cu_seqlens=torch.tensor([0, 0, 0], dtype=torch.int32), backend="torch")
    assert out.loss.item() == 0.0
    (grad,) = torch.autograd.grad(out.loss, logits)
    assert grad.shape == (0, 7)


def test_strided_logits_and_inplace_backward():
    B, T, V = 3, 6, 50
    full = torch.randn(B, T + 1, V)
    labels = torch.randint(0, V, (B, T))
    adv = torch.tensor([1.0, 0.0, -2.0])
    old = reference.token_logprobs(full[:, :-1].double(), labels).float() - 1e-4
    x64 = full[:, :-1].double().requires_grad_()
    expected = reference.gspo_loss(x64, labels, adv, old)
    (ref_grad,) = torch.autograd.grad(expected.loss, x64)

    leaf = full.clone().requires_grad_()
    out = gk.gspo_loss(leaf[:, :-1], labels, adv, old, backend="torch")  # non-contiguous view
    (grad,) = torch.autograd.grad(out.loss, leaf)
    assert rel_err(grad[:, :-1], ref_grad) < RTOL
    assert torch.all(grad[:, -1] == 0)

    buffer = full.clone()
    view = buffer[:, :-1].requires_grad_()  # a leaf view: its gradient lands in buffer's storage
    out = gk.gspo_loss(view, labels, adv, old, backend="torch", inplace_backward=True)
    out.loss.backward()
    assert rel_err(buffer[:, :-1], ref_grad) < RTOL  # the gradient was written into the logits' storage
    assert torch.all(buffer[1, :-1] == 0)  # zero advantage: the consumed logits hold exactly zero
    assert torch.equal(buffer[:, -1], full[:, -1])  # outside the view nothing is touched

    contiguous = full[:, :-1].contiguous().requires_grad_()
    gk.gspo_loss(contiguous, labels, adv, old, backend="torch", inplace_backward=True).loss.backward()
    assert contiguous.grad.data_ptr() == contiguous.data_ptr()  # no [N, V] gradient buffer was allocated
    assert rel_err(contiguous.grad, ref_grad) < RTOL


def test_backward_visits_only_rows_with_gradient(monkeypatch):
    visited = []
    original = torch_backend._grad_tile

    def spy(z, *args, **kwargs):
        visited.append(z.shape[0])
        return original(z, *args, **kwargs)

    monkeypatch.setattr(torch_backend, "_grad_tile", spy)
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


def test_token_and_linear_logprobs_match_reference():
    V, H = 300, 16
    logits = torch.randn(5, 7, V) * 4
    labels = torch.randint(0, V, (5, 7))
    logp, ent = gk.token_logprobs(logits, labels, temperature=1.3, return_entropy=True, backend="torch")
    rl, re = reference.token_logprobs(logits.double(), labels, temperature=1.3, return_entropy=True)
    assert logp.dtype == torch.float32 and logp.shape == (5, 7)
    assert rel_err(logp, rl) < RTOL and rel_err(ent, re) < RTOL
    hidden, weight, bias = torch.randn(5, 7, H), torch.randn(V, H), torch.randn(V)
    lp = gk.linear_logprobs(hidden, weight, labels, bias=bias, backend="torch")
    ref = reference.linear_logprobs(hidden.double(), weight.double(), labels, bias=bias.double())
    assert rel_err(lp, ref) < RTOL
    with torch.no_grad():  # what users run for old / ref log-probs
        assert rel_err(gk.token_logprobs(logits, labels, backend="torch"), reference.token_logprobs(logits.double(), labels)) < RTOL


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
