"""The one-pass hidden-state loss (``backend="triton"``, vendor GEMMs) plans its rows on the host once per call:
which rows enter the GEMMs, in what order, how ``dZ`` is stored for the ``dH`` / ``dW`` GEMMs, and what it reads
back (one host read, with the value checks). Every gradient is compared with the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import backends, reference
from gspo_kernels.testing import gradient_tolerance
from tests.support import RTOL, objective_configs, objective_id, record_host_reads, rel_err

pytestmark = pytest.mark.skipif(backends.load("triton") is None or not backends.load("triton").supports(
    torch.device("cuda" if torch.cuda.is_available() else "cpu")), reason="triton backend unavailable here")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _small_chunks(monkeypatch, logits_rows: int, store_rows: int) -> None:
    from gspo_kernels.backends.triton import configs

    monkeypatch.setattr(configs, "GEMM_MIN_CHUNK_ROWS", 1)
    monkeypatch.setattr(configs, "GEMM_ROW_MULTIPLE", 1)
    monkeypatch.setattr(configs, "ONE_PASS_LOGITS_ROWS", logits_rows)
    monkeypatch.setattr(configs, "ONE_PASS_STORE_ROWS", store_rows)
    monkeypatch.setattr(configs, "ONE_PASS_MAX_LOGITS_ROWS", logits_rows)  # chunks stay this small


def _case(seed, *, dtype=torch.float32, B=6, T=5, H=16, V=37, packed=False):
    g = torch.Generator().manual_seed(seed)
    shape = (B * T,) if packed else (B, T)
    hidden = torch.randn(*shape, H, generator=g).to(DEVICE, dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(DEVICE, dtype).requires_grad_()
    labels = torch.randint(0, V, shape, generator=g).to(DEVICE)
    adv = torch.randn(B, generator=g)
    adv[[1, 4]] = 0.0  # two responses without a policy-gradient term
    with torch.no_grad():  # off-policy: responses 0 and 3 move out of the band on their advantage's side (clipped)
        logp = gk.linear_logprobs(hidden.float(), weight.float(), labels, backend="torch").cpu()
    shift = torch.zeros(B)
    shift[[0, 3]] = 0.5 * adv[[0, 3]].sign()
    old = (logp - (shift[:, None].expand(B, T).reshape(shape)) + torch.randn(shape, generator=g) * 0.01).to(DEVICE)
    mask = torch.ones(shape)
    mask.view(-1)[[2, 3, 11, 27]] = 0  # masked rows inside responses
    cu = torch.tensor([0, 3, 9, 10, 18, 25, 30]) if packed else None
    return hidden, weight, labels, adv.to(DEVICE), old, mask.to(DEVICE), None if cu is None else cu.to(DEVICE)


def _against_reference(out, leaves, labels, adv, old, mask, cu, cfg, tol):
    grads = torch.autograd.grad(out.loss, leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference.fused_linear_gspo_loss(*ref_leaves, labels, adv.double(), old.double(), mask=mask, cu_seqlens=cu,
                                           config=cfg)
    ref_grads = torch.autograd.grad(ref.loss, ref_leaves)
    assert abs(out.loss.item() - ref.loss.item()) < RTOL * max(1.0, abs(ref.loss.item()))
    for got, want in zip(grads, ref_grads):
        assert got.dtype == leaves[0].dtype
        assert rel_err(got, want) < tol
    for name, value in ref.metrics.items():
        assert abs(out.metrics[name].item() - value.item()) < RTOL, name
    return grads


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("rows", [(4, 4), (7, 21), (12, 12), (64, 256)], ids=lambda r: f"C{r[0]}-K{r[1]}")
def test_gathered_rows_and_a_shared_store_match_the_reference(monkeypatch, packed, rows):
    """Masked rows left out of the GEMMs, zero-advantage responses out of the backward ones, clipped tokens as
    zero rows; chunks smaller than, equal to and larger than the store; fp32 (dZ written over the logits) and,
    below, bf16 (a separate dZ store shared by several chunks)."""
    _small_chunks(monkeypatch, *rows)
    hidden, weight, labels, adv, old, mask, cu = _case(sum(rows), packed=packed)
    cfg = gk.GSPOConfig(importance_sampling_level="sequence", epsilon_low=0.05, epsilon_high=0.05)
    out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, cu_seqlens=cu, config=cfg,
                                    backend="triton")
    dh, _ = _against_reference(out, (hidden, weight), labels, adv, old, mask, cu, cfg, RTOL)
    flat = dh.reshape(-1, dh.shape[-1])
    assert torch.all(flat[mask.reshape(-1) == 0] == 0)  # masked rows: no gradient, not garbage
    assert out.metrics["clip_ratio/region_mean"].item() > 0  # the case does clip some responses


@pytest.mark.parametrize("rows", [(4, 12), (7, 21)], ids=lambda r: f"C{r[0]}-K{r[1]}")
def test_bf16_store_shared_by_chunks_within_two_roundings(monkeypatch, rows):
    """bf16 operands: ``dZ`` rounded once into the store, the GEMMs over several chunks' rows at once, ``dW``
    summed in fp32 and rounded once: the path's two roundings, as the unchunked path."""
    _small_chunks(monkeypatch, *rows)
    hidden, weight, labels, adv, old, mask, cu = _case(3, dtype=torch.bfloat16)
    cfg = gk.GSPOConfig(importance_sampling_level="sequence", epsilon_low=0.05, epsilon_high=0.05)
    out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, config=cfg, backend="triton")
    _against_reference(out, (hidden, weight), labels, adv, old, mask, cu, cfg, gradient_tolerance("bf16", "linear"))


@pytest.mark.parametrize("config", objective_configs(), ids=objective_id)
def test_every_objective_skips_zero_advantage_responses_correctly(monkeypatch, config):
    """The plan assumes a response whose advantages are all zero has no gradient unless the loss has a KL or an
    entropy term: true of every objective, checked here against the float64 reference with such responses in
    the batch (a wrong assumption would drop a gradient and fail)."""
    _small_chunks(monkeypatch, 10, 20)
    hidden, weight, labels, adv, old, mask, cu = _case(11)
    kw = {}
    if config.rollout_correction is not None:
        kw["rollout_logprobs"] = old - 0.4
    if config.beta > 0:
        kw["ref_logprobs"] = old + 0.02
    out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, config=config, backend="triton", **kw)
    grads = torch.autograd.grad(out.loss, (hidden, weight))
    ref_leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    ref = reference.fused_linear_gspo_loss(*ref_leaves, labels, adv.double(), old.double(), mask=mask, config=config,
                                           **{k: v.double() for k, v in kw.items()})
    for got, want in zip(grads, torch.autograd.grad(ref.loss, ref_leaves)):
        assert rel_err(got, want) < RTOL


def test_one_host_read_per_call(monkeypatch):
    """Eager mode: forward and backward of the one-pass loss read the device once (the value checks' sync, which
    also brings the plan's per-response counts); nothing in the backward waits on the device."""
    hidden, weight, labels, adv, old, mask, cu = _case(5, packed=True)
    cfg = gk.GSPOConfig(importance_sampling_level="sequence")
    reads = record_host_reads(monkeypatch)
    out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, cu_seqlens=cu, config=cfg,
                                    backend="triton")
    forward_reads = list(reads)
    out.loss.backward()
    monkeypatch.undo()
    assert forward_reads == ["tolist"], forward_reads
    assert reads == ["tolist"], reads  # the backward added none
    assert hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize("backend", ["triton", "cpu", "torch"])
def test_a_second_backward_with_retain_graph_gives_the_same_gradients(backend):
    """``backward(retain_graph=True)`` then ``backward()`` through the same loss: the second adds the same
    gradients again on every backend (the Triton one-pass loss hands its gradients over, scaled in place, in
    the first, and runs its pass again for the second); the first ones are right (a loss scale of 3)."""
    device = "cpu" if backend == "cpu" else DEVICE
    hidden, weight, labels, adv, old, mask, cu = (None if t is None else t.to(device) for t in _case(7))
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    cfg = gk.GSPOConfig(importance_sampling_level="sequence")
    out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, config=cfg, backend=backend)
    (3.0 * out.loss).backward(retain_graph=True)
    first = hidden.grad.clone(), weight.grad.clone()
    ref_leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    ref = reference.fused_linear_gspo_loss(*ref_leaves, labels, adv.double(), old.double(), mask=mask, config=cfg)
    ref_grads = torch.autograd.grad(3.0 * ref.loss, ref_leaves)
    assert rel_err(first[0], ref_grads[0]) < RTOL and rel_err(first[1], ref_grads[1]) < RTOL
    out.loss.backward()  # scale 1 this time
    assert rel_err(hidden.grad - first[0], ref_grads[0] / 3) < RTOL
    assert rel_err(weight.grad - first[1], ref_grads[1] / 3) < RTOL


def test_gradients_return_in_the_callers_dtype_without_a_round_trip():
    """fp32 leaves run on bf16 operands when the precision policy says so (``fp32_head=False`` on CUDA); the
    gradients come back to the caller's fp32 tensors directly from the fp32 accumulators. Here (fp32 in, fp32
    operands) they are the caller's dtype and within the fp32 tolerance."""
    hidden, weight, labels, adv, old, mask, cu = _case(9)
    cfg = gk.GSPOConfig(importance_sampling_level="token")
    out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, config=cfg, backend="triton")
    grads = _against_reference(out, (hidden, weight), labels, adv, old, mask, cu, cfg, RTOL)
    assert all(g.dtype == torch.float32 for g in grads)


def test_chunk_rule_without_and_with_a_memory_budget():
    """``configs.one_pass_chunk_rows``: an explicit ``memory_budget`` is the bytes of both buffers exactly (fp32
    logits for ``C`` rows and operand-dtype ``dZ`` for ``K = 4 C``, the default sizes' split; ``K = C`` for fp32
    operands); without one, 1024 / 4096 rows (two-pass backward: 512 / 2048) scaled down together below
    ``max(1 GiB, free / 4)``, never more rows than the call has."""
    from gspo_kernels.backends.triton import configs

    V, bf16 = 151936, torch.bfloat16
    step = configs.GEMM_ROW_MULTIPLE
    for budget in (1 << 28, 1 << 30, 3 << 30):
        c, k = configs.one_pass_chunk_rows(16384, V, bf16, budget)
        assert k == 4 * c and c * V * 4 + k * V * 2 <= budget < (c + step) * V * 4 + (k + 4 * step) * V * 2
        c, k = configs.one_pass_chunk_rows(16384, V, torch.float32, budget)
        assert c == k and c * V * 4 <= budget < (c + step) * V * 4
    assert configs.one_pass_chunk_rows(16384, V, bf16, 0) == (configs.GEMM_MIN_CHUNK_ROWS,
                                                             4 * configs.GEMM_MIN_CHUNK_ROWS)  # the floor
    big = 64 << 30
    assert configs.one_pass_chunk_rows(16384, V, bf16, None, big) == (1024, 4096)
    assert configs.one_pass_chunk_rows(16384, V, bf16, None, big, two_pass=True) == (512, 2048)
    assert configs.one_pass_chunk_rows(16384, V, torch.float32, None, big) == (4096, 4096)
    for free in (None, 2 << 30):  # the cap: 1 GiB (free unknown, or a quarter of 2 GiB is less)
        c, k = configs.one_pass_chunk_rows(16384, V, bf16, None, free)
        assert k == 4 * c and c * V * 4 + k * V * 2 <= 1 << 30 and c < 1024
    c, k = configs.one_pass_chunk_rows(16384, V, bf16, None, 12 << 30)  # 3 GiB cap: the full sizes fit
    assert (c, k) == (1024, 4096)
    assert configs.one_pass_chunk_rows(300, V, bf16, None, big) == (300, 300)


def test_chunks_grow_to_hold_the_longest_response_when_the_bytes_allow():
    """A response longer than ``C`` would go through the GEMMs twice: ``C`` grows to the longest response (rounded up
    to the row multiple) whenever the same bytes hold it and at least as many store rows, the store giving up rows
    first; an explicit budget still bounds both buffers; beyond the bytes (or ``ONE_PASS_MAX_LOGITS_ROWS``) the
    sizes stay, and the two-pass backward's sizes never change."""
    from gspo_kernels.backends.triton import configs

    V, bf16, big = 151936, torch.bfloat16, 64 << 30
    assert configs.one_pass_chunk_rows(16384, V, bf16, None, big, longest=1024) == (1024, 4096)  # fits already
    assert configs.one_pass_chunk_rows(16384, V, bf16, None, big, longest=3000) == (3008, 4096)
    assert configs.one_pass_chunk_rows(16384, V, bf16, None, big, longest=6000) == (6000, 6000)
    c, k = configs.one_pass_chunk_rows(16384, V, bf16, 1 << 30, longest=1024)  # the TRL drop-in's 1 GiB
    assert c == 1024 and c <= k and c * V * 4 + k * V * 2 <= 1 << 30 < c * V * 4 + (k + 16) * V * 2
    assert configs.one_pass_chunk_rows(16384, V, bf16, 1 << 30, longest=2048) == \
        configs.one_pass_chunk_rows(16384, V, bf16, 1 << 30)  # 2048 rows of logits and store: more than 1 GiB
    # fp32 operands (dZ over the logits): a budget's rows are already all its bytes allow; the default sizes grow
    assert configs.one_pass_chunk_rows(16384, V, torch.float32, 1 << 30, longest=2000) == \
        configs.one_pass_chunk_rows(16384, V, torch.float32, 1 << 30)
    assert configs.one_pass_chunk_rows(16384, V, torch.float32, None, big, longest=6000) == (6000, 6000)
    assert configs.one_pass_chunk_rows(16384, V, bf16, None, big, two_pass=True, longest=3000) == (512, 2048)
    too_long = configs.ONE_PASS_MAX_LOGITS_ROWS + 1
    assert configs.one_pass_chunk_rows(1 << 16, V, bf16, None, big, longest=too_long) == (1024, 4096)
    assert configs.one_pass_chunk_rows(700, V, bf16, None, big, longest=700) == (700, 700)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_handed_over_gradients_are_scaled_once_in_place(dtype):
    """``linear.scale_gradient_``, the one-pass loss's backward: ``g *= scale`` in place with ``scale`` a 0-dim
    device tensor (no host read), the product formed in fp32 (fp64 for fp64) from the unrounded scale and
    rounded once: within half an ulp of ``g``'s dtype of the exact product, plus the fp32 product's own rounding
    (2^-24 relative) for half ``g``. A scale of exactly 1 leaves every bit as it was (NaN, infinities, -0,
    subnormals included)."""
    from gspo_kernels.backends.triton.linear_loss import scale_gradient_

    gen = torch.Generator().manual_seed(3)
    n = 3 * 4096 + 37  # more blocks than the interpreter's 4 programs, and a ragged last block
    base = torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-6, 6, (n,), generator=gen)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0,
                            torch.finfo(dtype).tiny / 4 if dtype != torch.bfloat16 else 1e-39])
    base[: special.numel()] = special
    g0 = base.to(dtype).to(DEVICE)
    eps = torch.finfo(dtype).eps  # 2 ulp(1): half an ulp relative is eps / 2
    for scale in (1.0, 0.3711, -2.5e-3, 1.0 / 3.0):
        for scale_dtype in (torch.float32, torch.float64):
            s = torch.tensor(scale, dtype=scale_dtype, device=DEVICE)
            g = g0.clone()
            out = scale_gradient_(g, s)
            assert out is g  # in place
            strided = torch.stack([g0, g0], 1).clone()[:, 0]  # not contiguous: the torch route
            assert not strided.is_contiguous()
            scale_gradient_(strided, s)
            if scale == 1.0:
                bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
                assert torch.equal(g.view(bits).cpu(), g0.view(bits).cpu())
                continue
            s_used = s.double() if dtype == torch.float64 else s.float().double()  # fp32 loses nothing of an fp32 scale
            exact = g0.double().cpu() * s_used.cpu()
            normal = torch.isfinite(exact) & (exact.abs() > torch.finfo(dtype).tiny)  # subnormals may flush
            bound = eps / 2 + (2.0 ** -24 if dtype != torch.float64 else 0.0)
            for result in (g, strided):  # the kernel, and the torch route: the same bound
                got = result.double().cpu()
                rel = ((got - exact).abs() / exact.abs())[normal]
                assert rel.max().item() <= bound * (1 + 1e-9), (scale, scale_dtype, rel.max().item())
                assert torch.equal(torch.isnan(got), torch.isnan(exact))
                assert torch.equal(got[~normal & torch.isfinite(exact)].abs() <= torch.finfo(dtype).tiny,
                                   torch.ones_like(got[~normal & torch.isfinite(exact)], dtype=torch.bool))
