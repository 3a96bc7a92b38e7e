"""``backend="triton"`` on the logits path at its edges, against the float64 oracle (``gspo_kernels.reference``):
adversarial values, views, host reads and devices; rows at every alignment and the final-logit soft cap; the fused
objective's gradient against autograd. The common cases are in ``test_triton_logits.py``; the interpreter and
tolerances as there.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import gspo_kernels as gk  # noqa: E402
from gspo_kernels import reference  # noqa: E402
from gspo_kernels.backends.triton import logits, sequence  # noqa: E402
from gspo_kernels.backends.triton.logits import logprobs_backward, logprobs_forward  # noqa: E402
from gspo_kernels.config import IMPORTANCE_SAMPLING_LEVELS, GSPOConfig  # noqa: E402
from gspo_kernels.options import CallOptions  # noqa: E402
from gspo_kernels.testing import gradient_tolerance, rel_err  # noqa: E402
from tests.backends.triton.test_triton_logits import _close, _loss_case  # noqa: E402
from tests.support import NewTensors, triton_test_device  # noqa: E402

DEVICE = triton_test_device()


# --- Edge inputs (adversarial values, views, host reads, devices): each test below failed before its fix. -------------




def _softmax_stats64(x64, labels, temperature=1.0):
    """Float64 log-prob of the label and entropy, with ``0 * log 0 = 0`` (``-inf`` logits allowed)."""
    logp_all = torch.log_softmax(x64.reshape(-1, x64.shape[-1]) / temperature, dim=-1)
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    return logp_all.gather(1, labels.reshape(-1, 1).cpu())[:, 0], entropy


def _grads_vs_float64(x, labels, g, h, temperature=1.0):
    """(d(g.logp + h.H)/dx from the Triton backend, the same from float64, logp, H, and their float64 values)."""
    xr = x.detach().clone().requires_grad_(True)
    logp, entropy = gk.token_logprobs(xr, labels, temperature=temperature, return_entropy=True, backend="triton")
    (logp * g + entropy * h).sum().backward()
    x64 = x.detach().cpu().double().requires_grad_(True)
    ref_logp, ref_entropy = _softmax_stats64(x64, labels, temperature)
    (ref_logp * g.cpu().double() + ref_entropy * h.cpu().double()).sum().backward()
    return xr.grad.cpu().double(), x64.grad, logp, entropy, ref_logp, ref_entropy


def test_minus_inf_logits_give_finite_gradients_with_entropy():
    """test_adversarial.py's class 1: a -inf logit on a non-label column, the entropy carrying gradient:
    ``p * (log p + H)`` with ``p = 0`` and ``log p = -inf`` was NaN."""
    V = 40
    x = torch.randn(6, V, device=DEVICE) * 2
    x[:, 0] = float("-inf")
    x[2, 5:30] = float("-inf")  # a row with most of its vocabulary masked out
    labels = torch.randint(1, 5, (6,), device=DEVICE)
    g, h = torch.randn(6, device=DEVICE), torch.randn(6, device=DEVICE)
    grad, ref_grad, logp, entropy, ref_logp, ref_entropy = _grads_vs_float64(x, labels, g, h, temperature=0.7)
    assert torch.isfinite(grad).all() and torch.isfinite(entropy).all()
    _close(logp, ref_logp)
    _close(entropy, ref_entropy)
    _close(grad, ref_grad, atol=1e-6)
    assert torch.equal(grad[:, 0], torch.zeros(6, dtype=grad.dtype))


def test_minus_inf_logits_in_the_loss_with_entropy_coef():
    """Class 1 reproducer, the whole loss: finite and equal to float64 (torch backend on float64 logits)."""
    x = torch.randn(2, 4, 11)
    x[..., 0] = float("-inf")
    y = torch.randint(1, 11, (2, 4))
    adv = torch.tensor([1.0, -1.0])
    config = GSPOConfig(entropy_coef=0.01)
    xl = x.clone().to(DEVICE).requires_grad_()
    out = gk.gspo_loss(xl, y.to(DEVICE), adv.to(DEVICE), config=config, backend="triton")
    out.loss.backward()
    x64 = x.double().requires_grad_()
    ref = gk.gspo_loss(x64, y, adv.double(), config=config, backend="torch")
    ref.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(xl.grad).all()
    _close(out.loss, ref.loss)
    _close(out.metrics["entropy"], ref.metrics["entropy"])
    _close(xl.grad, x64.grad, atol=1e-7)


@pytest.mark.parametrize("case", ["offset_1e4", "temperature_1e-6"])
def test_precision_huge_offsets_and_tiny_temperature(case):
    """test_adversarial.py's class 4: fp32 logits near 1e4 (a single fp32 logsumexp rounds to ~5e-4 there) and
    temperature 1e-6: gradients within 1e-5 of float64 (relative to their largest magnitude)."""
    N, V = 8, 300
    if case == "offset_1e4":
        x, temperature = torch.randn(N, V, device=DEVICE) + 1e4, 1.0
    else:
        x, temperature = torch.randn(N, V, device=DEVICE), 1e-6
        x[0, :2] = x[0].max() + torch.tensor([0.0, 3e-7], device=DEVICE)  # two near-tied maxima: p far from one-hot
    labels = torch.randint(0, V, (N,), device=DEVICE)
    labels[0] = 0
    g, h = torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE)
    grad, ref_grad, logp, entropy, ref_logp, ref_entropy = _grads_vs_float64(x, labels, g, h, temperature)
    scale = float(ref_grad.abs().max())
    assert float((grad - ref_grad).abs().max()) <= 1e-5 * scale, float((grad - ref_grad).abs().max()) / scale
    _close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    _close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)


def test_out_of_range_labels_are_never_read():
    """Decision 5: with the eager check skipped (torch.compile) an unmasked -100 or V must not be used as an
    address: the logits sit inside a larger buffer whose neighbouring elements are finite, so an
    out-of-bounds read would give a finite, wrong log-prob. The row's log-prob (and gradient) is NaN."""
    from gspo_kernels.backends.triton.logits import logits_logprobs

    V = 23
    storage = torch.randn(8, V, device=DEVICE)
    x = storage[1:-1].detach().requires_grad_(True)  # shares the storage: rows 0 and 7 are its neighbours
    labels = torch.tensor([3, -100, -1, V, 5, 0], device=DEVICE)
    logp, _ = logits_logprobs(x, labels, options=CallOptions(return_entropy=False))
    bad = torch.tensor([False, True, True, True, False, False])
    assert torch.isnan(logp.cpu()[bad]).all() and torch.isfinite(logp.cpu()[~bad]).all()
    g = torch.ones(6, device=DEVICE)
    g[3] = 0.0  # an out-of-range row without gradient stays finite (zeros)
    (grad,) = torch.autograd.grad(logp, x, g)
    assert torch.isnan(grad.cpu()[[1, 2]]).all() and torch.equal(grad.cpu()[3], torch.zeros(V))
    assert torch.isfinite(grad.cpu()[[0, 4, 5]]).all()


@pytest.mark.parametrize("inplace", [False, True])
def test_shifted_logits_no_second_logits_sized_buffer(inplace):
    """``model_output[:, :-1]`` with ``[B, T + 1, V]`` model output. Counted with a dispatch mode
    during the backward: no new logits-sized tensor with ``inplace_backward`` (the gradient is written
    into the model output), exactly one (the gradient) without; autograd's ``slice_backward`` never runs.
    The gradient equals float64's, with zeros at the last position."""
    B, T, V = 3, 5, 64
    base = torch.randn(B, T + 1, V)
    leaf = base.clone().to(DEVICE).requires_grad_(True)
    model_out = leaf * 1.0  # a non-leaf, like a model's output
    labels = torch.randint(0, V, (B, T), device=DEVICE)
    adv = torch.tensor([1.0, -0.5, 0.3], device=DEVICE)
    config = GSPOConfig(entropy_coef=0.01, importance_sampling_level="token")
    out = gk.gspo_loss(model_out[:, :-1], labels, adv, config=config, backend="triton", inplace_backward=inplace)
    with NewTensors(min_numel=B * T * V) as allocations:
        (grad,) = torch.autograd.grad(out.loss, model_out)
    assert "aten.slice_backward.default" not in allocations.ops
    assert len(allocations.big) == (0 if inplace else 1), allocations.big
    if inplace:
        assert grad.data_ptr() == model_out.data_ptr()
    x64 = base.double().requires_grad_(True)
    ref = gk.gspo_loss(x64[:, :-1], labels.cpu(), adv.cpu().double(), config=config, backend="torch")
    ref.loss.backward()
    assert torch.equal(grad[:, -1].cpu(), torch.zeros(B, V))
    _close(grad, x64.grad, atol=1e-7)


def test_views_that_are_not_a_plain_shift_keep_their_own_gradient():
    """Only an exact ``[:, :-1]`` slice is routed to its base: other views (a shift from the left, a narrowed
    vocabulary) go through autograd's own view backward and stay right."""
    B, T, V = 2, 4, 30
    for take in (lambda t: t[:, 1:], lambda t: t[:, :-1, :V - 2], lambda t: t[:, :-2]):
        base = torch.randn(B, T + 1, V, device=DEVICE, requires_grad=True)
        view = take(base)
        labels = torch.randint(0, view.shape[-1], view.shape[:2], device=DEVICE)
        logp = gk.token_logprobs(view, labels, backend="triton")
        (grad,) = torch.autograd.grad(logp.sum(), base)
        b64 = base.detach().double().requires_grad_(True)
        ref = torch.log_softmax(take(b64), -1).gather(-1, labels[..., None]).sum()
        ref.backward()
        _close(grad, b64.grad, atol=1e-7)


def test_logits_path_autograd_has_no_host_synchronization():
    """No ``.item()`` / ``nonzero`` / ``.any()`` in the logits path's autograd (forward, backward
    and the sequence stage), so it can be captured in a CUDA graph. Recorded under a dispatch mode."""
    from gspo_kernels.backends.triton.logits import logits_logprobs
    from gspo_kernels.backends.triton.sequence import fused_objective

    base, logits, labels, adv, old, kwargs = _loss_case("padded", adv_per_token=False)
    x = base.clone().to(DEVICE).requires_grad_(True)
    config = GSPOConfig(entropy_coef=0.01, beta=0.04)
    inputs = _prepared(labels, adv, old, kwargs["mask"], config, V=base.shape[-1])
    syncs = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default",
             "aten.item.default", "aten.equal.default"}
    with NewTensors(min_numel=1 << 60) as record:
        logp, entropy = logits_logprobs(x[:, :-1], inputs.labels, active=inputs.batch.mask > 0, options=CallOptions(temperature=config.temperature, return_entropy=True))
        loss = fused_objective(logp, entropy, inputs, config).loss
        loss.backward()
    assert not syncs & set(record.ops), syncs & set(record.ops)
    assert x.grad is not None and torch.isfinite(x.grad).all()


def _prepared(labels, adv, old, mask, config, V):
    """The validated inputs of ``gspo_loss`` (built outside the recorded region: the eager value checks
    read values on purpose)."""
    from gspo_kernels.layout import LossTensors, prepare_loss_inputs

    return prepare_loss_inputs(labels.to(DEVICE), V, LossTensors(adv.to(DEVICE), old_logprobs=old.to(DEVICE), mask=mask.to(DEVICE),
                               ref_logprobs=old.to(DEVICE)), beta=config.beta)


@pytest.mark.parametrize("level", IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("clip", ["all_clipped", "delta"])
def test_overflowing_importance_weight_never_gives_nan(level, clip):
    """test_adversarial.py's class 5: ``old = logp - 100`` (w = e^100: inf in fp32, finite in float64). Every response
    clipped (A > 0), or ``delta = 2`` capping the weight (A of both signs): a zero gradient meets the inf
    weight and must stay 0. The loss and the gradient match float64."""
    B, T, V = 3, 4, 17
    base = torch.randn(B, T + 1, V)
    labels = torch.randint(0, V, (B, T))
    old = reference.token_logprobs(base[:, :-1], labels).float() - 100.0
    if clip == "all_clipped":
        adv, config = torch.tensor([1.0, 0.5, 0.0]), GSPOConfig(importance_sampling_level=level)
    else:
        adv, config = torch.tensor([1.0, -0.5, 0.0]), GSPOConfig(importance_sampling_level=level, delta=2.0)
    x = base.clone().to(DEVICE).requires_grad_(True)
    out = gk.gspo_loss(x[:, :-1], labels.to(DEVICE), adv.to(DEVICE), old.to(DEVICE), config=config,
                       backend="triton")
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(x.grad).all()
    x64 = base.double().requires_grad_(True)
    ref = reference.gspo_loss(x64[:, :-1], labels, adv.double(), old.double(), config=config)
    ref.loss.backward()
    _close(out.loss, ref.loss)
    _close(x.grad, x64.grad, atol=1e-7)


def test_every_launch_runs_under_the_device_guard(monkeypatch):
    """Each launcher enters ``device_guard`` of its tensors (Triton launches on the *current* CUDA
    device otherwise). The GPU test below checks the behaviour on two devices."""
    import contextlib

    seen = []

    def recording_guard(tensor):
        seen.append(tensor.device)
        return contextlib.nullcontext()

    for module in (logits, sequence):
        monkeypatch.setattr(module, "device_guard", recording_guard)
    x = torch.randn(2, 3, 9, device=DEVICE, requires_grad=True)
    out = gk.gspo_loss(x, torch.randint(0, 9, (2, 3), device=DEVICE), torch.ones(2, device=DEVICE),
                       backend="triton", config=GSPOConfig(entropy_coef=0.1))
    out.loss.backward()
    assert len(seen) == 3  # forward, sequence stage (both its kernels), backward


@pytest.mark.gpu
def test_gpu_tensors_on_a_non_current_device():
    """Tensors on ``cuda:1`` while ``cuda:0`` is current: same results as on ``cuda:0``."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    torch.cuda.set_device(0)
    x = torch.randn(64, 1000)
    labels = torch.randint(0, 1000, (64,))
    results = []
    for device in ("cuda:0", "cuda:1"):
        xd = x.to(device).requires_grad_(True)
        logp, entropy = gk.token_logprobs(xd, labels.to(device), return_entropy=True, backend="triton")
        (logp.sum() + entropy.sum()).backward()
        torch.cuda.synchronize(device)
        results.append((logp.cpu(), entropy.cpu(), xd.grad.cpu()))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True])
def test_gpu_peak_memory_shifted_logits(inplace):
    """A model's ``[B, T+1, V]`` output read as ``[:, :-1]``: beyond the output itself, the backward needs the
    gradient buffer (out of place) or nothing logits-sized (in place); ``slice_backward``'s second
    ``[B, T+1, V]`` buffer is gone."""
    B, T, V = 4, 1023, 32768
    leaf = torch.randn(B, T + 1, V, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    model_out = leaf * 1.0
    labels = torch.randint(0, V, (B, T), device="cuda")
    adv = torch.randn(B, device="cuda")
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = gk.gspo_loss(model_out[:, :-1], labels, adv, backend="triton", inplace_backward=inplace,
                       config=GSPOConfig(importance_sampling_level="token", entropy_coef=0.01))
    (grad,) = torch.autograd.grad(out.loss, [model_out])
    extra = torch.cuda.max_memory_allocated() - start
    logits_bytes = B * (T + 1) * V * 2
    token_bytes = 64 * B * (T + 1) * 4
    assert grad.shape == model_out.shape and torch.equal(grad[:, -1], torch.zeros_like(grad[:, -1]))
    if inplace:
        assert grad.data_ptr() == model_out.data_ptr()
        assert extra <= token_bytes, extra
    else:
        assert extra <= logits_bytes + token_bytes, extra


@triton.jit
def _to_bf16_kernel(x_ptr, explicit_ptr, implicit_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok)
    tl.store(explicit_ptr + offs, x.to(tl.bfloat16), mask=ok)
    tl.store(implicit_ptr + offs, x, mask=ok)  # the store converts to the pointer's bf16


def test_bf16_casts_round_to_nearest_even_as_on_the_gpu():
    """fp32 -> bf16 inside a kernel gives the bits of ``Tensor.to(torch.bfloat16)`` (round to nearest even): on a
    GPU natively, in the interpreter through ``testing.round_interpreter_bf16_casts`` (its own cast truncates).
    Magnitudes over 60 decades, ties of both parities, the largest finite values, infinities, NaN, signed zeros
    (subnormals left out: a GPU may flush them)."""
    one_ulp = 2.0**-7
    x = torch.cat([
        torch.randn(3000) * 10.0 ** torch.randint(-30, 30, (3000,)).float(),
        torch.tensor([1 + one_ulp / 2, 1 + 3 * one_ulp / 2, -(1 + one_ulp / 2), 2 - one_ulp / 4, 3.3895e38, 3.40e38,
                      -3.40e38, float("inf"), -float("inf"), float("nan"), 0.0, -0.0]),
    ]).to(DEVICE)
    explicit = torch.empty(x.numel(), dtype=torch.bfloat16, device=DEVICE)
    implicit = torch.empty_like(explicit)
    _to_bf16_kernel[(1,)](x, explicit, implicit, x.numel(), BLOCK=4096)
    want = x.to(torch.bfloat16).view(torch.int16)
    for got in (explicit, implicit):
        assert torch.equal(got.view(torch.int16)[~x.isnan()], want[~x.isnan()])
        assert got[x.isnan()].isnan().all()


# ---------------------------------------------------------------------------------------------
# Rows at any alignment (the aligned, unmasked body and its masked edge) and the final-logit soft cap.
# ---------------------------------------------------------------------------------------------


def _capped_stats64(x64, labels, temperature, cap):
    """Float64 log-prob and entropy of ``log_softmax(cap * tanh(z / cap) / T)`` (``cap`` None: no cap)."""
    z = x64 if cap is None else cap * torch.tanh(x64 / cap)
    return _softmax_stats64(z, labels, temperature)


@pytest.mark.parametrize("dtype,V", [(torch.bfloat16, 8195), (torch.float32, 4103), (torch.bfloat16, 3),
                                     (torch.float32, 1)])
def test_rows_at_every_alignment_match_float64(dtype, V):
    """``V % 16 != 0`` in a ``[B, T + 1, V][:, :-1]`` view: consecutive rows start at every offset modulo 16
    bytes, so each has its own unaligned head before the aligned body (2 full tiles at these V), then a masked
    tail. Forward, the backward out of place (into the ``T + 1`` base, and into a buffer whose rows are aligned
    differently from the logits') and in place: all against float64."""
    B, T = 3, 3
    base = (torch.randn(B, T + 1, V) * 3).to(dtype).to(DEVICE)
    if V > 1:
        base[0, 1, min(V - 1, 5)] = float("-inf")  # a -inf logit in the body or the head
    x = base[:, :-1]
    labels = torch.randint(0, V, (B * T,), device=DEVICE)
    g, h = torch.randn(B * T, device=DEVICE), torch.randn(B * T, device=DEVICE)
    g[4] = h[4] = 0.0  # a row without gradient: zeros, its logits not read
    logp, entropy, row_stats = logprobs_forward(x, labels, temperature=0.8, return_entropy=True)
    x64 = x.cpu().double().requires_grad_(True)
    ref_logp, ref_entropy = _softmax_stats64(x64, labels, 0.8)
    _close(logp, ref_logp, rtol=1e-5, atol=2e-6)
    _close(entropy, ref_entropy, rtol=1e-5, atol=2e-6)
    (ref_logp * g.cpu().double() + ref_entropy * h.cpu().double()).sum().backward()
    expected = x64.grad
    tol = gradient_tolerance("bf16" if dtype == torch.bfloat16 else "fp32", "logits")
    scale = float(expected.abs().max())

    def check(got):
        assert torch.isfinite(got).all()
        assert float((got.cpu().double() - expected).abs().max()) <= tol * scale + 1e-12
        assert torch.equal(got.reshape(-1, V)[4].cpu(), torch.zeros(V, dtype=dtype))

    full = torch.full((B, T + 1, V), float("nan"), device=DEVICE, dtype=dtype)
    grad = logprobs_backward(x, labels, row_stats, entropy, g, h, temperature=0.8, out=full)
    check(grad[:, :-1])
    assert torch.equal(grad[:, -1].cpu(), torch.zeros(B, V, dtype=dtype))
    shifted = torch.full((B, T, V + 1), float("nan"), device=DEVICE, dtype=dtype)[..., 1:]  # other alignment
    check(logprobs_backward(x, labels, row_stats, entropy, g, h, temperature=0.8, out=shifted))
    strided = torch.full((V, B, T), float("nan"), device=DEVICE, dtype=dtype).permute(1, 2, 0)  # vocab stride B*T
    check(logprobs_backward(x, labels, row_stats, entropy, g, h, temperature=0.8, out=strided))
    consumed = base.clone()
    check(logprobs_backward(consumed[:, :-1], labels, row_stats, entropy, g, h, temperature=0.8, inplace=True))


@pytest.mark.parametrize("dtype,V", [(torch.float32, 2051), (torch.bfloat16, 4160), (torch.float64, 70)])
def test_softcap_logits_path_matches_float64(dtype, V):
    """``softcap = c``: ``log_softmax(c tanh(z / c) / T)`` against float64 (torch's ``tanh``), logits well past the
    cap (tanh saturates) and near 0 (its series), a ``-inf`` logit (capped to ``-c``: finite gradient 0). Forward,
    ``row_stats[0]`` (the max capped logit) and the gradient through the backend's autograd, with the
    ``[B, T + 1, V][:, :-1]`` view."""
    from gspo_kernels.backends.triton.logits import logits_logprobs

    cap, T, B, S = 5.0, 0.7, 2, 3
    raw = torch.randn(B, S + 1, V, dtype=torch.float64) * 6
    raw[0, 0, :40] = torch.linspace(-1.0, 1.0, 40)  # |u| below and above the series' threshold
    raw[1, 2, 3] = float("-inf")
    base = raw.to(dtype).to(DEVICE).requires_grad_(True)
    labels = torch.randint(0, V, (B * S,), device=DEVICE)
    labels[-1] = 3  # the -inf logit is a label: its log-prob is finite under the cap
    logp, entropy = logits_logprobs(base[:, :-1], labels, options=CallOptions(temperature=T, return_entropy=True, softcap=cap))
    g, h = torch.randn(B * S, dtype=logp.dtype, device=DEVICE), torch.randn(B * S, dtype=logp.dtype, device=DEVICE)
    (grad,) = torch.autograd.grad((logp * g + entropy * h).sum(), base)
    x64 = base.detach().cpu().double().requires_grad_(True)
    ref_logp, ref_entropy = _capped_stats64(x64[:, :-1], labels, T, cap)
    (ref_logp * g.cpu().double() + ref_entropy * h.cpu().double()).sum().backward()
    rtol, atol = (1e-7, 1e-7) if dtype == torch.float64 else (1e-5, 2e-6)
    _close(logp, ref_logp, rtol=rtol, atol=atol)
    _close(entropy, ref_entropy, rtol=rtol, atol=atol)
    tol = gradient_tolerance("bf16" if dtype == torch.bfloat16 else "fp32", "logits")
    scale = float(x64.grad.abs().max())
    assert float((grad.cpu().double() - x64.grad).abs().max()) <= tol * scale
    assert torch.equal(grad[:, -1].cpu(), torch.zeros(B, V, dtype=dtype)) and float(grad[1, 2, 3]) == 0.0
    _, _, row_stats = logprobs_forward(base.detach()[:, :-1], labels, temperature=T, softcap=cap)
    _close(row_stats[0], (cap * torch.tanh(x64.detach()[:, :-1] / cap)).reshape(-1, V).max(-1).values,
           rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_softcap_hidden_state_paths_match_float64(batch_invariant):
    """Both modes of the triton ``linear_logprobs`` with ``softcap``: ``c tanh((h W^T + b) / c) / T``. The bias sits
    far from 0 (a max-subtracted bias would change the capped logits); V = 37 is not a multiple of 16. Log-probs,
    entropy and the hidden, weight and bias gradients against float64."""
    from gspo_kernels.backends import triton as triton_backend

    N, H, V, cap, T = 12, 16, 37, 4.0, 0.8
    hidden, weight, bias = torch.randn(N, H), torch.randn(V, H) * 0.7, torch.randn(V) + 3.0
    labels = torch.randint(0, V, (N,))
    g, gh = torch.randn(N), torch.randn(N)
    leaves = [t.clone().to(DEVICE).requires_grad_(True) for t in (hidden, weight, bias)]
    logp, entropy = triton_backend.linear_logprobs(*leaves, labels.to(DEVICE), options=CallOptions(temperature=T, return_entropy=True, softcap=cap, batch_invariant=batch_invariant))
    grads = torch.autograd.grad((logp * g.to(DEVICE) + entropy * gh.to(DEVICE)).sum(), leaves)
    ref_leaves = [t.double().requires_grad_(True) for t in (hidden, weight, bias)]
    z64 = ref_leaves[0] @ ref_leaves[1].T + ref_leaves[2]
    ref_logp, ref_entropy = _capped_stats64(z64, labels, T, cap)
    ref_grads = torch.autograd.grad((ref_logp * g.double() + ref_entropy * gh.double()).sum(), ref_leaves)
    _close(logp, ref_logp)
    _close(entropy, ref_entropy)
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) <= 1e-5, rel_err(got, want)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_softcap_one_pass_fused_linear_loss_matches_float64(layout, monkeypatch):
    """The one-pass ``fused_linear_loss`` (gradient formed during the forward) with ``softcap``, reached through
    ``fused_linear_gspo_loss`` with the backend's two entry points bound to the cap: loss and gradients equal
    float64's GSPO loss over ``c tanh(z / c)`` logits (the reference divides them by the temperature)."""
    import dataclasses

    from gspo_kernels import backends as registry

    cap = 3.0
    impl = registry.load("triton")
    def capped(entry):  # the pipeline passes the call's options last among the positional arguments; a loss's
        # options hold its config's cap (they must agree), so both are bound
        def call(*args, **kwargs):
            config = dataclasses.replace(args[-1].config, final_logit_softcapping=cap)
            return entry(*args[:-1], dataclasses.replace(args[-1], softcap=cap, config=config), **kwargs)
        return call

    monkeypatch.setattr(impl, "fused_linear_loss", capped(impl.fused_linear_loss))
    monkeypatch.setattr(impl, "linear_logprobs", capped(impl.linear_logprobs))
    S, T, H, V = 3, 5, 16, 29
    config = GSPOConfig(temperature=0.9, entropy_coef=0.01, importance_sampling_level="sequence")
    hidden, weight, bias = torch.randn(S, T, H), torch.randn(V, H), torch.randn(V)
    labels = torch.randint(0, V, (S, T))
    adv = torch.tensor([1.0, -0.7, 0.4])
    mask = torch.ones(S, T)
    mask[1, 3:] = 0
    kwargs = {"mask": mask}
    if layout == "packed":
        keep = mask.reshape(-1) > 0
        hidden, labels = hidden.reshape(-1, H)[keep], labels.reshape(-1)[keep]
        kwargs = {"cu_seqlens": torch.tensor([0, 5, 8, 13], dtype=torch.int32)}
    with torch.no_grad():
        z64 = cap * torch.tanh((hidden.double() @ weight.double().T + bias.double()) / cap)
        old = (reference.token_logprobs(z64 / config.temperature, labels) - 1e-3).float()
    leaves = [t.clone().to(DEVICE).requires_grad_(True) for t in (hidden, weight, bias)]
    out = gk.fused_linear_gspo_loss(leaves[0], leaves[1], labels.to(DEVICE), adv.to(DEVICE), old.to(DEVICE),
                                    bias=leaves[2], config=config, backend="triton",
                                    **{k: v.to(DEVICE) for k, v in kwargs.items()})
    assert "fused_linear/two_pass_tokens" in out.metrics  # the one-pass form ran
    grads = torch.autograd.grad(out.loss, leaves)
    ref_leaves = [t.double().requires_grad_(True) for t in (hidden, weight, bias)]
    logits64 = cap * torch.tanh((ref_leaves[0] @ ref_leaves[1].T + ref_leaves[2]) / cap)
    ref = reference.gspo_loss(logits64, labels, adv.double(), old.double(), config=config, **kwargs)
    ref_grads = torch.autograd.grad(ref.loss, ref_leaves)
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5 * max(1.0, abs(ref.loss.item()))
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) <= 1e-5, rel_err(got, want)


def test_softcap_must_be_finite_and_positive():
    """The options a backend's entry points take refuse a cap that is not a finite number > 0, naming ``softcap``,
    as they are built (the public functions check ``final_logit_softcapping`` before; a backend checks nothing
    again)."""
    from gspo_kernels.backends import triton as triton_backend
    from gspo_kernels.backends.triton.logits import logits_logprobs

    x, labels = torch.randn(2, 8, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)
    hidden, weight = torch.randn(2, 4, device=DEVICE), torch.randn(8, 4, device=DEVICE)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            logits_logprobs(x, labels, options=CallOptions(softcap=bad))
        for invariant in (False, True):
            with pytest.raises(ValueError, match="softcap"):
                triton_backend.linear_logprobs(hidden, weight, None, labels, options=CallOptions(softcap=bad, batch_invariant=invariant))


@pytest.mark.parametrize("V", [4103, 37])
def test_a_nan_logit_poisons_its_row_only(V):
    """A NaN logit (not the label's) makes its row's log-prob, entropy and gradient NaN, whatever column it sits
    in (aligned body or masked edge): the clamps that keep ``-inf`` logits finite must not swallow a NaN."""
    x = torch.randn(3, V, device=DEVICE)
    x[0, V // 2] = float("nan")
    x[2, 1] = float("nan")
    labels = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    xr = x.clone().requires_grad_(True)
    logp, entropy = gk.token_logprobs(xr, labels, return_entropy=True, backend="triton")
    (logp.sum() + entropy.sum()).backward()
    bad = torch.tensor([True, False, True])
    assert torch.isnan(logp.cpu()[bad]).all() and torch.isnan(entropy.cpu()[bad]).all()
    assert torch.isfinite(logp.cpu()[~bad]).all() and torch.isfinite(entropy.cpu()[~bad]).all()
    assert torch.isnan(xr.grad.cpu()[bad]).all(dim=1).all() and torch.isfinite(xr.grad.cpu()[1]).all()


@pytest.mark.parametrize("level", ["sequence", "token"])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_fused_objective_gradient_equals_autograd_bit_for_bit(level, entropy_coef):
    """The hidden-state path's per-chunk gradient without autograd: the same bits as autograd.grad through the
    fused objective (the incoming gradient is 1, and ``1 * scale`` is exact)."""
    from gspo_kernels.layout import LossTensors, prepare_loss_inputs

    B, T = 3, 5
    g = torch.Generator().manual_seed(7)
    labels = torch.zeros(B, T, dtype=torch.long, device=DEVICE)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(DEVICE)
    logp = (-torch.rand(B * T, generator=g) * 3).to(DEVICE)
    old = (logp.reshape(B, T) + 1e-3 * torch.randn(B, T, generator=g).to(DEVICE))
    ent = torch.rand(B * T, generator=g).to(DEVICE)
    adv = torch.randn(B, generator=g).to(DEVICE)
    inputs = prepare_loss_inputs(labels, 8, LossTensors(adv, old_logprobs=old, mask=mask))
    cfg = GSPOConfig(importance_sampling_level=level, entropy_coef=entropy_coef)
    lp, en = logp.clone().requires_grad_(), ent.clone().requires_grad_(entropy_coef != 0)
    loss = sequence.fused_objective(lp, en, inputs, cfg).loss
    wrt = (lp, en) if entropy_coef != 0 else (lp,)
    want = torch.autograd.grad(loss, wrt)
    got_logp, got_entropy = sequence.fused_objective_gradient(logp, ent, inputs, cfg)
    assert torch.equal(got_logp, want[0]) and got_logp.abs().sum() > 0
    if entropy_coef != 0:
        assert torch.equal(got_entropy, want[1]) and got_entropy.abs().sum() > 0
    else:
        assert got_entropy is None


def _two_node_loss(logits_in, labels, adv, old, mask, config, inplace, packed):
    """``gspo_loss`` as it ran before the one-node logits loss: ``logits_logprobs`` then ``fused_objective``."""
    from gspo_kernels.layout import LossTensors, prepare_loss_inputs

    kw = {"cu_seqlens": torch.arange(0, labels.numel() + 1, labels.numel() // 3, device=DEVICE)} if packed else {}
    inputs = prepare_loss_inputs(labels, logits_in.shape[-1], LossTensors(adv, old_logprobs=old, mask=mask, **kw))
    logp, entropy = logits.logits_logprobs(logits_in, inputs.labels, active=inputs.batch.mask > 0, options=CallOptions(temperature=config.temperature, return_entropy=True, inplace_backward=inplace, softcap=config.final_logit_softcapping))
    return sequence.fused_objective(logp, entropy, inputs, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("config", [
    GSPOConfig(),
    GSPOConfig(entropy_coef=0.01, importance_sampling_level="token", temperature=0.7),
    GSPOConfig(entropy_coef=-0.02, final_logit_softcapping=5.0, loss_type="dr_grpo", max_completion_length=8),
], ids=["gspo", "token+entropy+temperature", "softcap+dr_grpo"])
@pytest.mark.parametrize("layout", ["shifted", "shifted_inplace", "packed"])
def test_one_node_logits_loss_equals_logprobs_then_objective_bit_for_bit(dtype, config, layout):
    """``gspo_loss(backend="triton")`` runs the log-probs and the sequence stage as one autograd node whose backward
    kernel forms ``coef * (grad_loss * scale)`` itself: the loss, every metric and the logits gradient are the
    same bits as the two nodes one after the other (scaled incoming gradient, fp64 logits, the entropy term,
    ``[:, :-1]`` routing, in place). Its backward dispatches no elementwise op: only the backward kernel."""
    B, T, V = 3, 5, 37
    base = (torch.randn(B, T + 1, V) * 3).to(dtype)
    labels = torch.randint(0, V, (B, T))
    adv, old = torch.randn(B), torch.randn(B, T) - 3.0
    mask = torch.rand(B, T) > 0.3
    packed, inplace = layout == "packed", layout == "shifted_inplace"
    results = []
    for one_node in (True, False):
        leaf = base.clone().to(DEVICE).requires_grad_(True)
        x = leaf * 1.0  # a model output
        args = [t.to(DEVICE) for t in (labels, adv, old, mask)]
        logits_in = x[:, :-1].reshape(B * T, V) if packed else x[:, :-1]
        if packed:
            args = [args[0].reshape(-1), args[1], args[2].reshape(-1), args[3].reshape(-1)]
        if one_node:
            kw = {"cu_seqlens": torch.arange(0, B * T + 1, T, device=DEVICE)} if packed else {}
            out = gk.gspo_loss(logits_in, args[0], args[1], args[2], mask=args[3], config=config, backend="triton",
                               inplace_backward=inplace, **kw)
            assert type(out.loss.grad_fn.next_functions[0][0]).__name__ == "TritonLogitsLossBackward"
        else:
            out = _two_node_loss(logits_in, *args, config, inplace, packed)
        scale = torch.full_like(out.loss, 1.7)  # an incoming loss gradient other than 1
        with NewTensors(min_numel=1 << 60) as record:
            (grad,) = torch.autograd.grad(out.loss, x, scale)
        if one_node:
            assert "aten.mul.Tensor" not in record.ops, record.ops
        results.append((out, grad))
    (a, ga), (b, gb) = results
    assert a.loss.dtype == b.loss.dtype and torch.equal(a.loss, b.loss)
    assert a.metrics.keys() == b.metrics.keys()
    for name in a.metrics:
        assert torch.equal(a.metrics[name], b.metrics[name]) or (a.metrics[name].isnan() & b.metrics[name].isnan()), name
    assert torch.equal(ga, gb)
