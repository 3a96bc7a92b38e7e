"""``backend="triton"`` on the logits path, against the float64 oracle (``gspo_kernels.reference``).

Without a GPU the kernels run in the Triton interpreter on CPU tensors (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before triton is imported); on a CUDA machine the same tests run on the GPU.
Tolerances: fp32 within 1e-5 relative (plus a tiny absolute floor for values near 0); a bf16 gradient
within its rounding to bf16. The loss against the oracle for every level x loss type, half precision
and the edge cases shared by every backend live in ``tests/test_conformance.py``; this file keeps what is
specific to the Triton kernels, and ``test_triton_logits_edges.py`` their edge inputs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

import gspo_kernels as gk  # noqa: E402
from gspo_kernels import backends, reference  # noqa: E402
from gspo_kernels.backends.triton import sequence  # noqa: E402
from gspo_kernels.backends.triton.logits import (  # noqa: E402
    logprobs_backward,
    logprobs_forward,
    logsumexp_from_row_stats,
)
from gspo_kernels.config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, GSPOConfig  # noqa: E402
from gspo_kernels.layout import LossInputs, TokenBatch  # noqa: E402
from tests.support import capture_cuda_graph, replays_against_eager, triton_test_device  # noqa: E402

DEVICE = triton_test_device()


def _close(actual, expected, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), rtol=rtol, atol=atol)


def _logits(kind: str, n_rows: int, V: int, dtype=torch.float32, scale=3.0):
    """Logits ``[n_rows, V]`` (or ``[B, T, V]``) with the stride pattern ``kind``, and their float64 copy."""
    if kind == "packed":
        x = (torch.randn(n_rows, V) * scale).to(dtype)
    elif kind == "padded_view":  # logits[:, :-1] of a model output: B and T cannot be merged
        x = (torch.randn(n_rows // 3, 4, V) * scale).to(dtype)[:, :-1]
    elif kind == "transposed":  # stride over the vocabulary != 1
        x = (torch.randn(V, n_rows) * scale).to(dtype).t()
    else:
        raise ValueError(kind)
    if kind != "packed":
        assert not x.is_contiguous()
    return (x.to(DEVICE) if DEVICE != "cpu" else x), x.double()


def _ref_logprobs(x64, labels, temperature):
    logp_all = torch.log_softmax(x64.reshape(-1, x64.shape[-1]) / temperature, dim=-1)
    logp = logp_all.gather(1, labels.cpu()[:, None])[:, 0]
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("kind,V", [("packed", 1), ("packed", 4097), ("padded_view", 37), ("transposed", 1000)])
def test_forward_matches_float64(kind, V):
    x, x64 = _logits(kind, 9, V)
    labels = torch.randint(0, V, (9,), device=DEVICE)
    active = torch.ones(9, dtype=torch.bool, device=DEVICE)
    active[[1, 5]] = False
    poison = [torch.full((9,), float("nan"), device=DEVICE) for _ in range(3)]
    poison[2] = torch.full((2, 9), float("nan"), device=DEVICE)
    logp, entropy, row_stats = logprobs_forward(x, labels, active=active, temperature=0.7, return_entropy=True,
                                                out=tuple(poison))
    ref_logp, ref_entropy = _ref_logprobs(x64, labels, 0.7)
    on = active.cpu()
    _close(logp.cpu()[on], ref_logp[on])
    _close(entropy.cpu()[on], ref_entropy[on])
    _close(logsumexp_from_row_stats(row_stats, 0.7).cpu()[on], torch.logsumexp(x64.reshape(-1, V) / 0.7, -1)[on])
    _close(row_stats[0].cpu()[on], x64.reshape(-1, V).max(-1).values[on])
    assert torch.equal(logp.cpu()[~on], torch.zeros(2)) and torch.equal(entropy.cpu()[~on], torch.zeros(2))


def test_inactive_rows_are_not_read():
    x = torch.randn(6, 300, device=DEVICE)
    x[2] = float("nan")  # an inactive row full of NaN must not leak into any output
    labels = torch.randint(0, 300, (6,), device=DEVICE)
    active = torch.tensor([True, True, False, True, True, True], device=DEVICE)
    logp, entropy, _ = logprobs_forward(x, labels, active=active, return_entropy=True)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert float(logp[2]) == 0.0


@pytest.mark.parametrize("kind,V", [("padded_view", 4099), ("transposed", 33)])
def test_backward_matches_float64(kind, V):
    x, x64 = _logits(kind, 9, V)
    labels = torch.randint(0, V, (9,), device=DEVICE)
    g = torch.randn(9, device=DEVICE)
    h = torch.randn(9, device=DEVICE)
    g[[0, 4]] = 0.0
    h[[0, 4, 7]] = 0.0  # rows 0 and 4 carry no gradient at all; row 7 only through logp
    logp, entropy, row_stats = logprobs_forward(x, labels, temperature=1.3, return_entropy=True)
    poisoned = torch.full(x.shape, float("nan"), device=DEVICE)
    grad = logprobs_backward(x, labels, row_stats, entropy, g, h, temperature=1.3, out=poisoned)
    assert grad is poisoned and torch.isfinite(grad).all()  # every element written, skipped rows included

    x64 = x64.clone().requires_grad_(True)
    ref_logp, ref_entropy = _ref_logprobs(x64, labels, 1.3)
    (ref_logp * g.cpu().double() + ref_entropy * h.cpu().double()).sum().backward()
    expected = x64.grad.reshape(-1, V)
    got = grad.reshape(-1, V).cpu()
    _close(got, expected, atol=1e-5 * float(expected.abs().max()))
    assert torch.equal(got[[0, 4]], torch.zeros(2, V))

    inplace = x.clone()
    out = logprobs_backward(inplace, labels, row_stats, entropy, g, h, temperature=1.3, inplace=True)
    assert out is inplace and torch.equal(out.cpu(), grad.cpu())


def test_qwen_vocabulary_few_rows():
    V = 151936
    x = (torch.randn(3, V) * 4).to(torch.bfloat16).to(DEVICE)
    labels = torch.tensor([0, V - 1, 77777], device=DEVICE)
    x_req = x.clone().requires_grad_(True)
    logp, entropy = gk.token_logprobs(x_req, labels, temperature=0.9, return_entropy=True, backend="triton")
    (logp.sum() + 0.5 * entropy.sum()).backward()
    x64 = x.cpu().double().requires_grad_(True)
    ref_logp, ref_entropy = _ref_logprobs(x64, labels, 0.9)
    (ref_logp.sum() + 0.5 * ref_entropy.sum()).backward()
    _close(logp.cpu(), ref_logp)
    _close(entropy.cpu(), ref_entropy)
    ref_grad = x64.grad
    # bf16 gradient: within one rounding to nearest of the float64 gradient (half an ulp, relative), on a GPU and
    # in the interpreter alike (its truncating cast is replaced: testing.round_interpreter_bf16_casts).
    tol = torch.finfo(torch.bfloat16).eps / 2
    assert bool(((x_req.grad.cpu().double() - ref_grad).abs() <= tol * ref_grad.abs() + 1e-12).all())


def test_float64_logits_are_computed_in_float64():
    """Like the torch backend: fp64 logits give fp64 log-probs and gradients (temperature 0.5 is exact in fp32)."""
    x = (torch.randn(2, 5, 70, dtype=torch.float64) * 3).to(DEVICE).requires_grad_(True)
    labels = torch.randint(0, 70, (2, 5), device=DEVICE)
    logp, entropy = gk.token_logprobs(x, labels, temperature=0.5, return_entropy=True, backend="triton")
    (logp.sum() + entropy.sum()).backward()
    x_ref = x.detach().cpu().clone().requires_grad_(True)
    ref_logp, ref_entropy = reference.token_logprobs(x_ref, labels.cpu(), temperature=0.5, return_entropy=True)
    (ref_logp.sum() + ref_entropy.sum()).backward()
    assert logp.dtype == entropy.dtype == x.grad.dtype == torch.float64
    _close(logp.detach(), ref_logp.detach(), rtol=1e-12, atol=1e-12)
    _close(entropy.detach(), ref_entropy.detach(), rtol=1e-12, atol=1e-12)
    _close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)


def _loss_case(layout: str, adv_per_token: bool, V: int = 29):
    """Five responses: a normal one, an empty one, a length-1 one (clipped low), one clipped high and a
    zero-advantage one. Returns logits (strided), labels, advantages, old log-probs and keyword arguments."""
    offsets = torch.tensor([1e-4, 0.0, -2e-3, 2e-3, -1e-4])  # ~ log w of each response
    adv = torch.tensor([1.0, -0.5, -1.0, 0.8, 0.0])
    if layout == "padded":
        B, T = 5, 6
        base = torch.randn(B, T + 1, V) * 2
        logits = base[:, :-1]
        labels = torch.randint(0, V, (B, T))
        mask = torch.ones(B, T)
        mask[1] = 0
        mask[2, 1:] = 0
        mask[0, 4:] = 0
        seq_of_token = torch.arange(B).repeat_interleave(T).reshape(B, T)
        cu = None
    else:
        lengths = torch.tensor([4, 0, 1, 6, 3])
        N = int(lengths.sum())
        base = torch.randn(V, N) * 2
        logits = base.t()  # [N, V] with stride (1, N)
        labels = torch.randint(0, V, (N,))
        mask = torch.ones(N)
        mask[2] = 0  # a masked token inside response 0
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
        seq_of_token = torch.repeat_interleave(torch.arange(5), lengths)
    now = reference.token_logprobs(logits, labels).float()
    old = now - offsets[seq_of_token] + 3e-5 * torch.randn(now.shape)
    advantages = adv[seq_of_token] + 0.1 * torch.randn(now.shape) * (adv[seq_of_token] != 0) if adv_per_token else adv
    kwargs = dict(mask=mask, cu_seqlens=cu)
    return base, logits, labels, advantages, old, kwargs


def _run_both(base, labels, advantages, old, kwargs, config, take):
    """Loss, metrics and d loss / d base from backend="triton" and from the float64 reference."""
    dev = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    x = base.clone().to(DEVICE).requires_grad_(True)
    out = gk.gspo_loss(take(x), labels.to(DEVICE), advantages.to(DEVICE), old.to(DEVICE), config=config,
                       backend="triton", **dev)
    out.loss.backward()
    x64 = base.double().requires_grad_(True)
    ref = reference.gspo_loss(take(x64), labels, advantages, old, config=config, **kwargs)
    ref.loss.backward()
    return out, x.grad.cpu(), ref, x64.grad


def _check(out, grad, ref, ref_grad):
    _close(out.loss, ref.loss)
    assert set(out.metrics) == set(ref.metrics)
    for name in ref.metrics:
        _close(out.metrics[name], ref.metrics[name], rtol=1e-5, atol=1e-6)
    _close(grad, ref_grad, atol=1e-5 * max(float(ref_grad.abs().max()), 1e-12))


@pytest.mark.parametrize("level,loss_type", list(itertools.product(IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES)))
def test_gspo_loss_all_options_packed(level, loss_type):
    """Packed layout with transposed logits; per-token advantages; KL with bias correction, delta, per-response
    is_ratio, entropy bonus, temperature and num_items_in_batch."""
    base, logits, labels, adv, old, kwargs = _loss_case("packed", adv_per_token=level != "sequence")
    N = labels.shape[0]
    kwargs.update(
        ref_logprobs=reference.token_logprobs(logits, labels).float() + 0.05 * torch.randn(N),
        is_ratio=torch.rand(5) + 0.5,
        num_items_in_batch=17,
    )
    config = GSPOConfig(importance_sampling_level=level, loss_type=loss_type, max_completion_length=8, beta=0.04,
                        use_bias_correction_kl=True, delta=1.0015, entropy_coef=0.01, temperature=0.8)
    out, grad, ref, ref_grad = _run_both(base, labels, adv, old, kwargs, config, lambda x: x.t())
    _check(out, grad, ref, ref_grad)


def test_sequence_level_per_token_advantages_and_no_old_logprobs():
    """On-policy (no old log-probs: every weight is 1) and per-token advantages at the sequence level."""
    base, logits, labels, adv, old, kwargs = _loss_case("padded", adv_per_token=True)
    for level in IMPORTANCE_SAMPLING_LEVELS:
        config = GSPOConfig(importance_sampling_level=level, entropy_coef=-0.02)
        x = base.clone().to(DEVICE).requires_grad_(True)
        out = gk.gspo_loss(x[:, :-1], labels.to(DEVICE), adv.to(DEVICE), None, config=config, backend="triton",
                           mask=kwargs["mask"].to(DEVICE))
        out.loss.backward()
        x64 = base.double().requires_grad_(True)
        ref = reference.gspo_loss(x64[:, :-1], labels, adv, None, config=config, mask=kwargs["mask"])
        ref.loss.backward()
        _check(out, x.grad.cpu(), ref, x64.grad)
        assert float(out.metrics["importance_weight/min"]) == 1.0 == float(out.metrics["importance_weight/max"])


def test_all_tokens_masked_gives_zeros_not_nan():
    V = 11
    x = torch.randn(3, 4, V, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, V, (3, 4), device=DEVICE)
    mask = torch.zeros(3, 4, device=DEVICE)
    out = gk.gspo_loss(x, labels, torch.randn(3, device=DEVICE), mask=mask, backend="triton",
                       config=GSPOConfig(loss_type="bnpo", entropy_coef=0.1))
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0
    assert all(float(v) == 0.0 for v in out.metrics.values())
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_inplace_backward_matches_and_consumes_logits():
    base, logits, labels, adv, old, kwargs = _loss_case("padded", adv_per_token=False)
    config = GSPOConfig(entropy_coef=0.01)
    grads = []
    for inplace in (False, True):
        leaf = base.clone().to(DEVICE).requires_grad_(True)
        logits = leaf * 1.0  # a non-leaf, like a model's output; the loss reads logits[:, :-1]
        out = gk.gspo_loss(logits[:, :-1], labels.to(DEVICE), adv.to(DEVICE), old.to(DEVICE), config=config,
                           backend="triton", inplace_backward=inplace, mask=kwargs["mask"].to(DEVICE))
        out.loss.backward()
        grads.append(leaf.grad)
        if inplace:  # the gradient was written into the logits' own storage
            assert torch.equal(logits.detach()[:, :-1], leaf.grad[:, :-1])
    assert torch.equal(grads[0], grads[1])
    assert grads[0][:, :-1].abs().sum() > 0


def test_autograd_saves_only_token_sized_tensors():
    """Besides a reference to the logits, everything saved for backward is ``O(N)`` (or ``O(S)``)."""
    base, logits, labels, adv, old, kwargs = _loss_case("padded", adv_per_token=False, V=301)
    x = base.clone().to(DEVICE).requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gk.gspo_loss(x[:, :-1], labels.to(DEVICE), adv.to(DEVICE), old.to(DEVICE), config=GSPOConfig(
            entropy_coef=0.01), backend="triton", mask=kwargs["mask"].to(DEVICE))
    N = labels.numel()
    big = [t for t in saved if t.numel() > 2 * N]  # the row statistics are [2, N]
    assert saved and all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in big)
    out.loss.backward()


def test_sequence_stage_partials_and_poisoned_coefficients():
    """The fused stage alone: the coefficient buffer is fully written (empty tensors are fine too)."""
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0], device=DEVICE)
    cu = torch.tensor([0, 3, 3, 4], dtype=torch.int32, device=DEVICE)
    logp = torch.tensor([-1.0, -2.0, float("nan"), -0.5], device=DEVICE)  # the masked token is garbage
    batch = TokenBatch(mask=mask, seq_index=torch.tensor([0, 0, 0, 2], device=DEVICE), cu_seqlens=cu, num_seqs=3,
                       token_shape=(4,))
    inputs = LossInputs(labels=torch.zeros(4, dtype=torch.long, device=DEVICE), batch=batch,
                        advantages=torch.tensor([1.0, 2.0, -0.5], device=DEVICE), advantages_per_token=False,
                        old_logprobs=logp.detach() + 1e-4, ref_logprobs=None, is_ratio=None, num_items_in_batch=None)
    coef, out = sequence.sequence_stage(logp, None, inputs, GSPOConfig())
    assert torch.isfinite(coef).all() and torch.isfinite(out).all()
    assert float(coef[2]) == 0.0
    w = torch.exp(torch.tensor(-1e-4, dtype=torch.float64))  # inside the clip band for both responses
    # grpo over S = 3: response 0 (2 tokens, A = 1), response 1 empty, response 2 (1 token, A = -0.5):
    # L = (-w + 0.5 w) / 3; dL/dlogp_t = (1/3) * dl_i/dw * w / |y_i|.
    _close(out[sequence.O_LOSS.value], -0.5 * w / 3)
    _close(coef.cpu() * out[sequence.O_SCALE_LOGP.value].cpu(), torch.tensor([-1 / 6, -1 / 6, 0.0, 1 / 6]).double() * w)
    _close(out[sequence.O_W_MEAN.value], w)  # counted over the two non-empty responses


def test_backend_registration():
    assert "triton" in backends.available(DEVICE)
    if DEVICE == "cpu":
        assert backends.resolve("auto", torch.device("cpu")).name != "triton"  # the interpreter is for tests
    x = torch.randn(0, 5, device=DEVICE)
    assert gk.token_logprobs(x, torch.zeros(0, dtype=torch.long, device=DEVICE), backend="triton").shape == (0,)


@pytest.mark.gpu
def test_gpu_deterministic_and_long_sequences():
    """Same bits on every run (no float atomics) at sizes where a GPU would expose races; L >= 65536."""
    N, V = 70000, 64
    logits = torch.randn(N, V, device="cuda", requires_grad=True)
    labels = torch.randint(0, V, (N,), device="cuda")
    cu = torch.tensor([0, 66000, 66001, N], dtype=torch.int32, device="cuda")
    adv = torch.tensor([0.5, -1.0, 2.0], device="cuda")
    old = torch.randn(N, device="cuda") * 1e-4 - 4.0
    runs = []
    for _ in range(2):
        logits.grad = None
        out = gk.gspo_loss(logits, labels, adv, old, cu_seqlens=cu, backend="triton",
                           config=GSPOConfig(importance_sampling_level="token", loss_type="bnpo", entropy_coef=0.01))
        out.loss.backward()
        runs.append((out.loss.clone(), {k: v.clone() for k, v in out.metrics.items()}, logits.grad.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][2], runs[1][2])
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True])
def test_gpu_peak_memory(inplace):
    """Extra memory of forward + backward beyond the logits: one gradient buffer, or none with inplace."""
    N, V = 4096, 32768
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, V, (N,), device="cuda")
    cu = torch.arange(0, N + 1, 512, dtype=torch.int32, device="cuda")
    adv = torch.randn(cu.numel() - 1, device="cuda")
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = gk.gspo_loss(logits, labels, adv, cu_seqlens=cu, backend="triton", inplace_backward=inplace,
                       config=GSPOConfig(importance_sampling_level="token", entropy_coef=0.01))
    (grad,) = torch.autograd.grad(out.loss, [logits])
    extra = torch.cuda.max_memory_allocated() - start
    logits_bytes = N * V * 2
    token_bytes = 64 * N * 4  # a generous bound on the [N]-sized buffers
    if inplace:
        assert grad.data_ptr() == logits.data_ptr()
        assert extra <= token_bytes, extra
    else:
        assert extra <= logits_bytes + token_bytes, extra


@pytest.mark.gpu
def test_a_logits_loss_step_captures_in_a_cuda_graph():
    """GPU only: ``gspo_loss`` from a model's ``[B, T + 1, V][:, :-1]`` bf16 logits, forward + backward, captured
    in a ``torch.cuda.CUDAGraph`` (``tests.support.capture_cuda_graph``: side-stream warm-up, no eager graph
    alive, ``set_sync_debug_mode("error")`` during the capture: no host read), a vocabulary that is not a
    multiple of the block, a mask. Replayed with other advantages written into the captured tensor (half the
    responses at zero advantage, then the other half): each replay equals the eager step on the same inputs,
    zero-advantage responses get exactly zero gradient, and the last position (outside the view) stays 0."""
    B, T, V = 8, 33, 4099
    leaf = (torch.randn(B, T + 1, V, device="cuda") * 3).bfloat16().requires_grad_(True)
    labels = torch.randint(0, V, (B, T), device="cuda")
    mask = torch.ones(B, T, device="cuda")
    mask[1, 20:] = 0
    with torch.no_grad():
        old = gk.token_logprobs(leaf[:, :-1], labels, backend="triton") - 1e-4 * torch.rand(B, 1, device="cuda")
    even = torch.arange(B, device="cuda") % 2 == 0
    adv = torch.randn(B, device="cuda")
    patterns = [(torch.where(even, 0.0, adv), even), (torch.where(even, adv, 0.0), ~even)]
    static_adv = patterns[1][0].clone()
    config = GSPOConfig(importance_sampling_level="sequence")

    def step():
        out = gk.gspo_loss(leaf[:, :-1], labels, static_adv, old, mask=mask, config=config, backend="triton")
        return (out.loss, *torch.autograd.grad(out.loss, (leaf,)))

    graph, static = capture_cuda_graph(step)
    for grad, zero in replays_against_eager(graph, static, step, static_adv, patterns, tol=1e-6):
        assert torch.all(grad[zero] == 0) and torch.all(grad[:, -1] == 0)
        assert bool((grad[~zero].abs().amax(dim=(1, 2)) > 0).all())
