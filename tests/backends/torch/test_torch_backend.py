"""backend="torch" (the portable chunked heavy stage + the PyTorch objective) against the float64 oracle.

Tolerances: fp32 inputs within 1e-5 relative (of the largest reference entry) for loss, metrics and
gradients. bf16 inputs: our error must not exceed the plain bf16 PyTorch path's error (bf16
log_softmax + gather, then the same objective) plus one bf16 rounding of the output (2^-8 relative).
"""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import reference
from gspo_kernels.backends.torch import linear as torch_backend
from gspo_kernels.options import CallOptions
from tests.support import (
    RTOL,
    rel_err,
)


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


# ---------------------------------------------------------------------------------------------
# Numerics shared with the cpu backend's tests (tests/backends/cpu/test_cpu_backend.py runs them for "cpu").
# ---------------------------------------------------------------------------------------------


def _objective64(z64, labels, g, ge, temperature, finite_columns=None):
    """float64 ``sum(g * logp + ge * entropy)`` and its parts; ``finite_columns`` drops ``-inf`` columns
    (their probability is exactly 0) so that no ``0 * -inf`` enters the oracle."""
    if finite_columns is not None:
        z64 = z64[:, finite_columns]
        labels = torch.searchsorted(torch.nonzero(finite_columns)[:, 0], labels)
    logp_all = (z64 / temperature).log_softmax(-1)
    logp = logp_all.gather(-1, labels[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return (g.double() * logp).sum() + (ge.double() * entropy).sum(), logp, entropy


def check_extreme_logits(backend: str, path: str, case: str) -> None:
    """fp32 logits offset by 1e4 (a bias of 1e4 on the hidden-state path) or a temperature of 1e-6:
    log-probs, entropies and gradients within 1e-5 (relative to the largest reference entry) of float64."""
    impl = gk.backends.resolve(backend, torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    N, H, V = 12, 24, 300
    offset, temperature = (1e4, 1.0) if case == "offset-1e4" else (0.0, 1e-6)
    labels = torch.randint(0, V, (N,), generator=gen)
    g, ge = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    if path == "logits":
        leaves = [(torch.randn(N, V, generator=gen) * 3 + offset).requires_grad_()]
    else:
        leaves = [torch.randn(N, H, generator=gen).requires_grad_(), (torch.randn(V, H, generator=gen) * 0.3).requires_grad_(),
                  (torch.randn(V, generator=gen) + offset).requires_grad_()]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    z64 = leaves64[0] if path == "logits" else leaves64[0] @ leaves64[1].T + leaves64[2]
    total64, ref_logp, ref_ent = _objective64(z64, labels, g, ge, temperature)
    ref_grads = torch.autograd.grad(total64, leaves64)
    if path == "logits":
        logp, ent = impl.logits_logprobs(leaves[0], labels, options=CallOptions(temperature=temperature, return_entropy=True))
    else:
        logp, ent = impl.linear_logprobs(leaves[0], leaves[1], leaves[2], labels, options=CallOptions(temperature=temperature, return_entropy=True))
    assert rel_err(logp, ref_logp) < RTOL
    assert float((ent.detach().double() - ref_ent).abs().max()) < RTOL * max(1.0, float(ref_ent.detach().abs().max()))
    grads = torch.autograd.grad((g * logp).sum() + (ge * ent).sum(), leaves)
    for grad, ref in zip(grads, ref_grads):
        assert rel_err(grad, ref) < RTOL


def check_minus_inf_columns(backend: str, path: str) -> None:
    """``-inf`` logits (or a ``-inf`` bias entry) on non-label columns: finite log-probs, entropy,
    loss and gradients equal to float64 over the finite columns, and exactly 0 gradient there."""
    gen = torch.Generator().manual_seed(3)
    N, H, V = 8, 16, 11
    dead = torch.zeros(V, dtype=torch.bool)
    dead[[0, 7]] = True
    labels = torch.randint(1, 7, (N,), generator=gen)
    g, ge = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    impl = gk.backends.resolve(backend, torch.device("cpu"))
    if path == "logits":
        z = torch.randn(N, V, generator=gen)
        z[:, dead] = float("-inf")
        leaves = [z.requires_grad_()]
    else:
        b = torch.randn(V, generator=gen)
        b[dead] = float("-inf")
        leaves = [torch.randn(N, H, generator=gen).requires_grad_(), torch.randn(V, H, generator=gen).requires_grad_(),
                  b.requires_grad_()]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    z64 = leaves64[0] if path == "logits" else leaves64[0] @ leaves64[1].T + leaves64[2]
    total64, ref_logp, ref_ent = _objective64(z64, labels, g, ge, 1.0, finite_columns=~dead)
    ref_grads = torch.autograd.grad(total64, leaves64, allow_unused=True)
    if path == "logits":
        logp, ent = impl.logits_logprobs(leaves[0], labels, options=CallOptions(return_entropy=True))
    else:
        logp, ent = impl.linear_logprobs(leaves[0], leaves[1], leaves[2], labels, options=CallOptions(return_entropy=True))
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert rel_err(logp, ref_logp) < RTOL and rel_err(ent, ref_ent) < RTOL
    grads = torch.autograd.grad((g * logp).sum() + (ge * ent).sum(), leaves)
    for grad, ref in zip(grads, ref_grads):
        assert torch.isfinite(grad).all()
        if ref is not None and ref.dim() == grad.dim() and ref.shape == grad.shape:
            ref = torch.where(torch.isfinite(ref), ref, 0.0)
            assert rel_err(grad, ref) < RTOL
    dz = grads[0] if path == "logits" else grads[2]
    assert torch.all(dz[..., dead] == 0)
    # the reported reproducer, through the public API, with the entropy in the loss
    x = torch.randn(2, 4, 11, generator=gen)
    x[..., 0] = float("-inf")
    y = torch.randint(1, 11, (2, 4), generator=gen)
    xl = x.clone().requires_grad_()
    out = gk.gspo_loss(xl, y, torch.tensor([1.0, -1.0]), config=gk.GSPOConfig(entropy_coef=0.01), backend=backend)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(xl.grad).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())


def check_out_of_range_labels(backend: str) -> None:
    """Labels outside ``[0, V)`` handed to the backend functions (as under ``torch.compile``, where
    the public checks are skipped): that row's log-prob is NaN, the other rows are untouched, and the
    backward runs (no out-of-bounds read or write: the -100 of an unmasked padding token included)."""
    impl = gk.backends.resolve(backend, torch.device("cpu"))
    N, H, V = 6, 8, 13
    labels = torch.tensor([3, -100, 12, 13, -1, 0])
    bad = (labels < 0) | (labels >= V)
    good_labels = torch.where(bad, 0, labels)
    logits = torch.randn(N, V, requires_grad=True)
    hidden, weight = torch.randn(N, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    runs = [lambda y: impl.logits_logprobs(logits, y, options=CallOptions(return_entropy=True)),
            lambda y: impl.linear_logprobs(hidden, weight, None, y, options=CallOptions(return_entropy=True))]
    for run in runs:
        logp, ent = run(labels)
        ref_logp, ref_ent = run(good_labels)
        assert torch.isnan(logp[bad]).all()
        assert torch.equal(logp[~bad], ref_logp[~bad]) and torch.equal(ent, ref_ent)
        (logp[~bad].sum() + ent.sum()).backward()  # rows with a bad label get only an entropy gradient
    assert torch.isfinite(logits.grad).all() and torch.isfinite(hidden.grad).all()


@pytest.mark.parametrize("case", ["offset-1e4", "temperature-1e-6"])
@pytest.mark.parametrize("path", ["logits", "linear"])
def test_extreme_logits_fp32_within_1e5_of_float64(path, case):
    check_extreme_logits("torch", path, case)


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_minus_inf_on_non_label_columns(path):
    check_minus_inf_columns("torch", path)


def test_out_of_range_labels_give_nan_not_out_of_bounds():
    check_out_of_range_labels("torch")


def test_memory_budget_is_accepted_and_ignored():
    hidden, weight = torch.randn(5, 8), torch.randn(20, 8)
    labels = torch.randint(0, 20, (5,))
    a = gk.linear_logprobs(hidden, weight, labels, backend="torch")
    b = gk.linear_logprobs(hidden, weight, labels, backend="torch", memory_budget=0)
    assert torch.equal(a, b)
