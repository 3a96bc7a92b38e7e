"""The hidden-state path on the vendor GEMMs (``backend="triton"``'s default): the work it does, its one-pass
loss, its chunking, its optional batch invariance and the host reads it makes.

FLOPs are counted at the ATen level (``mm``, ``addmm`` and their in-place and ``out=`` forms): in the Triton
interpreter the GEMMs are the same ``torch.mm`` / ``addmm`` calls that reach cuBLAS on a GPU. The expected
counts come from the algorithm (``2 N H V`` per product), not from the code's output.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import gspo_kernels as gk
from gspo_kernels import backends, checks, reference
from tests.support import RTOL, TRITON_DEVICE, capture_cuda_graph, record_host_reads, rel_err, replays_against_eager

pytestmark = pytest.mark.skipif(backends.load("triton") is None or not backends.load("triton").supports(
    torch.device(TRITON_DEVICE)), reason="triton backend unavailable here")

DEVICE = TRITON_DEVICE
_GEMMS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_"}


class GemmFlops(TorchDispatchMode):
    """``2 m n k`` for every matrix product that reaches ATen, whatever its form (``addmm_``, ``out=``)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _GEMMS:
            a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
            batch = a.shape[0] if a.dim() == 3 else 1
            self.flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return func(*args, **kwargs)


def _problem(B=8, T=6, H=32, V=96, *, zero_adv_rows=(), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(DEVICE, dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(DEVICE, dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    adv = torch.randn(B, generator=g)
    adv[list(zero_adv_rows)] = 0.0
    old = (torch.randn(B, T, generator=g) * 0.02 - 4.5).to(DEVICE)
    return hidden, weight, labels, adv.to(DEVICE), old


def _count(fn):
    ours, theirs = GemmFlops(), FlopCounterMode(display=False)
    with theirs, ours:
        fn()
    return ours.flops, theirs.get_total_flops()


@pytest.mark.parametrize("half_zero", [False, True], ids=["all-active", "half-zero-advantage"])
def test_one_call_loss_does_6NHV_and_skips_rows_without_gradient(half_zero):
    """``fused_linear_gspo_loss`` forward + backward: one logits GEMM over every row plus ``dH`` and ``dW`` over
    the rows with a gradient: ``6 N H V`` (<= 6.3) with every row active, ``4 N H V`` (<= 4.3) when half of the
    responses have a zero advantage. The two-pass form (``linear_logprobs`` + autograd) does ``8 N H V``."""
    B, T, H, V = 8, 6, 32, 96
    hidden, weight, labels, adv, _ = _problem(B, T, H, V, zero_adv_rows=range(0, B, 2) if half_zero else ())
    cfg = gk.GSPOConfig(importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.2)

    def step():  # on-policy (every weight 1): no token is clipped, every row with an advantage carries a gradient
        out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, config=cfg, backend="triton")
        torch.autograd.grad(out.loss, (hidden, weight))

    ours, counted = _count(step)
    nhv = B * T * H * V
    assert ours == (4 if half_zero else 6) * nhv, ours / nhv  # exactly the GEMMs the algorithm needs
    assert counted <= (4.3 if half_zero else 6.3) * nhv, counted / nhv  # torch.utils.flop_counter's count

    def two_pass():
        logp = gk.linear_logprobs(hidden, weight, labels, backend="triton")
        torch.autograd.grad((logp * 0.1).sum(), (hidden, weight))

    assert _count(two_pass)[0] == 8 * nhv


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("budget_rows", [2, 4, 7, 1000])
@pytest.mark.parametrize("level", ["sequence", "token", "sequence_token"])
def test_chunked_one_pass_loss_matches_reference(monkeypatch, packed, budget_rows, level):
    """Chunks of whole responses (several per chunk, one per chunk, and responses longer than a chunk, which
    take two passes alone and are counted in ``fused_linear/two_pass_tokens``): loss, metrics and the
    gradients of hidden, weight and bias against the float64 reference, with KL, an entropy bonus and masks."""
    from gspo_kernels.backends.triton import configs

    monkeypatch.setattr(configs, "GEMM_MIN_CHUNK_ROWS", 1)
    monkeypatch.setattr(configs, "GEMM_ROW_MULTIPLE", 1)
    g = torch.Generator().manual_seed(budget_rows)
    H, V = 16, 37
    shape = (15,) if packed else (3, 5)
    cu = torch.tensor([0, 2, 9, 15], device=DEVICE) if packed else None
    hidden = torch.randn(*shape, H, generator=g).to(DEVICE).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(DEVICE).requires_grad_()
    bias = (torch.randn(V, generator=g) * 0.5).to(DEVICE).requires_grad_()
    labels = torch.randint(0, V, shape, generator=g).to(DEVICE)
    adv = torch.tensor([1.0, -0.5, 0.7], device=DEVICE)
    old = (torch.randn(shape, generator=g) * 0.01 - 3.5).to(DEVICE)
    mask = torch.ones(shape, device=DEVICE)
    mask.view(-1)[3] = 0
    ref_lp = old + 0.01
    cfg = gk.GSPOConfig(importance_sampling_level=level, epsilon_low=0.2, epsilon_high=0.2, beta=0.1,
                        entropy_coef=0.01)
    out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, bias=bias, mask=mask, cu_seqlens=cu,
                                    ref_logprobs=ref_lp, config=cfg, backend="triton",
                                    memory_budget=budget_rows * V * 4)
    grads = torch.autograd.grad(out.loss, (hidden, weight, bias))
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    ref = reference.fused_linear_gspo_loss(leaves[0], leaves[1], labels, adv.double(), old.double(), bias=leaves[2],
                                           mask=mask, cu_seqlens=cu, ref_logprobs=ref_lp.double(), config=cfg)
    ref_grads = torch.autograd.grad(ref.loss, leaves)
    assert abs(out.loss.item() - ref.loss.item()) < RTOL * max(1.0, abs(ref.loss.item()))
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < RTOL
    for name, value in ref.metrics.items():
        assert abs(out.metrics[name].item() - value.item()) < RTOL, name
    lengths = (2, 7, 6) if packed else (5, 5, 5)
    assert out.metrics["fused_linear/two_pass_tokens"].item() == sum(n for n in lengths if n > budget_rows)


def test_bf16_one_pass_gradients_within_two_roundings():
    """bf16 operands: the products are exact in fp32 and accumulate in fp32; ``dZ`` is rounded once to bf16
    before the backward GEMMs and the gradient once more to bf16 (the path's two roundings)."""
    from gspo_kernels.testing import gradient_tolerance

    hidden, weight, labels, adv, old = _problem(dtype=torch.bfloat16, seed=3)
    cfg = gk.GSPOConfig(importance_sampling_level="sequence", epsilon_low=0.2, epsilon_high=0.2)
    out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, config=cfg, backend="triton")
    grads = torch.autograd.grad(out.loss, (hidden, weight))
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    ref = reference.fused_linear_gspo_loss(*leaves, labels, adv.double(), old.double(), config=cfg)
    ref_grads = torch.autograd.grad(ref.loss, leaves)
    assert abs(out.loss.item() - ref.loss.item()) < RTOL * max(1.0, abs(ref.loss.item()))
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.bfloat16
        assert rel_err(got, want) < gradient_tolerance("bf16", "linear")


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_batch_invariant_option_gives_the_same_bits_whatever_the_batch(backend, request):
    """``batch_invariant=True``: two runs are the same bits, and a row alone equals that row in a batch of 40
    and after a permutation of the batch (log-prob, entropy and its ``dH`` row)."""
    impl = backends.load(backend)
    device = DEVICE if backend == "triton" else "cpu"
    if impl is None or not impl.supports(torch.device(device)):
        pytest.skip(f"backend {backend!r} unavailable: {backends.unavailable_reason(backend)}")
    if backend == "triton":
        request.getfixturevalue("row_independent_dot")
    g = torch.Generator().manual_seed(5)
    N, H, V = 40, 24, 150
    hidden = torch.randn(N, H, generator=g).to(device)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(device)
    labels = torch.randint(0, V, (N,), generator=g).to(device)
    g_logp = torch.randn(N, generator=g).to(device)

    def run(rows):
        h = hidden[rows].clone().requires_grad_()
        logp, ent = gk.linear_logprobs(h, weight, labels[rows], return_entropy=True, backend=backend,
                                       batch_invariant=True)
        (dh,) = torch.autograd.grad((logp * g_logp[rows]).sum() + ent.sum(), (h,))
        return logp.detach(), ent.detach(), dh

    everything = torch.arange(N)
    first, second = run(everything), run(everything)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    perm = torch.randperm(N, generator=g)
    permuted = run(perm)
    for probe in (0, 17, 39):
        alone = run(torch.tensor([probe]))
        where = int((perm == probe).nonzero())
        for k in range(3):
            assert torch.equal(alone[k][0], first[k][probe]), (probe, k)
            assert torch.equal(permuted[k][where], first[k][probe]), (probe, k)


def test_torch_backend_refuses_batch_invariance():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="batch_invariant=True needs backend='triton' or backend='cpu'"):
        gk.linear_logprobs(h, w, torch.zeros(4, dtype=torch.long), backend="torch", batch_invariant=True)


def test_no_host_reads_when_capturing(monkeypatch):
    """While a CUDA graph is captured (simulated here: ``checks.cuda_graph_capturing`` says so), the Triton
    path reads nothing back: no ``.item()``, ``.tolist()``, ``nonzero``, ``bool()`` of a tensor, for
    ``gspo_loss``, ``fused_linear_gspo_loss`` (padded) and ``policy_loss``, forward and backward; the results
    equal those of the eager path (which reads one count per chunk)."""
    hidden, weight, labels, adv, old = _problem(zero_adv_rows=(1, 2))
    mask = torch.ones(labels.shape, device=DEVICE)
    mask[0, 4:] = 0
    cfg = gk.GSPOConfig(importance_sampling_level="sequence", epsilon_low=0.2, epsilon_high=0.2)
    items = torch.tensor(30.0, device=DEVICE)

    def losses():
        outs = []
        out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, config=cfg, backend="triton")
        outs += [out.loss, *torch.autograd.grad(out.loss, (hidden, weight))]
        logits = (hidden @ weight.T).detach().requires_grad_()
        out = gk.gspo_loss(logits, labels, adv, old, mask=mask, config=cfg, backend="triton",
                           num_items_in_batch=items)
        outs += [out.loss, *torch.autograd.grad(out.loss, (logits,))]
        logp = (old + 0.01).requires_grad_()
        out = gk.policy_loss(logp, adv, old, mask=mask, config=cfg, backend="triton")
        outs += [out.loss, *torch.autograd.grad(out.loss, (logp,))]
        return [t.detach() for t in outs]

    eager = losses()
    reads = record_host_reads(monkeypatch)
    monkeypatch.setattr(checks, "cuda_graph_capturing", lambda: True)
    captured = losses()
    monkeypatch.undo()
    assert reads == []
    for a, b in zip(eager, captured):
        assert rel_err(b, a) < 1e-6


def test_garbage_in_rows_without_gradient_never_reaches_dw_when_capturing(monkeypatch):
    """With no host read allowed, rows without gradient go through the GEMMs as zero rows: NaN hidden states
    at masked positions still give finite, correct gradients."""
    hidden, weight, labels, adv, old = _problem()
    mask = torch.ones(labels.shape, device=DEVICE)
    mask[:, 3:] = 0
    poisoned = hidden.detach().clone()
    poisoned[:, 3:] = float("nan")
    poisoned.requires_grad_()
    cfg = gk.GSPOConfig(importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.2)
    monkeypatch.setattr(checks, "cuda_graph_capturing", lambda: True)
    out = gk.fused_linear_gspo_loss(poisoned, weight, labels, adv, old, mask=mask, config=cfg, backend="triton")
    dh, dw = torch.autograd.grad(out.loss, (poisoned, weight))
    monkeypatch.undo()
    leaves = [hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()]
    ref = reference.fused_linear_gspo_loss(*leaves, labels, adv.double(), old.double(), mask=mask, config=cfg)
    rdh, rdw = torch.autograd.grad(ref.loss, leaves)
    assert torch.isfinite(dw).all() and rel_err(dw, rdw) < RTOL
    assert torch.all(dh[:, 3:] == 0) and rel_err(dh, rdh) < RTOL


@pytest.mark.gpu
def test_a_loss_step_captures_in_a_cuda_graph():
    """GPU only: ``fused_linear_gspo_loss`` forward + backward (bf16, padded layout) captured in a
    ``torch.cuda.CUDAGraph`` (``tests.support.capture_cuda_graph``: side-stream warm-up, no eager graph alive,
    ``set_sync_debug_mode("error")`` during the capture, so no host read happens there), then replayed with
    other advantages written into the captured tensor: half the responses at zero advantage, first one half,
    then the other. Captured, the step cannot count the rows with gradient on the host, so every row goes
    through the GEMMs (zero rows as zeros): each replay equals the eager step on the same advantages, the
    zero-advantage responses get exactly zero ``dH``, the others not."""
    hidden, weight, labels, adv, old = _problem(B=16, T=32, H=256, V=4096, dtype=torch.bfloat16)
    cfg = gk.GSPOConfig(importance_sampling_level="sequence")
    # A > 0 everywhere it is not zero: the weights (~e^-4, far below the band) are then unclipped, so every
    # response with a nonzero advantage carries gradient.
    even = torch.arange(16, device=DEVICE) % 2 == 0
    adv = adv.abs() + 0.1
    patterns = [(torch.where(even, 0.0, adv), even), (torch.where(even, adv, 0.0), ~even)]
    static_adv = patterns[1][0].clone()  # captured with the other pattern than the first replay's

    def step():
        out = gk.fused_linear_gspo_loss(hidden, weight, labels, static_adv, old, config=cfg, backend="triton")
        return (out.loss, *torch.autograd.grad(out.loss, (hidden, weight)))

    graph, static = capture_cuda_graph(step)
    for dh, zero in replays_against_eager(graph, static, step, static_adv, patterns, tol=1e-3):
        assert torch.all(dh[zero] == 0)
        assert bool((dh[~zero].abs().amax(dim=(1, 2)) > 0).all())


def test_no_gradient_work_without_grad_mode():
    """Under ``torch.no_grad()`` (evaluation, old log-probs) the one-call loss does the forward GEMM only."""
    hidden, weight, labels, adv, old = _problem()
    B, T, H = hidden.shape
    V = weight.shape[0]

    def step():
        with torch.no_grad():
            gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, backend="triton")

    assert _count(step)[0] == 2 * B * T * H * V
