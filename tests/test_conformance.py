"""Every backend, one contract: the public API of each available backend against the float64 oracle.

Parametrized over ``cpu`` (the C++ extension), ``torch`` and ``triton`` (in the Triton interpreter on
machines without a GPU). A backend that cannot run here is skipped with the reason, except ``cpu``
under ``GSPO_KERNELS_REQUIRE_EXT=1`` (``make test``), where a missing extension fails.

Tolerances: fp32 inputs within 1e-5 relative (of the largest reference entry) for the loss, the
metrics and the gradients. bf16 / fp16 inputs: the loss and log-probs keep the fp32 tolerance (the
math runs in fp32); a gradient returned in the input dtype may differ by the fp32 tolerance plus its
roundings to that dtype (:func:`gspo_kernels.testing.gradient_tolerance`, the bound ``verify``
prints). The plain bf16 PyTorch path's error is never the bar.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import backends, reference, testing
from gspo_kernels.tools import verify
from tests.support import (
    RTOL,
    check_against_reference,
    configs,
    device_for,
    linear_loss_vs_reference,
    logits_loss_vs_reference,
    matrix_budget,
    rel_err,
)

NAMES = backends.BACKENDS
CONFIG_IDS = lambda c: f"{c.importance_sampling_level}-{c.loss_type}"  # noqa: E731
# Tile sizes small enough that the test shapes span several tiles (last one partial), where a backend has them.
SMALL_TILES = {
    "torch": dict(VOCAB_BLOCK=40, ROW_BLOCK=3, LOGITS_BLOCK_ELEMENTS=3 * 97, LINEAR_VOCAB_BLOCK=32,
                  LINEAR_ROW_BLOCK=5),
    "cpu": dict(ROW_BLOCK=4, VOCAB_BLOCK=32, FAST_ROW_BLOCK=4, FAST_MIN_ROW_BLOCK=1, FAST_VOCAB_BLOCK=32),
    # chunks of a few rows (the one-pass loss: whole responses, 12 rows or the budget's), vocabulary tiles of 64
    # logits, two-pass slices of 128 columns
    "triton": dict(GEMM_MIN_CHUNK_ROWS=1, GEMM_ROW_MULTIPLE=1, ONE_PASS_LOGITS_ROWS=12, ONE_PASS_STORE_ROWS=12,
                   TWO_PASS_LOGITS_ROWS=8, TWO_PASS_STORE_ROWS=8, LOGITS_MAX_BLOCK_V=64, VOCAB_SLICE_MULTIPLE=1,
                   VOCAB_SLICE_MIN_COLUMNS=128, VOCAB_SLICE_MAX_COLUMNS=128),
}


def _device(name: str) -> str:
    return device_for(name)


@pytest.fixture(params=NAMES)
def backend(request, monkeypatch) -> str:
    """A backend name; skipped (with the reason) where it cannot run, small tiles where it has them."""
    return use_backend(request.param, monkeypatch)


def use_backend(name: str, monkeypatch) -> str:
    """The ``backend`` fixture's body (shared with other test files): ``name``, or a skip / failure."""
    impl = backends.load(name)
    if impl is None or not impl.supports(torch.device(_device(name))):
        reason = backends.unavailable_reason(name) or f"does not run on {_device(name)}"
        if name == "cpu" and os.environ.get("GSPO_KERNELS_REQUIRE_EXT") == "1":
            pytest.fail(f"GSPO_KERNELS_REQUIRE_EXT=1 but backend 'cpu' is unavailable: {reason}")
        pytest.skip(f"backend {name!r} unavailable: {reason}")
    import importlib
    import sys

    package = importlib.import_module(backends._MODULES[name]).__name__
    # a backend package's tile sizes live in its submodules (each read where it is defined)
    modules = [m for key, m in sorted(sys.modules.items()) if key == package or key.startswith(package + ".")]
    for attr, value in SMALL_TILES.get(name, {}).items():
        for module in modules:
            if hasattr(module, attr):
                monkeypatch.setattr(module, attr, value)
    return name


def _loss_fn(path: str):
    return gk.gspo_loss if path == "logits" else gk.fused_linear_gspo_loss


# ---------------------------------------------------------------------------------------------
# The public API against the oracle, every level x loss type, both layouts, strided inputs.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("config", configs(), ids=CONFIG_IDS)
def test_logits_loss_matches_reference(backend, config, packed, case_seed):
    check_against_reference(*logits_loss_vs_reference(backend, config, packed, device=_device(backend)))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("config", configs(), ids=CONFIG_IDS)
def test_linear_loss_matches_reference(backend, config, packed, case_seed):
    """Several chunks and vocabulary tiles on every backend (small tiles; every other config a budget of 4 rows)."""
    budget = matrix_budget(configs().index(config), 75)
    check_against_reference(*linear_loss_vs_reference(backend, config, packed, device=_device(backend),
                                                      memory_budget=budget))


def test_token_and_linear_logprobs_match_reference(backend):
    dev = _device(backend)
    V, H = 300, 16
    logits = torch.randn(5, 7, V) * 4
    labels = torch.randint(0, V, (5, 7))
    x = logits.clone().to(dev).requires_grad_()
    logp, ent = gk.token_logprobs(x, labels.to(dev), temperature=1.3, return_entropy=True, backend=backend)
    x64 = logits.double().requires_grad_()
    rl, re = reference.token_logprobs(x64, labels, temperature=1.3, return_entropy=True)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (5, 7)
    assert rel_err(logp, rl) < RTOL and rel_err(ent, re) < RTOL
    g, ge = torch.randn(5, 7), torch.randn(5, 7)
    (grad,) = torch.autograd.grad((logp * g.to(dev) + ent * ge.to(dev)).sum(), x)
    (ref_grad,) = torch.autograd.grad((rl * g + re * ge).sum(), x64)
    assert rel_err(grad, ref_grad) < RTOL

    hidden, weight, bias = torch.randn(5, 7, H), torch.randn(V, H) * 0.5, torch.randn(V)
    leaves = [t.clone().to(dev).requires_grad_() for t in (hidden, weight, bias)]
    lp, ent = gk.linear_logprobs(leaves[0], leaves[1], labels.to(dev), bias=leaves[2], temperature=0.8,
                                 return_entropy=True, backend=backend)
    leaves64 = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    rl, re = reference.linear_logprobs(leaves64[0], leaves64[1], labels, bias=leaves64[2], temperature=0.8,
                                       return_entropy=True)
    assert rel_err(lp, rl) < RTOL and rel_err(ent, re) < RTOL
    grads = torch.autograd.grad((lp * g.to(dev) + ent * ge.to(dev)).sum(), leaves)
    ref_grads = torch.autograd.grad((rl * g + re * ge).sum(), leaves64)
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < RTOL
    with torch.no_grad():  # what users run for old / reference log-probs
        assert rel_err(gk.token_logprobs(x, labels.to(dev), backend=backend),
                       reference.token_logprobs(logits.double(), labels)) < RTOL


# ---------------------------------------------------------------------------------------------
# Half precision: fp32 math, so the error is the fp32 error plus the output's rounding.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("path", ["logits", "linear"])
def test_half_precision_within_fp32_math_plus_output_rounding(backend, path, dtype):
    """Against the float64 oracle on the same rounded inputs; an entropy bonus and KL exercise every term."""
    dev = _device(backend)
    B, T, V, H = 4, 9, 700, 40
    labels = torch.randint(0, V, (B, T))
    if path == "logits":
        inputs = [(torch.randn(B, T, V) * 3).to(dtype)]
        as_logits = lambda xs: xs[0]  # noqa: E731
    else:
        inputs = [torch.randn(B, T, H).to(dtype), (torch.randn(V, H) * 0.3).to(dtype), (torch.randn(V) * 0.1).to(dtype)]
        as_logits = lambda xs: xs[0] @ xs[1].T + xs[2]  # noqa: E731
    base = [x.double() for x in inputs]
    current = reference.token_logprobs(as_logits(base), labels)
    old = (current - torch.randn(B, 1).double() * 3e-4).float()
    ref_lp = (current + 0.3 * torch.randn(B, T).double()).float()
    mask = (torch.arange(T)[None] < torch.tensor([9, 1, 0, 6])[:, None]).float()
    adv = torch.randn(B)
    cfg = gk.GSPOConfig(importance_sampling_level="sequence_token", loss_type="bnpo", beta=0.04, entropy_coef=0.01)
    kw = dict(mask=mask, ref_logprobs=ref_lp, config=cfg)

    leaves = [x.clone().to(dev).requires_grad_() for x in inputs]
    dev_kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    if path == "logits":
        out = gk.gspo_loss(leaves[0], labels.to(dev), adv.to(dev), old.to(dev), backend=backend, **dev_kw)
    else:
        out = gk.fused_linear_gspo_loss(leaves[0], leaves[1], labels.to(dev), adv.to(dev), old.to(dev),
                                        bias=leaves[2], backend=backend, **dev_kw)
    grads = torch.autograd.grad(out.loss, leaves)
    leaves64 = [x.requires_grad_() for x in base]
    expected = reference.gspo_loss(as_logits(leaves64), labels, adv, old, **kw)
    ref_grads = torch.autograd.grad(expected.loss, leaves64)

    assert abs(out.loss.item() - expected.loss.item()) <= RTOL * max(1.0, abs(expected.loss.item()))
    for name, value in expected.metrics.items():
        assert abs(float(out.metrics[name]) - float(value)) <= RTOL * max(1.0, abs(float(value))), name
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    tol = testing.gradient_tolerance(dtype_name, path, backend=backend, device=dev)
    assert tol <= 2.0**-6
    for got, want in zip(grads, ref_grads):
        assert got.dtype == dtype
        assert rel_err(got, want) <= tol, (rel_err(got, want), tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logp", "logp+entropy"])
def test_half_precision_logits_gradient_is_rounded_once(backend, dtype, with_entropy):
    """The label column's gradient ``g (1 - p)`` is formed in fp32 and rounded once to the logits' dtype.

    Labels hold about half of each row's probability, so the label column carries the row's largest gradient;
    a backend that stores ``-g p`` in half precision and then adds ``g`` there rounds it two or three times
    (``verify`` once measured 4.8e-3 against the one-rounding bound 3.9e-3 for bf16)."""
    dev = _device(backend)
    N, V = 96, 300
    labels = torch.randint(0, V, (N,))
    logits = torch.randn(N, V)
    logits[torch.arange(N), labels] = math.log(V) + torch.rand(N) * 0.5  # p(label) ~ 0.5 - 0.6
    logits = logits.to(dtype)
    g_logp, g_ent = torch.randn(N) * 4, torch.randn(N) * 0.5
    x = logits.clone().to(dev).requires_grad_()
    logp, entropy = gk.token_logprobs(x, labels.to(dev), return_entropy=True, backend=backend)
    loss = (logp * g_logp.to(dev)).sum() + ((entropy * g_ent.to(dev)).sum() if with_entropy else 0.0)
    (grad,) = torch.autograd.grad(loss, [x])
    x64 = logits.double().requires_grad_()
    lp64, ent64 = reference.token_logprobs(x64, labels, return_entropy=True)
    loss64 = (lp64 * g_logp.double()).sum() + ((ent64 * g_ent.double()).sum() if with_entropy else 0.0)
    (want,) = torch.autograd.grad(loss64, [x64])
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    tol = testing.gradient_tolerance(dtype_name, "logits")
    assert grad.dtype == dtype
    assert rel_err(grad.cpu(), want) <= tol, (rel_err(grad.cpu(), want), tol)


# ---------------------------------------------------------------------------------------------
# Layouts: packed and padded give the same losses and gradients for the same responses.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["logits", "linear"])
@pytest.mark.parametrize("level", ["sequence", "token"])
def test_packed_equals_padded(backend, path, level):
    """Four responses of lengths 5, 1, 0, 7 padded to 8, with masked tokens inside two of them; packed, the
    padding is dropped and the inner masked tokens stay, masked by the packed layout's token mask."""
    dev = _device(backend)
    lengths, T, V, H = [5, 1, 0, 7], 8, 53, 24
    B = len(lengths)
    pad_mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    inner = torch.ones(B, T, dtype=torch.bool)
    inner[0, 2] = inner[3, 1] = inner[3, 5] = False  # masked tokens inside responses 0 and 3
    mask = (pad_mask & inner).float()
    labels = torch.randint(0, V, (B, T))
    if path == "logits":
        x = torch.randn(B, T, V) * 2
        weight = None
    else:
        x, weight = torch.randn(B, T, H), torch.randn(V, H) * 0.3
    z = x if weight is None else x @ weight.T
    old = (reference.token_logprobs(z.double(), labels) - 1e-4 * torch.randn(B, 1).double()).float()
    old[0, 2] = float("nan")  # masked: never read
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])
    cfg = gk.GSPOConfig(importance_sampling_level=level, loss_type="dapo", beta=0.02, entropy_coef=0.01)
    ref_lp = old.nan_to_num(0.0) + 0.1

    keep = pad_mask.reshape(-1)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    layouts = {
        "padded": (x, labels, old, ref_lp, dict(mask=mask)),
        "packed": (x.reshape(B * T, -1)[keep], labels.reshape(-1)[keep], old.reshape(-1)[keep],
                   ref_lp.reshape(-1)[keep], dict(mask=mask.reshape(-1)[keep], cu_seqlens=cu)),
    }
    results = {}
    for name, (xs, ys, olds, refs, kw) in layouts.items():
        leaves = [xs.clone().to(dev).requires_grad_()] + ([] if weight is None else [weight.clone().to(dev).requires_grad_()])
        kw = {k: v.to(dev) for k, v in kw.items()}
        out = _loss_fn(path)(*leaves, ys.to(dev), adv.to(dev), olds.to(dev), ref_logprobs=refs.to(dev), config=cfg,
                             backend=backend, **kw)
        grads = [g.cpu() for g in torch.autograd.grad(out.loss, leaves)]
        results[name] = (out, grads)
    (padded, padded_grads), (packed, packed_grads) = results["padded"], results["packed"]
    assert abs(padded.loss.item() - packed.loss.item()) <= RTOL * max(1.0, abs(padded.loss.item()))
    for key, value in padded.metrics.items():
        assert abs(float(value) - float(packed.metrics[key])) <= RTOL * max(1.0, abs(float(value))), key
    flat_padded = padded_grads[0].reshape(B * T, -1)
    assert rel_err(packed_grads[0], flat_padded[keep]) < RTOL
    assert torch.all(flat_padded[~keep] == 0)
    assert torch.all(packed_grads[0][mask.reshape(-1)[keep] == 0] == 0)  # the inner masked tokens
    if weight is not None:
        assert rel_err(packed_grads[1], padded_grads[1]) < RTOL


# ---------------------------------------------------------------------------------------------
# Rows without gradient are skipped in the backward: poisoned after the forward, never read.
# ---------------------------------------------------------------------------------------------


def _skip_case(path: str):
    """Four responses: 0 carries gradient, 1 is clipped as a whole, 2 has A = 0, 3 has masked tokens."""
    B, T, V, H = 4, 6, 37, 16
    labels = torch.randint(0, V, (B, T))
    x = torch.randn(B, T, V) * 2 if path == "logits" else torch.randn(B, T, H)
    weight = None if path == "logits" else torch.randn(V, H) * 0.3
    z = x if weight is None else x @ weight.T
    offsets = torch.tensor([1e-4, 2e-3, 0.0, -1e-4], dtype=torch.float64)  # log w of each response
    old = (reference.token_logprobs(z.double(), labels) - offsets[:, None]).float()
    adv = torch.tensor([1.0, 1.0, 0.0, -1.0])
    mask = torch.ones(B, T)
    mask[3, 2:] = 0
    mask[0, 5] = 0
    has_gradient = (mask > 0) & torch.tensor([True, False, False, True])[:, None]
    return x, weight, labels, adv, old, mask, has_gradient


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_rows_without_gradient_are_not_read_in_the_backward(backend, path):
    """After the forward, the saved input rows of clipped, zero-advantage and masked tokens are overwritten
    with NaN through ``.data`` (autograd does not see it). A backward that skips them returns the same
    finite gradients as an untouched run; one that reads them returns NaN (through ``0 * NaN`` in dW too)."""
    dev = _device(backend)
    x, weight, labels, adv, old, mask, has_gradient = _skip_case(path)
    cfg = gk.GSPOConfig()  # sequence level, grpo, no KL, no entropy bonus: g = 0 exactly on those rows
    args = (labels.to(dev), adv.to(dev), old.to(dev))
    runs = []
    for poison in (False, True):
        leaves = [x.clone().to(dev).requires_grad_()] + ([] if weight is None else [weight.clone().to(dev).requires_grad_()])
        out = _loss_fn(path)(*leaves, *args, mask=mask.to(dev), config=cfg, backend=backend)
        if poison:
            leaves[0].data[~has_gradient.to(dev)] = float("nan")
        runs.append([g.cpu() for g in torch.autograd.grad(out.loss, leaves)])
    (clean, poisoned) = runs
    assert float(out.metrics["clip_ratio/high_mean"]) > 0  # response 1 is clipped
    for got, want in zip(poisoned, clean):
        assert torch.isfinite(got).all(), "the backward read a row whose gradient is zero"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.all(poisoned[0][~has_gradient] == 0)
    assert torch.all(poisoned[0][has_gradient].abs().amax(-1) > 0)


# ---------------------------------------------------------------------------------------------
# Uninitialized memory is never read: every float torch.empty / empty_like comes back as NaN.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_outputs_never_depend_on_uninitialized_memory(backend, path, monkeypatch):
    """Fresh buffers (the Triton sequence stage's gradient coefficients among them) filled with NaN: the
    results must equal an unpoisoned run, and the gradient the sequence stage hands to the per-token stage
    must be written everywhere, exactly 0 at masked tokens."""
    dev = _device(backend)
    x, weight, labels, adv, old, mask, _ = _skip_case(path)
    old[3, 4] = float("nan")  # masked garbage
    cfg = gk.GSPOConfig(importance_sampling_level="token", loss_type="bnpo", entropy_coef=0.01)
    args = (labels.to(dev), adv.to(dev), old.to(dev))

    def run():
        leaves = [x.clone().to(dev).requires_grad_()] + ([] if weight is None else [weight.clone().to(dev).requires_grad_()])
        out = _loss_fn(path)(*leaves, *args, mask=mask.to(dev), config=cfg, backend=backend)
        return out, [g.cpu() for g in torch.autograd.grad(out.loss, leaves)]

    clean, clean_grads = run()
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t):
        if t.dtype.is_floating_point:
            with torch.no_grad():
                t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(real_empty_like(*a, **k)))
    impl = backends.load(backend)
    # The one-call forms (the hidden path's one-pass loss, the logits path's one-node loss), on poisoned buffers
    # too; below, with them switched off: the two-stage form's contract boundary.
    one_call = "fused_linear_loss" if path == "linear" else "fused_logits_loss"
    if getattr(impl, one_call, None) is not None:
        out, grads = run()
        assert torch.isfinite(out.loss) and out.loss.item() == pytest.approx(clean.loss.item(), rel=1e-6)
        for got, want in zip(grads, clean_grads):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        monkeypatch.setattr(impl, one_call, None)
    # What the sequence stage sends back to the per-token stage (the Triton stage's coefficient buffer
    # times a scale), caught at the backend contract's boundary: finite everywhere, 0 at masked tokens.
    upstream = []
    attr = "logits_logprobs" if path == "logits" else "linear_logprobs"
    heavy = getattr(impl, attr)

    def catch_upstream_gradients(*a, **k):
        logp, entropy = heavy(*a, **k)
        for t in (logp, entropy):
            if t is not None and t.requires_grad:
                t.register_hook(lambda g: upstream.append(g.detach().clone()))
        return logp, entropy

    monkeypatch.setattr(impl, attr, catch_upstream_gradients)
    out, grads = run()
    monkeypatch.undo()
    assert torch.isfinite(out.loss) and out.loss.item() == pytest.approx(clean.loss.item(), rel=1e-6)
    for name, value in clean.metrics.items():
        if not name.startswith("fused_linear/"):  # the one-pass form's diagnostic; the two-pass run has none
            assert float(out.metrics[name]) == pytest.approx(float(value), rel=1e-6), name
    for got, want in zip(grads, clean_grads):  # the two-stage form against the one-call form: chunked differently
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    assert len(upstream) == 2  # dL/dlogp and dL/dentropy
    for g in upstream:  # every entry written; masked tokens get exactly 0
        assert torch.isfinite(g).all()
        assert torch.all(g.reshape(-1).cpu()[mask.reshape(-1) == 0] == 0)


# ---------------------------------------------------------------------------------------------
# Edge cases: all masked, empty, strided views, in-place backward.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_all_masked_batch_gives_zero_not_nan(backend, path):
    dev = _device(backend)
    V, H = 11, 8
    leaves = [torch.randn(3, 4, V if path == "logits" else H, device=dev, requires_grad=True)]
    if path == "linear":
        leaves.append(torch.randn(V, H, device=dev, requires_grad=True))
    labels = torch.full((3, 4), -100, device=dev)  # out of the vocabulary: fine where masked
    mask = torch.zeros(3, 4, device=dev)
    old = torch.full((3, 4), float("-inf"), device=dev)  # padding values must never leak into exp
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        cfg = gk.GSPOConfig(loss_type=loss_type, max_completion_length=4, beta=0.1, entropy_coef=0.1)
        out = _loss_fn(path)(*leaves, labels, torch.randn(3, device=dev), old, mask=mask, ref_logprobs=old,
                             config=cfg, backend=backend)
        grads = torch.autograd.grad(out.loss, leaves)
        assert out.loss.item() == 0.0, loss_type
        assert all(torch.all(g == 0) for g in grads), loss_type
        for name, value in out.metrics.items():
            assert torch.isfinite(value), name


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_empty_batches(backend, path):
    dev = _device(backend)
    V, H = 7, 5
    cases = [  # (token shape, advantages, cu_seqlens): no tokens at all, packed and padded
        ((0,), torch.randn(2), torch.tensor([0, 0, 0], dtype=torch.int32)),
        ((2, 0), torch.randn(2), None),
        ((0, 3), torch.randn(0), None),
    ]
    for shape, adv, cu in cases:
        leaves = [torch.randn(*shape, V if path == "logits" else H, device=dev, requires_grad=True)]
        if path == "linear":
            leaves.append(torch.randn(V, H, device=dev, requires_grad=True))
        out = _loss_fn(path)(*leaves, torch.zeros(shape, dtype=torch.long, device=dev), adv.to(dev),
                             cu_seqlens=None if cu is None else cu.to(dev), backend=backend)
        grads = torch.autograd.grad(out.loss, leaves)
        assert out.loss.item() == 0.0, shape
        assert grads[0].shape == leaves[0].shape and all(torch.all(g == 0) for g in grads), shape
        assert all(torch.isfinite(v) for v in out.metrics.values()), shape


def test_strided_logits_and_inplace_backward(backend):
    """A ``logits[:, :-1]`` view: right gradients, nothing outside the view touched; with
    ``inplace_backward`` the gradient lands in the logits' own storage (no ``[N, V]`` buffer)."""
    dev = _device(backend)
    B, T, V = 3, 6, 50
    full = torch.randn(B, T + 1, V)
    labels = torch.randint(0, V, (B, T))
    adv = torch.tensor([1.0, 0.0, -2.0])
    old = reference.token_logprobs(full[:, :-1].double(), labels).float() - 1e-4
    x64 = full[:, :-1].double().requires_grad_()
    (ref_grad,) = torch.autograd.grad(reference.gspo_loss(x64, labels, adv, old).loss, x64)
    args = (labels.to(dev), adv.to(dev), old.to(dev))

    leaf = full.clone().to(dev).requires_grad_()
    out = gk.gspo_loss(leaf[:, :-1], *args, backend=backend)  # a non-contiguous view
    (grad,) = torch.autograd.grad(out.loss, leaf)
    assert rel_err(grad[:, :-1].cpu(), ref_grad) < RTOL
    assert torch.all(grad[:, -1] == 0)

    buffer = full.clone().to(dev)
    view = buffer[:, :-1].requires_grad_()  # a leaf view: its gradient lands in buffer's storage
    gk.gspo_loss(view, *args, backend=backend, inplace_backward=True).loss.backward()
    assert rel_err(buffer[:, :-1].cpu(), ref_grad) < RTOL  # the gradient was written into the logits' storage
    assert torch.all(buffer[1, :-1] == 0)  # zero advantage: the consumed logits hold exactly zero
    assert torch.equal(buffer[:, -1].cpu(), full[:, -1])  # outside the view nothing is touched

    contiguous = full[:, :-1].contiguous().to(dev).requires_grad_()
    gk.gspo_loss(contiguous, *args, backend=backend, inplace_backward=True).loss.backward()
    assert contiguous.grad.data_ptr() == contiguous.data_ptr()  # no [N, V] gradient buffer was allocated
    assert rel_err(contiguous.grad.cpu(), ref_grad) < RTOL

    nonleaf_base = full.clone().to(dev).requires_grad_()
    logits = nonleaf_base * 1.0  # a model's output: not a leaf
    gk.gspo_loss(logits[:, :-1], *args, backend=backend, inplace_backward=True).loss.backward()
    assert rel_err(nonleaf_base.grad[:, :-1].cpu(), ref_grad) < RTOL


# ---------------------------------------------------------------------------------------------
# gspo-kernels verify can fail.
# ---------------------------------------------------------------------------------------------


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.05


@pytest.mark.parametrize("path", ["logits", "linear", "two-pass"])
def test_verify_fails_on_a_5_percent_bf16_gradient_error(path, monkeypatch):
    """``verify`` passes the torch backend as it is, and fails it once its bf16 gradients are 5% off (on each of
    its paths: the two-pass one through ``linear_logprobs`` with autograd)."""
    assert testing.gradient_tolerance("bf16", "linear" if path == "two-pass" else path) <= 2.0**-6
    row = verify.check_case("torch", path, "sequence", "grpo", "bf16", seed=3)
    assert row.ok, row
    impl = backends.load("torch")
    attr = "logits_logprobs" if path == "logits" else "linear_logprobs"
    original = getattr(impl, attr)

    def perturbed(*args, **kwargs):
        logp, entropy = original(*args, **kwargs)
        return _ScaleGradient.apply(logp), entropy

    monkeypatch.setattr(impl, attr, perturbed)
    row = verify.check_case("torch", path, "sequence", "grpo", "bf16", seed=3)
    assert not row.ok and row.grad_err > 0.04 and row.loss_err <= row.loss_tol, row


def test_verify_keeps_importance_weights_off_the_clip_edges():
    """``verify`` draws its old log-probs so that no weight sits within 5e-5 of a clip edge (where fp32 and float64
    may clip differently: a discontinuous difference, not an error), and both sides of the band occur."""
    gen = torch.Generator().manual_seed(0)
    log_w = verify.log_weight_offsets(20000, gen)
    low, high = math.log(1 - 3e-4), math.log(1 + 4e-4)
    assert float(torch.minimum((log_w - low).abs(), (log_w - high).abs()).min()) >= 5e-5
    inside = (log_w > low) & (log_w < high)
    assert 0.4 < float(inside.double().mean()) < 0.6 and bool((log_w > high).any()) and bool((log_w < low).any())


# ---------------------------------------------------------------------------------------------
# Labels of any stride, and rollout-masked tokens whose importance weight overflows fp32.
# ---------------------------------------------------------------------------------------------


def _label_layouts(V: int, device: str):
    """``(name, labels)`` of N = 6 tokens held in memory in unusual ways (all in ``[0, V)``)."""
    base = torch.randint(0, V, (12,), device=device)
    wide = torch.randint(0, V, (6, 3), device=device)
    return [
        ("strided", base[::2]),  # 1-D, stride 2
        ("stride0", torch.tensor(V - 1, device=device).expand(6)),  # 1-D, stride 0
        ("column", wide[:, 1]),  # a column of a row-major matrix, stride 3
        ("int32-strided", base.to(torch.int32)[1::2]),
    ]


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_labels_of_any_stride_match_the_reference(backend, path):
    device, V, H = _device(backend), 37, 16
    gen = torch.Generator(device="cpu").manual_seed(7)
    for name, labels in _label_layouts(V, device):
        assert not labels.is_contiguous() or labels.stride() == (0,)
        if path == "logits":
            x = torch.randn(6, V, generator=gen).to(device).requires_grad_()
            logp, ent = gk.token_logprobs(x, labels, return_entropy=True, backend=backend)
            xr = x.detach().double().requires_grad_()
            rlogp, rent = reference.token_logprobs(xr, labels.contiguous(), return_entropy=True)
            inputs, ref_inputs = (x,), (xr,)
        else:
            h = torch.randn(6, H, generator=gen).to(device).requires_grad_()
            w = (torch.randn(V, H, generator=gen) * 0.3).to(device).requires_grad_()
            logp, ent = gk.linear_logprobs(h, w, labels, return_entropy=True, backend=backend)
            hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
            rlogp, rent = reference.linear_logprobs(hr, wr, labels.contiguous(), return_entropy=True)
            inputs, ref_inputs = (h, w), (hr, wr)
        assert rel_err(logp, rlogp) < RTOL and rel_err(ent, rent) < RTOL, name
        weights = torch.linspace(-1, 1, 6, device=device)
        grads = torch.autograd.grad((logp * weights).sum() + ent.sum(), inputs)
        ref_grads = torch.autograd.grad((rlogp * weights.double()).sum() + rent.sum(), ref_inputs)
        for g, rg in zip(grads, ref_grads):
            assert rel_err(g, rg) < RTOL, name


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_strided_labels_in_the_loss_match_the_reference(backend, path):
    device, V, H, B, T = _device(backend), 29, 8, 2, 5
    gen = torch.Generator(device="cpu").manual_seed(3)
    labels = torch.randint(0, V, (T, B), generator=gen).to(device).t()  # [B, T], transposed storage
    assert not labels.is_contiguous()
    adv = torch.tensor([1.0, -0.5], device=device)
    old = (torch.randn(B, T, generator=gen) * 0.1 - 3).to(device)
    cfg = gk.GSPOConfig(importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.2)
    if path == "logits":
        x = torch.randn(B, T, V, generator=gen).to(device).requires_grad_()
        out = gk.gspo_loss(x, labels, adv, old, config=cfg, backend=backend)
        xr = x.detach().double().requires_grad_()
        ref = reference.gspo_loss(xr, labels.contiguous(), adv.double(), old.double(), config=cfg)
        pairs = [(x, xr)]
    else:
        h = torch.randn(B, T, H, generator=gen).to(device).requires_grad_()
        w = (torch.randn(V, H, generator=gen) * 0.3).to(device).requires_grad_()
        out = gk.fused_linear_gspo_loss(h, w, labels, adv, old, config=cfg, backend=backend)
        hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        ref = reference.fused_linear_gspo_loss(hr, wr, labels.contiguous(), adv.double(), old.double(), config=cfg)
        pairs = [(h, hr), (w, wr)]
    assert abs(out.loss.item() - ref.loss.item()) < RTOL * max(1.0, abs(ref.loss.item()))
    grads = torch.autograd.grad(out.loss, [p for p, _ in pairs])
    ref_grads = torch.autograd.grad(ref.loss, [r for _, r in pairs])
    for g, rg in zip(grads, ref_grads):
        assert rel_err(g, rg) < RTOL


@pytest.mark.parametrize("level", ["token", "sequence_token", "sequence"])
def test_rollout_masked_token_with_overflowing_weight_is_finite(backend, level):
    """``is_ratio = 0`` drops a token; its importance weight ``exp(97)`` overflows fp32 (not float64). The
    loss and the gradient stay finite and equal the float64 reference's (no ``inf * 0``)."""
    device = _device(backend)
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.5, -0.5]], device=device).requires_grad_()
    old = logp.detach().clone()
    old[0, 1] = -99.0  # log-ratio 97 at the dropped token
    is_ratio = torch.ones(2, 3, device=device)
    is_ratio[0, 1] = 0.0
    adv = torch.tensor([-1.0, 1.0], device=device)  # A < 0: the unclipped branch would carry the weight
    cfg = gk.GSPOConfig(importance_sampling_level=level, epsilon_low=0.2, epsilon_high=0.2)
    out = gk.policy_loss(logp, adv, old, is_ratio=is_ratio, config=cfg, backend=backend)
    (g,) = torch.autograd.grad(out.loss, logp)
    lp = logp.detach().double().requires_grad_()
    ref = reference.policy_loss(lp, adv.double(), old.double(), is_ratio=is_ratio.double(), config=cfg)
    (rg,) = torch.autograd.grad(ref.loss, lp)
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    if level == "token":  # the sequence levels' weight of response 0 is exp(97 / 3): finite in fp32, compare
        assert abs(out.loss.item() - ref.loss.item()) < RTOL * max(1.0, abs(ref.loss.item()))
    assert rel_err(g, rg) < 1e-4
