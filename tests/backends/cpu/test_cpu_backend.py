"""backend="cpu" (the C++ kernels of gspo_kernels/csrc, compiled on first use) against float64 math.

Tolerances: fp32 inputs within 1e-5 relative (of the largest reference entry) for log-probs,
entropies, losses, metrics and gradients, like the other backends. fp16/bf16 inputs: the forward
is computed in fp32 from the exactly representable inputs, so log-probs stay within 1e-5 of the
float64 values of the same rounded inputs; gradients come back in the input dtype, so they may
differ by one rounding of the output (2^-8 relative for bf16, 2^-11 for fp16) plus 1e-5.
The whole module is skipped, with the reason, when the extension is not built, except where
GSPO_KERNELS_REQUIRE_EXT=1 (set by `make test`, so CI fails instead of skipping).
"""

import os

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import backends, reference
from gspo_kernels.options import CallOptions
from tests.backends.torch.test_torch_backend import (
    check_extreme_logits,
    check_minus_inf_columns,
    check_out_of_range_labels,
)
from tests.support import NewTensors, rel_err

cpu_backend = pytest.importorskip("gspo_kernels.backends.cpu")
_REASON = backends.unavailable_reason("cpu")
if _REASON is not None and os.environ.get("GSPO_KERNELS_REQUIRE_EXT") == "1":
    raise RuntimeError(f"GSPO_KERNELS_REQUIRE_EXT=1 but the C++ extension is not available: {_REASON}")
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"C++ extension not available: {_REASON}")

RTOL = 1e-5
OUT_ROUNDING = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def objective64(logits64, labels, g, ge, temperature):
    """float64 ``sum(g * logp + ge * entropy)``, its parts, from logits ``[N, V]``."""
    logp_all = (logits64 / temperature).log_softmax(-1)
    logp = logp_all.gather(-1, labels[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return (g.double() * logp).sum() + (ge.double() * entropy).sum(), logp, entropy


# ---------------------------------------------------------------------------------------------
# Operator level: the kernels alone, against float64 math.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["rows", "strided3d"])
def test_logits_op_matches_float64(dtype, layout):
    B, T, V = 3, 7, 4099  # V spans three 2048-wide chunks, the last one partial
    N = B * T
    temperature = 0.7
    full = (torch.randn(B, T + 1, V) * 4).to(dtype)
    logits = full[:, :-1] if layout == "strided3d" else full[:, :-1].reshape(N, V)
    labels = torch.randint(0, V, (N,))
    active = torch.rand(N) > 0.2
    g = torch.randn(N)
    ge = torch.randn(N)
    g[::4] = 0.0
    ge[::4] = 0.0  # rows without gradient
    ge[1::4] = 0.0  # rows with a log-prob gradient only
    x64 = logits.double().reshape(N, V).requires_grad_()
    total, ref_logp, ref_ent = objective64(x64, labels, g * active, ge * active, temperature)
    (ref_grad,) = torch.autograd.grad(total, x64)

    x = logits.detach().clone().requires_grad_() if layout == "rows" else full.clone()[:, :-1].requires_grad_()
    logp, entropy = cpu_backend.logits_logprobs(x, labels, active=active, options=CallOptions(temperature=temperature, return_entropy=True))
    assert logp.dtype == entropy.dtype == torch.float32
    assert torch.all(logp[~active] == 0) and torch.all(entropy[~active] == 0)
    assert rel_err(logp[active], ref_logp[active]) < RTOL
    assert rel_err(entropy[active], ref_ent[active]) < RTOL
    (grad,) = torch.autograd.grad((g * logp).sum() + (ge * entropy).sum(), x)
    assert grad.dtype == dtype
    assert rel_err(grad.reshape(N, V), ref_grad) < RTOL + OUT_ROUNDING[dtype]
    skipped = (~active) | ((g == 0) & (ge == 0))
    assert torch.all(grad.reshape(N, V)[skipped] == 0)


def test_logits_op_inplace_backward_writes_every_row():
    N, V = 9, 3001
    logits = torch.randn(N, V) * 3
    labels = torch.randint(0, V, (N,))
    g = torch.randn(N)
    g[2] = 0.0
    x64 = logits.double().requires_grad_()
    total, _, _ = objective64(x64, labels, g, torch.zeros(N), 1.0)
    (ref_grad,) = torch.autograd.grad(total, x64)
    x = logits.clone().requires_grad_()
    logp, _ = cpu_backend.logits_logprobs(x, labels, options=CallOptions(inplace_backward=True))
    (g * logp).sum().backward()
    assert x.grad.data_ptr() == x.data_ptr()  # no [N, V] gradient buffer
    assert rel_err(x.grad, ref_grad) < RTOL
    assert torch.all(x.grad[2] == 0)  # a row without gradient is overwritten with zeros, not left as logits


LogitsSizedAllocations = NewTensors  # every new tensor of at least a logits' size, and every op


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_shifted_logits_write_the_base_gradient_once(inplace):
    """``gspo_loss(model_out[:, :-1], ...)`` on a model's (non-leaf) ``[B, T + 1, V]`` output. Counted
    at the dispatcher during the backward: one new logits-sized tensor out of place (the gradient), none with
    ``inplace_backward`` (written into the model output); autograd's ``slice_backward`` (a zero-filled second
    ``[B, T + 1, V]`` buffer) never runs. The gradient is float64's, zeros at the last position, and the same
    bits as the one of an unshifted contiguous copy of the view (rows never depend on their neighbours)."""
    B, T, V = 3, 5, 2100  # V: one full 2048-wide chunk and a partial one
    base = torch.randn(B, T + 1, V) * 3
    labels = torch.randint(0, V, (B, T))
    adv = torch.tensor([1.0, -0.5, 0.3])
    config = gk.GSPOConfig(entropy_coef=0.01, importance_sampling_level="token")
    leaf = base.clone().requires_grad_(True)
    model_out = leaf * 1.0  # a non-leaf, like a model's output
    out = gk.gspo_loss(model_out[:, :-1], labels, adv, config=config, backend="cpu", inplace_backward=inplace)
    with LogitsSizedAllocations(min_numel=B * T * V) as allocations:
        (grad,) = torch.autograd.grad(out.loss, model_out)
    assert "aten.slice_backward.default" not in allocations.ops, allocations.ops
    assert len(allocations.big) == (0 if inplace else 1), allocations.big
    if inplace:
        assert grad.data_ptr() == model_out.data_ptr()
    assert grad.shape == (B, T + 1, V) and torch.equal(grad[:, -1], torch.zeros(B, V))

    x64 = base.double().requires_grad_(True)
    ref = gk.gspo_loss(x64[:, :-1], labels, adv.double(), config=config, backend="torch")
    ref.loss.backward()
    assert rel_err(grad, x64.grad) < RTOL

    rows = base[:, :-1].contiguous().requires_grad_(True)  # not a view: the plain path
    plain = gk.gspo_loss(rows, labels, adv, config=config, backend="cpu")
    plain.loss.backward()
    assert torch.equal(grad[:, :-1], rows.grad)
    assert torch.equal(out.loss.detach(), plain.loss.detach())


def test_out_of_place_gradient_reuses_its_memory_only_when_free():
    """The out-of-place logits gradient (>= 4 MiB) is written into the previous gradient's memory once
    nothing holds it (no fresh pages, faults or zero-fill per step), never while the caller still holds it (its
    bits stay), and every element is rewritten (equal to a gradient computed into fresh memory)."""
    N, V = 64, 16384  # 4 MiB of fp32
    logits = torch.randn(N, V) * 2
    labels = torch.randint(0, V, (N,))
    g1, g2 = torch.randn(N), torch.randn(N)
    g2[::3] = 0.0  # rows the backward only zero-fills

    def grad_of(g):
        x = logits.clone().requires_grad_(True)
        logp, _ = cpu_backend.logits_logprobs(x, labels)
        return torch.autograd.grad((g * logp).sum(), x)[0]

    cpu_backend.release_buffers()
    first = grad_of(g1)
    kept = first.clone()
    second = grad_of(g2)  # the first is still held: fresh memory, the first untouched
    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(first, kept)
    ptr, want = second.data_ptr(), second.clone()
    del first, second
    third = grad_of(g2)  # the kept (second) buffer is free now: reused, fully rewritten
    assert third.data_ptr() == ptr
    assert torch.equal(third, want)
    fourth = grad_of(g1)  # the third is held: fresh again
    assert fourth.data_ptr() != third.data_ptr() and torch.equal(fourth, kept)
    cpu_backend.release_buffers()


def test_saved_logits_reuse_their_memory_only_when_free_and_are_fully_rewritten():
    """The hidden-state forward's saved logits (>= 4 MiB) go into the previous forward's buffer once nothing holds
    it (no fresh pages per step), never while a graph still holds it, and a step that reuses the buffer of another
    step's inputs gets the same bits as one that keeps nothing (``memory_budget=0``, recomputed logits: the
    documented "same bits whatever the budget"), with inactive rows whose entries the new forward does not write."""
    N, H, V = 64, 16, 16384  # N * V fp32: 4 MiB
    gen = torch.Generator().manual_seed(3)

    def problem():
        return (torch.randn(N, H, generator=gen), torch.randn(V, H, generator=gen) * 0.3,
                torch.randint(0, V, (N,), generator=gen), torch.rand(N, generator=gen) > 0.3)

    def fwd(hidden, weight, labels, active=None):
        row_block, gemm_rows, vocab_block = cpu_backend.blocks(N, H, V, False)
        return torch.ops.gspo_kernels.linear_fwd(hidden, weight, None, labels, active, 1.0, True, row_block,
                                                 gemm_rows, vocab_block, V)[3]

    def step(hidden, weight, labels, active, budget):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logp, ent = cpu_backend.linear_logprobs(h, w, None, labels, active=active, options=CallOptions(return_entropy=True, memory_budget=budget))
        g = torch.where(active, torch.randn(N, generator=torch.Generator().manual_seed(5)), 0.0)
        dh, dw = torch.autograd.grad((g * logp.nan_to_num() + 0.1 * ent).sum(), (h, w))
        return logp, ent, dh, dw

    cpu_backend.release_buffers()
    hidden, weight, labels, active = problem()
    first = fwd(hidden, weight, labels)
    kept = first.clone()
    second = fwd(hidden * 2, weight, labels)  # the first is held: fresh memory, the first untouched
    assert second.data_ptr() != first.data_ptr() and torch.equal(first, kept)
    ptr = second.data_ptr()
    del first, second
    third = fwd(hidden, weight, labels)  # the kept (second) buffer is free: reused, rewritten
    assert third.data_ptr() == ptr and torch.equal(third, kept)
    fourth = fwd(hidden, weight, labels)  # the third is held: fresh again
    assert fourth.data_ptr() != third.data_ptr()
    del third, fourth

    step(*problem(), None)  # a whole step of other inputs leaves its saved logits in the kept buffer
    inputs = problem()
    reused = step(*inputs, None)
    recomputed = step(*inputs, 0)
    for a, b in zip(reused, recomputed):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    cpu_backend.release_buffers()


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shifted_logits_op_level_softcap_entropy_and_leaf_base(inplace, dtype):
    """The shifted view through the backend function with a soft cap, the entropy's gradient, inactive rows and
    a *leaf* base: the base receives the gradient (``.grad`` of ``[B, T + 1, V]``), bit for bit that of the
    unshifted path, zeros at the last position. Views that are not a plain ``[:, :-1]`` keep their own gradient."""
    B, T, V = 2, 4, 1500
    full = (torch.randn(B, T + 1, V) * 5).to(dtype)
    labels = torch.randint(0, V, (B * T,))
    active = torch.rand(B * T) > 0.25
    g, ge = torch.randn(B * T), torch.randn(B * T)
    kwargs = dict(temperature=0.8, return_entropy=True, softcap=7.0)
    leaf = full.clone().requires_grad_(True)
    logp, entropy = cpu_backend.logits_logprobs(leaf[:, :-1], labels, active=active,
                                                  options=CallOptions(inplace_backward=inplace, **kwargs))
    ((g * logp).sum() + (ge * entropy).sum()).backward()
    rows = full[:, :-1].contiguous().requires_grad_(True)
    logp_ref, entropy_ref = cpu_backend.logits_logprobs(rows, labels, active=active, options=CallOptions(**kwargs))
    ((g * logp_ref).sum() + (ge * entropy_ref).sum()).backward()
    assert torch.equal(logp, logp_ref) and torch.equal(entropy, entropy_ref)
    assert leaf.grad.shape == (B, T + 1, V)
    assert torch.equal(leaf.grad[:, :-1], rows.grad) and torch.equal(leaf.grad[:, -1], torch.zeros(B, V, dtype=dtype))
    if inplace:
        assert leaf.grad.data_ptr() == leaf.data_ptr()
    for take in (lambda t: t[:, 1:], lambda t: t[:, :-2], lambda t: t[:, :-1, : V - 3]):
        base = full.float().clone().requires_grad_(True)
        view = take(base)
        n = view.shape[0] * view.shape[1]
        lab = torch.randint(0, view.shape[-1], (n,))
        lp, _ = cpu_backend.logits_logprobs(view, lab)
        (grad,) = torch.autograd.grad(lp.sum(), base)
        b64 = base.detach().double().requires_grad_(True)
        total, _, _ = objective64(take(b64).reshape(n, -1), lab, torch.ones(n), torch.zeros(n), 1.0)
        (ref,) = torch.autograd.grad(total, b64)
        assert rel_err(grad, ref) < RTOL




# saved logits: none (recompute every tile), the first two of four tiles, all of them
SAVE_BUDGETS = {"recompute": 0, "save-half": 23 * 4 * 66, "save-all": 1 << 30}


def small_blocks(monkeypatch, mode):
    """Blocks small enough for a 23 x 101 case: several row blocks (the last one partial), several
    vocabulary tiles of 33 (the last one partial); in the invariant mode 2-row GEMMs (padding in the
    last); in the default mode the GEMMs of the actual rows through oneDNN, or ATen's matmul."""
    if mode == "invariant":
        monkeypatch.setattr(cpu_backend.linear, "ROW_BLOCK", 5)
        monkeypatch.setattr(cpu_backend.linear, "VOCAB_BLOCK", 33)
        monkeypatch.setattr(cpu_backend.linear, "GEMM_ROWS", 2)
    else:
        monkeypatch.setattr(cpu_backend.linear, "FAST_ROW_BLOCK", 5)
        monkeypatch.setattr(cpu_backend.linear, "FAST_MIN_ROW_BLOCK", 1)
        monkeypatch.setattr(cpu_backend.linear, "FAST_VOCAB_BLOCK", 33)
        if mode == "default-aten":
            monkeypatch.setenv("GSPO_KERNELS_CPU_GEMM", "aten")
    return mode == "invariant"


MODES = ["default", "default-aten", "invariant"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("save", list(SAVE_BUDGETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_linear_op_matches_float64(dtype, with_bias, save, mode, monkeypatch):
    invariant = small_blocks(monkeypatch, mode)
    N, H, V = 23, 20, 101
    assert cpu_backend.blocks(N, H, V, invariant) == ((5, 2, 33) if invariant else (5, 0, 33))
    assert cpu_backend.saved_columns(N, V, 33, SAVE_BUDGETS[save]) == {"recompute": 0, "save-half": 66,
                                                                        "save-all": V}[save]
    temperature = 1.3
    hidden = torch.randn(N, H).to(dtype)
    weight = (torch.randn(V, H) * 0.4).to(dtype)
    bias = (torch.randn(V) * 0.2).to(dtype) if with_bias else None
    labels = torch.randint(0, V, (N,))
    active = torch.rand(N) > 0.2
    g, ge = torch.randn(N), torch.randn(N)
    g[::3], ge[::3] = 0.0, 0.0
    ge[1::3] = 0.0

    leaves64 = [t.double().requires_grad_() for t in (hidden, weight) + ((bias,) if with_bias else ())]
    z64 = leaves64[0] @ leaves64[1].T + (leaves64[2] if with_bias else 0)
    total, ref_logp, ref_ent = objective64(z64, labels, g * active, ge * active, temperature)
    ref_grads = torch.autograd.grad(total, leaves64)

    leaves = [t.clone().requires_grad_() for t in (hidden, weight) + ((bias,) if with_bias else ())]
    logp, entropy = cpu_backend.linear_logprobs(leaves[0], leaves[1], leaves[2] if with_bias else None, labels, active=active, options=CallOptions(temperature=temperature, return_entropy=True, memory_budget=SAVE_BUDGETS[save], batch_invariant=invariant))
    assert torch.all(logp[~active] == 0) and torch.all(entropy[~active] == 0)
    assert rel_err(logp[active], ref_logp[active]) < RTOL
    assert rel_err(entropy[active], ref_ent[active]) < RTOL
    grads = torch.autograd.grad((g * logp).sum() + (ge * entropy).sum(), leaves)
    for grad, ref, leaf in zip(grads, ref_grads, leaves):
        assert grad.dtype == leaf.dtype
        assert rel_err(grad, ref) < RTOL + OUT_ROUNDING[dtype]
    skipped = (~active) | ((g == 0) & (ge == 0))
    assert torch.all(grads[0][skipped] == 0)


@pytest.mark.parametrize("save", ["recompute", "save-all"])
def test_linear_op_backward_twice_gives_the_same_gradients(save):
    hidden = torch.randn(9, 16, requires_grad=True)
    weight = (torch.randn(50, 16) * 0.3).requires_grad_()
    labels = torch.randint(0, 50, (9,))
    logp, _ = cpu_backend.linear_logprobs(hidden, weight, None, labels, options=CallOptions(memory_budget=SAVE_BUDGETS[save]))
    first = torch.autograd.grad(logp.sum(), (hidden, weight), retain_graph=True)
    second = torch.autograd.grad(logp.sum(), (hidden, weight))  # the saved logits were not consumed
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_linear_op_frozen_weight_and_3d_hidden():
    B, T, H, V = 2, 5, 12, 70
    hidden = torch.randn(B, T, H, requires_grad=True)
    weight = torch.randn(V, H) * 0.3  # frozen: no dW is computed
    labels = torch.randint(0, V, (B * T,))
    logp, _ = cpu_backend.linear_logprobs(hidden, weight, None, labels)
    (dh,) = torch.autograd.grad(logp.sum(), hidden)
    h64 = hidden.detach().double().requires_grad_()
    ref = reference.token_logprobs(h64 @ weight.double().T, labels.reshape(B, T))
    (ref_dh,) = torch.autograd.grad(ref.sum(), h64)
    assert rel_err(logp.reshape(B, T), ref) < RTOL
    assert dh.shape == hidden.shape and rel_err(dh, ref_dh) < RTOL


@pytest.mark.parametrize("shape", [(3, 24, 5000), (700, 24, 9000)], ids=["N-below-every-block", "N-not-multiple"])
@pytest.mark.parametrize("save", ["recompute", "save-all"])
def test_linear_default_blocks_match_float64(shape, save):
    """The default mode with the blocks it picks itself: 3 rows (fewer than any row block) over two
    4096-wide tiles and a partial one; 700 rows (two 512-row blocks, the second partial) over V = 9000."""
    N, H, V = shape
    row_block, gemm_rows, vocab_block = cpu_backend.blocks(N, H, V, False)
    assert gemm_rows == 0 and V % vocab_block != 0 and (N < row_block or N % row_block != 0)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.3
    bias = torch.randn(V, generator=gen)
    labels = torch.randint(0, V, (N,), generator=gen)
    g, ge = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    leaves64 = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    total, ref_logp, ref_ent = objective64(leaves64[0] @ leaves64[1].T + leaves64[2], labels, g, ge, 0.9)
    ref_grads = torch.autograd.grad(total, leaves64)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logp, entropy = cpu_backend.linear_logprobs(*leaves, labels, options=CallOptions(temperature=0.9, return_entropy=True, memory_budget=SAVE_BUDGETS[save]))
    assert rel_err(logp, ref_logp) < RTOL and rel_err(entropy, ref_ent) < RTOL
    grads = torch.autograd.grad((g * logp).sum() + (ge * entropy).sum(), leaves)
    for grad, ref in zip(grads, ref_grads):
        assert rel_err(grad, ref) < RTOL


def test_linear_batch_invariant_fp64_is_refused():
    hidden, weight = torch.randn(4, 8, dtype=torch.float64), torch.randn(30, 8, dtype=torch.float64)
    labels = torch.randint(0, 30, (4,))
    with pytest.raises(ValueError, match="batch_invariant=True .* fp64"):
        cpu_backend.linear_logprobs(hidden, weight, None, labels, options=CallOptions(batch_invariant=True))
    with pytest.raises(ValueError, match="batch_invariant"):
        gk.linear_logprobs(hidden, weight, labels, backend="cpu", batch_invariant=True)
    logp, _ = cpu_backend.linear_logprobs(hidden, weight, None, labels)  # the default mode runs fp64
    assert logp.dtype == torch.float64


# ---------------------------------------------------------------------------------------------
# Through the public API, against gspo_kernels.reference, in every mode and layout.
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Backend selection and torch.compile.
# ---------------------------------------------------------------------------------------------


def test_auto_picks_cpu_backend():
    assert backends.resolve("auto", torch.device("cpu")).name == "cpu"
    assert "cpu" in gk.available_backends("cpu")


def test_missing_compiler_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("GSPO_KERNELS_CACHE", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(cpu_backend.build, "_loaded_path", None)
    monkeypatch.setattr(cpu_backend.ops, "_registered", False)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_backend.make_backend()


def _compile_case():
    B, T, V, H = 3, 5, 300, 16
    hidden = torch.randn(B, T, H)
    weight = torch.randn(V, H) * 0.3
    labels = torch.randint(0, V, (B, T))
    old = (reference.linear_logprobs(hidden, weight, labels) - 1e-4).float()
    ref_lp = old + 0.05 * torch.randn(B, T)
    adv = torch.randn(B)
    mask = (torch.rand(B, T) > 0.2).float()
    return hidden, weight, labels, adv, old, dict(mask=mask, ref_logprobs=ref_lp)


def _eager_and_compiled(step, hidden, weight):
    # aot_eager: Dynamo + AOTAutograd trace the ops through their fake implementations and autograd
    # formulas exactly as inductor does, without its ~70 s of C++ code generation on 2 cores.
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w)
        results.append((loss.detach(), *torch.autograd.grad(loss, (h, w))))
    for eager, comp in zip(*results):
        assert rel_err(comp, eager) < 1e-6


def test_torch_compile_fullgraph_over_cpu_ops_matches_eager():
    """The custom ops, their fake implementations and autograd formulas trace without graph breaks
    in both paths, with the PyTorch sequence stage on validated inputs."""
    from gspo_kernels.layout import LossTensors, prepare_loss_inputs
    from gspo_kernels.objectives.stage import gspo_objective

    hidden, weight, labels, adv, old, kw = _compile_case()
    cfg = gk.GSPOConfig(loss_type="bnpo", beta=0.04, entropy_coef=0.01)
    inputs = prepare_loss_inputs(labels, weight.shape[0], LossTensors(adv, old_logprobs=old, **kw), beta=cfg.beta)
    active = inputs.batch.mask > 0

    def step(h, w):
        logp, ent = cpu_backend.logits_logprobs(h @ w.T, inputs.labels, active=active, options=CallOptions(temperature=1.0, return_entropy=True))
        a = gspo_objective(logp, ent, inputs, cfg).loss
        logp, ent = cpu_backend.linear_logprobs(h, w, None, inputs.labels, active=active, options=CallOptions(temperature=1.0, return_entropy=True))
        return a + gspo_objective(logp, ent, inputs, cfg).loss

    _eager_and_compiled(step, hidden, weight)


def test_torch_compile_fullgraph_over_public_api():
    """gspo_loss and fused_linear_gspo_loss with backend="cpu", validation included, in one graph."""
    hidden, weight, labels, adv, old, kw = _compile_case()
    cfg = gk.GSPOConfig(loss_type="bnpo", beta=0.04, entropy_coef=0.01)

    def step(h, w):
        a = gk.gspo_loss(h @ w.T, labels, adv, old, config=cfg, backend="cpu", **kw).loss
        return a + gk.fused_linear_gspo_loss(h, w, labels, adv, old, config=cfg, backend="cpu", **kw).loss

    _eager_and_compiled(step, hidden, weight)


# ---------------------------------------------------------------------------------------------
# Numerics: extreme logits, -inf columns, out-of-range labels (the same checks as the torch backend).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["offset-1e4", "temperature-1e-6"])
@pytest.mark.parametrize("path", ["logits", "linear"])
def test_extreme_logits_fp32_within_1e5_of_float64(path, case):
    check_extreme_logits("cpu", path, case)


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_minus_inf_on_non_label_columns(path):
    check_minus_inf_columns("cpu", path)


def test_out_of_range_labels_give_nan_not_out_of_bounds():
    check_out_of_range_labels("cpu")
    # the operator itself, inactive rows included: an inactive row's label is never read, its outputs are 0
    logp, _, _ = torch.ops.gspo_kernels.logits_fwd(torch.randn(3, 5), torch.tensor([1, 5, -7]),
                                                   torch.tensor([True, True, False]), 1.0, False, False)
    assert torch.isfinite(logp[0]) and torch.isnan(logp[1]) and logp[2] == 0


# ---------------------------------------------------------------------------------------------
# memory_budget (the public option that replaced the module global).
# ---------------------------------------------------------------------------------------------


def test_memory_budget_option_through_the_public_api():
    B, T, H, V = 2, 5, 12, 70
    hidden, weight = torch.randn(B, T, H), torch.randn(V, H) * 0.3
    labels, adv = torch.randint(0, V, (B, T)), torch.tensor([1.0, -0.5])
    results = []
    for budget in (None, 0, 4 * 10 * 33, 1 << 40):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = gk.fused_linear_gspo_loss(h, w, labels, adv, backend="cpu", memory_budget=budget,
                                        batch_invariant=True)
        out.loss.backward()
        results.append((out.loss.detach(), h.grad, w.grad))
    module = gk.FusedLinearGSPOLoss(backend="cpu", memory_budget=0, batch_invariant=True)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    module(h, w, labels, adv).loss.backward()
    results.append((None, h.grad, w.grad))
    for r in results[1:]:  # batch_invariant: the same bits whatever the budget (saved logits = recomputed)
        assert all(a is None or torch.equal(a, b) for a, b in zip(r, results[0]))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = gk.fused_linear_gspo_loss(h, w, labels, adv, backend="cpu", memory_budget=0)  # default mode
    out.loss.backward()
    for a, b in zip((out.loss.detach(), h.grad, w.grad), results[0]):
        assert rel_err(a, b) < RTOL
    for bad in (-1, 1.5, True, "1GB"):
        with pytest.raises(ValueError, match="memory_budget"):
            gk.linear_logprobs(hidden, weight, labels, backend="cpu", memory_budget=bad)
        with pytest.raises(ValueError, match="memory_budget"):
            gk.FusedLinearGSPOLoss(memory_budget=bad)


# ---------------------------------------------------------------------------------------------
# Determinism and batch invariance.
# ---------------------------------------------------------------------------------------------


def _rows_alone_and_in_batch(blocks, monkeypatch):
    """A row's (logp, entropy, dH row) alone and among 64 others at several positions, with several
    budgets and active masks; every variant must give the same bits."""
    if blocks is not None:
        monkeypatch.setattr(cpu_backend.linear, "GEMM_ROWS", blocks[0])
        monkeypatch.setattr(cpu_backend.linear, "ROW_BLOCK", blocks[1])
        monkeypatch.setattr(cpu_backend.linear, "VOCAB_BLOCK", blocks[2])
    gen = torch.Generator().manual_seed(11)
    H, V = 256, 3000  # shapes where MKL's row results do depend on the number of rows of a GEMM
    weight = torch.randn(V, H, generator=gen) * 0.2
    bias = torch.randn(V, generator=gen)
    others = torch.randn(64, H, generator=gen)
    row = torch.randn(1, H, generator=gen)
    other_labels = torch.randint(0, V, (64,), generator=gen)
    label = torch.tensor([17])
    g, ge = 0.7, -0.3

    def run(hidden, labels, active, budget, pos):
        h = hidden.clone().requires_grad_()
        logp, ent = cpu_backend.linear_logprobs(h, weight, bias, labels, active=active, options=CallOptions(return_entropy=True, memory_budget=budget, batch_invariant=True))
        gl, gent = torch.zeros_like(logp), torch.zeros_like(ent)
        gl[pos], gent[pos] = g, ge
        gl[:pos] = 1.0  # the other rows carry gradient too (they share the fixed-shape GEMMs)
        (dh,) = torch.autograd.grad((gl * logp).sum() + (gent * ent).sum(), h)
        return logp[pos], ent[pos], dh[pos]

    results = [run(row, label, None, 0, 0), run(row, label, None, None, 0)]
    for pos in (0, 37, 64):
        hidden = torch.cat([others[:pos], row, others[pos:]])
        labels = torch.cat([other_labels[:pos], label, other_labels[pos:]])
        active = torch.rand(65, generator=gen) > 0.3
        active[pos] = True
        for budget, act in ((None, None), (0, None), (4 * 65 * 1024, active), (None, active)):
            results.append(run(hidden, labels, act, budget, pos))
    return results


@pytest.mark.parametrize("blocks", [None, (8, 24, 1024)], ids=["default-blocks", "small-blocks"])
def test_linear_rows_are_batch_invariant_when_asked(blocks, monkeypatch):
    results = _rows_alone_and_in_batch(blocks, monkeypatch)
    first = results[0]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r, first))


@pytest.mark.parametrize("blocks", [None, (8, 24, 1024)], ids=["default-blocks", "small-blocks"])
def test_linear_batch_invariant_bits_do_not_depend_on_the_thread_count(blocks, monkeypatch):
    """batch_invariant=True: the same (logp, entropy, dH, dW, dbias) bits with 1, 2, 3 and 8 intra-op threads.

    A BLAS call from outside a parallel region splits its work over as many threads as it gets, and MKL's sgemm
    splits the summed dimension too (an 8 x 1024 by 1024 x 256 product rounds differently with 1 and 2 threads):
    with dynamic threading the count, and so the row's bits, then depends on the machine's load (an H200 host
    under pytest-xdist failed the batch-invariance test). 8 threads on a 2-core machine is fine."""
    if blocks is not None:
        monkeypatch.setattr(cpu_backend.linear, "GEMM_ROWS", blocks[0])
        monkeypatch.setattr(cpu_backend.linear, "ROW_BLOCK", blocks[1])
        monkeypatch.setattr(cpu_backend.linear, "VOCAB_BLOCK", blocks[2])
    gen = torch.Generator().manual_seed(12)
    N, H, V = 37, 256, 3000
    hidden, weight, bias = torch.randn(N, H, generator=gen), torch.randn(V, H, generator=gen) * 0.2, torch.randn(V)
    labels = torch.randint(0, V, (N,), generator=gen)
    g, ge = torch.randn(N, generator=gen), torch.randn(N, generator=gen)

    def run():
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        logp, ent = cpu_backend.linear_logprobs(*leaves, labels, options=CallOptions(return_entropy=True, memory_budget=0, batch_invariant=True))
        return (logp, ent, *torch.autograd.grad((g * logp).sum() + (ge * ent).sum(), leaves))

    threads = torch.get_num_threads()
    try:
        results = {}
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            results[n] = run()
    finally:
        torch.set_num_threads(threads)
    names = ("logp", "entropy", "dH", "dW", "dbias")
    for n, r in results.items():
        differ = [name for name, a, b in zip(names, r, results[1]) if not torch.equal(a, b)]
        assert not differ, f"{n} threads vs 1: {differ} differ"


def test_linear_batch_invariant_row_alone_in_batch_of_40_and_permuted():
    """batch_invariant=True through the public API: two runs give identical bits; a row alone gives the
    bits it gets in a batch of 40 and after a permutation of that batch (log-prob, entropy, dH)."""
    gen = torch.Generator().manual_seed(8)
    H, V = 96, 5000
    weight = torch.randn(V, H, generator=gen) * 0.2
    hidden = torch.randn(40, H, generator=gen)
    labels = torch.randint(0, V, (40,), generator=gen)
    g, ge = torch.randn(40, generator=gen), torch.randn(40, generator=gen)

    def run(rows):
        h = hidden[rows].clone().requires_grad_()
        logp, ent = gk.linear_logprobs(h, weight, labels[rows], return_entropy=True, backend="cpu",
                                       batch_invariant=True)
        (dh,) = torch.autograd.grad((g[rows] * logp).sum() + (ge[rows] * ent).sum(), h)
        return logp, ent, dh

    batch = run(torch.arange(40))
    assert all(torch.equal(a, b) for a, b in zip(batch, run(torch.arange(40))))  # two runs
    perm = torch.randperm(40, generator=gen)
    permuted = run(perm)
    for a, b in zip(batch, permuted):
        assert torch.equal(a[perm], b)
    for i in (0, 17, 39):
        alone = run(torch.tensor([i]))
        for a, b in zip(batch, alone):
            assert torch.equal(a[i], b[0])


def test_linear_default_mode_is_deterministic_and_close_to_invariant_mode():
    gen = torch.Generator().manual_seed(4)
    N, H, V = 300, 40, 9000
    hidden, weight = torch.randn(N, H, generator=gen), torch.randn(V, H, generator=gen) * 0.2
    labels = torch.randint(0, V, (N,), generator=gen)
    g = torch.randn(N, generator=gen)
    runs = []
    for invariant in (False, False, True):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
        logp, _ = cpu_backend.linear_logprobs(*leaves, None, labels, options=CallOptions(batch_invariant=invariant))
        runs.append((logp, *torch.autograd.grad((g * logp).sum(), leaves)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert all(rel_err(a, b) < RTOL for a, b in zip(runs[0], runs[2]))


def test_logits_rows_are_batch_invariant():
    gen = torch.Generator().manual_seed(5)
    V = 5000
    row = torch.randn(1, V, generator=gen) * 3
    others = torch.randn(40, V, generator=gen) * 3
    label = torch.tensor([9])

    def run(x, labels, pos):
        x = x.clone().requires_grad_()
        logp, ent = cpu_backend.logits_logprobs(x, labels, options=CallOptions(return_entropy=True))
        (grad,) = torch.autograd.grad(logp[pos] * 0.7 - ent[pos] * 0.3, x)
        return logp[pos], ent[pos], grad[pos]

    first = run(row, label, 0)
    for pos in (0, 13, 40):
        x = torch.cat([others[:pos], row, others[pos:]])
        labels = torch.cat([torch.zeros(pos, dtype=torch.long), label, torch.zeros(40 - pos, dtype=torch.long)])
        # an odd offset of the row in memory too: the lane order of the sums does not depend on alignment
        shifted = torch.cat([torch.zeros(x.numel() + 3)])[3:].view_as(x).copy_(x)
        for inp in (x, shifted):
            assert all(torch.equal(a, b) for a, b in zip(run(inp, labels, pos), first))


def test_linear_backward_is_deterministic():
    gen = torch.Generator().manual_seed(2)
    N, H, V = 300, 40, 2500
    hidden, weight, bias = torch.randn(N, H, generator=gen), torch.randn(V, H, generator=gen) * 0.2, torch.randn(V)
    labels = torch.randint(0, V, (N,), generator=gen)
    g, ge = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    runs = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        logp, ent = cpu_backend.linear_logprobs(*leaves, labels, options=CallOptions(return_entropy=True, memory_budget=0))
        runs.append((logp, ent, *torch.autograd.grad((g * logp).sum() + (ge * ent).sum(), leaves)))
    for r in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r, runs[0]))
