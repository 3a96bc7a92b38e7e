"""Triton hidden-state path (``gspo_kernels/backends/triton/linear_*.py``) against float64 math.

On machines without CUDA the kernels run in the Triton interpreter (conftest sets ``TRITON_INTERPRET=1``)
with the small interpreter block sizes (16 rows x 32 vocabulary x 16 hidden), so every shape below spans
several row, vocabulary and hidden tiles with ragged last tiles. The interpreter's ``tl.dot`` is wrong
for bf16 operands (docs/kernels.md): the kernels then upcast their dot operands to fp32 (the ``UPCAST``
constexpr), so the bf16 tests here check the bf16 loads/stores and roundings, not bf16 tensor cores.

Tolerances (relative to the largest reference entry): fp32 within 1e-5 (logp, entropy, dH, dW, dbias,
loss, metrics). fp16/bf16 operands (exactly representable inputs, fp32 math): log-probs and entropies
within 1e-5; gradients within two roundings of the operand dtype (the ``dZ`` operand of the gradient
products and the output), stated as ``2^-9`` for fp16 and ``2^-7`` for bf16.
"""

import glob
import os
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gspo_kernels.backends.triton import configs
from gspo_kernels.backends.triton.linear_invariant import linear_logprobs, linear_logprobs_forward
from gspo_kernels.options import CallOptions
from tests.support import rel_err, triton_test_device

# With CUDA (``gspo-kernels gpu-check`` runs this module there) every tensor below is made on the GPU
# (``torch.set_default_device``) and the kernels run compiled, with their CUDA launch configurations.
DEVICE = triton_test_device()


@pytest.fixture(autouse=True)
def _on_device():
    if DEVICE == "cpu":
        yield
        return
    torch.set_default_device(DEVICE)
    try:
        yield
    finally:
        torch.set_default_device(None)


RTOL = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
GRAD_RTOL = {torch.float16: 2.0**-9, torch.bfloat16: 2.0**-7}


def float64_math(hidden, weight, bias, labels, temperature, g_logp, g_ent):
    """logp, entropy and the gradients of ``sum(g_logp * logp + g_ent * entropy)``, all in float64.

    ``p log p`` is taken as 0 where ``p = 0`` (a ``-inf`` logit), so that the oracle is finite there.
    """
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    b = None if bias is None else bias.detach().double().requires_grad_()
    z = h.reshape(-1, h.shape[-1]) @ w.T
    if b is not None:
        z = z + b
    logp_all = (z / temperature).log_softmax(-1)
    logp = logp_all.gather(1, labels.reshape(-1, 1))[:, 0]
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, torch.zeros_like(p))).sum(-1)
    (logp * g_logp.double() + entropy * g_ent.double()).sum().backward()
    return logp, entropy, h.grad, w.grad, (None if b is None else b.grad)


def make_hidden(layout, N_or_BT, H, dtype):
    """hidden in one of three layouts: contiguous [N, H], a strided [B, T, H] view, a row-strided [N, H]."""
    if layout == "rows":
        return torch.randn(N_or_BT[0] * N_or_BT[1], H, dtype=dtype)
    if layout == "batch_view":  # [B, T, H] = big[:, 1:] : B and T cannot be merged into one stride
        B, T = N_or_BT
        return torch.randn(B, T + 1, H, dtype=dtype)[:, 1:]
    big = torch.randn(N_or_BT[0] * N_or_BT[1], H + 5, dtype=dtype)  # row stride H + 5
    return big[:, 2 : 2 + H]


def run(hidden, weight, bias, labels, g_logp, g_ent, **kwargs):
    """``(logp, entropy, dh, dw, db)`` of the Triton path for ``sum(g_logp * logp + g_ent * entropy)``."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    logp, entropy = linear_logprobs(h, w, b, labels, options=CallOptions(return_entropy=True, **kwargs))
    grads = torch.autograd.grad((logp * g_logp + entropy * g_ent).sum(), [t for t in (h, w, b) if t is not None])
    return (logp, entropy, *grads) + ((None,) if b is None else ())


@pytest.mark.parametrize("budget", [None, 1], ids=["default_budget", "one_tile_chunks"])
@pytest.mark.parametrize("H", [37, 32], ids=["H37", "H32"])
@pytest.mark.parametrize("layout,with_bias,temperature", [
    ("rows", True, 0.7),
    ("batch_view", False, 1.0),
    ("row_strided", True, 1.3),
])
def test_fp32_forward_backward(layout, with_bias, temperature, H, budget):
    B, T, V = 3, 11, 101  # N = 33 rows (3 row tiles), V = 101 (4 vocabulary tiles, last partial)
    hidden = make_hidden(layout, (B, T), H, torch.float32)
    weight = torch.randn(V, H) * 0.3
    bias = torch.randn(V) * 0.5 if with_bias else None
    N = B * T
    labels = torch.randint(0, V, (N,))
    g_logp, g_ent = torch.randn(N), torch.randn(N)
    g_logp[::3] = 0  # every third row carries no gradient at all
    g_ent[::3] = 0
    g_ent[1::3] = 0  # and some only through logp
    h = hidden.clone().requires_grad_() if layout == "rows" else hidden.requires_grad_()
    w, b = weight.clone().requires_grad_(), None if bias is None else bias.clone().requires_grad_()
    logp, entropy = linear_logprobs(h, w, b, labels, options=CallOptions(temperature=temperature, return_entropy=True, memory_budget=budget))
    grads = torch.autograd.grad((logp * g_logp + entropy * g_ent).sum(), [t for t in (h, w, b) if t is not None])
    ref = float64_math(hidden, weight, bias, labels, temperature, g_logp, g_ent)
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32
    assert rel_err(logp, ref[0]) < RTOL
    assert rel_err(entropy, ref[1]) < RTOL
    assert grads[0].shape == hidden.shape
    for got, want in zip(grads, [g for g in ref[2:] if g is not None]):
        assert rel_err(got, want) < RTOL
    dh = grads[0].reshape(N, H)
    assert torch.all(dh[::3] == 0), "rows without gradient must get exactly zero dH"
    assert bool((dh[1::3] != 0).any())


@pytest.mark.parametrize("split_cols", [32, 64, 224])
def test_vocabulary_splits_combine(split_cols):
    """The per-split partial statistics combine to the same log-probs for any split width."""
    N, H, V = 20, 16, 211
    hidden, weight = torch.randn(N, H), torch.randn(V, H)
    labels = torch.randint(0, V, (N,))
    cfg = dict(configs.INTERPRETER_FWD_CONFIG, SPLIT_COLS=split_cols)
    logp, entropy, row_max, log_sum = linear_logprobs_forward(hidden, weight, None, labels, 1.0, config=cfg)
    z = hidden.double() @ weight.double().T
    assert rel_err(row_max + log_sum, z.logsumexp(-1)) < RTOL
    assert rel_err(logp, z.log_softmax(-1).gather(1, labels[:, None])[:, 0]) < RTOL
    assert rel_err(entropy, -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)) < RTOL


def test_active_rows_and_empty():
    N, H, V = 29, 24, 70
    hidden, weight = torch.randn(N, H).requires_grad_(), torch.randn(V, H).requires_grad_()
    labels = torch.randint(0, V, (N,))
    active = torch.rand(N) > 0.4
    poisoned = torch.full((N,), float("nan"))
    logp, _ = linear_logprobs(hidden, weight, None, labels, active=active)
    assert torch.all(logp[~active] == 0)
    ref = float64_math(hidden, weight, None, labels, 1.0, active.float(), torch.zeros(N))
    assert rel_err(logp[active], ref[0][active]) < RTOL
    logp.sum().backward()
    assert torch.all(hidden.grad[~active] == 0)
    assert rel_err(hidden.grad, ref[2]) < RTOL and rel_err(weight.grad, ref[3]) < RTOL
    # no active row at all: zeros, and zero gradients (no NaN from an empty launch)
    hidden.grad = weight.grad = None
    logp, entropy = linear_logprobs(hidden, weight, None, labels, active=torch.zeros(N, dtype=torch.bool), options=CallOptions(return_entropy=True))
    assert torch.all(logp == 0) and torch.all(entropy == 0)
    (logp * poisoned.nan_to_num(1.0)).sum().backward()
    assert torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_against_float64(dtype):
    """Half-precision operands: fp32 math on exactly representable inputs, so log-probs within 1e-5 and
    gradients within two roundings of the operand dtype (``GRAD_RTOL``); gradients in the operand dtype."""
    B, T, H, V = 2, 12, 48, 300
    hidden = torch.randn(B, T, H).to(dtype)
    weight = (torch.randn(V, H) * 0.2).to(dtype)
    bias = (torch.randn(V) * 0.3).to(dtype)
    N = B * T
    labels = torch.randint(0, V, (N,))
    g_logp, g_ent = torch.randn(N), torch.randn(N) * 0.1
    g_logp[::4] = 0
    g_ent[::4] = 0
    ref = float64_math(hidden, weight, bias, labels, 0.9, g_logp, g_ent)
    logp, entropy, *grads = run(hidden, weight, bias, labels, g_logp, g_ent, temperature=0.9)
    assert logp.dtype == torch.float32
    assert rel_err(logp, ref[0]) < RTOL
    assert rel_err(entropy, ref[1]) < RTOL
    for got, want in zip(grads, ref[2:]):
        assert got.dtype == dtype
        assert rel_err(got, want) < GRAD_RTOL[dtype]
    assert torch.all(grads[0].reshape(N, H)[::4] == 0)


# --- determinism and batch invariance ---------------------------------------------------------------


def _problem(N=40, H=24, V=90, seed=3):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.4
    bias = torch.randn(V, generator=gen) * 0.3
    labels = torch.randint(0, V, (N,), generator=gen)
    return hidden, weight, bias, labels, torch.randn(N, generator=gen), torch.randn(N, generator=gen)


def test_two_runs_give_identical_bits():
    hidden, weight, bias, labels, g_logp, g_ent = _problem()
    g_logp[::5] = 0
    first = run(hidden, weight, bias, labels, g_logp, g_ent, memory_budget=1)
    second = run(hidden, weight, bias, labels, g_logp, g_ent, memory_budget=1)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batch_invariance(dtype, row_independent_dot):
    """A row's log-prob, entropy and dH row are the same bits alone, among 64 others at any position,
    among rows that carry no gradient, and for any chunk budget (one row tile per chunk or one chunk).

    Every row that carries a gradient in two differently composed batches is compared, and three rows
    are also computed alone. In the interpreter with the fixed-order ``tl.dot`` of :func:`row_independent_dot`;
    on CUDA with the compiled kernels."""
    H, V = 24, 300
    hidden, weight, bias, labels, g_logp, g_ent = _problem(N=65, H=H, V=V, seed=11)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    base = run(hidden, weight, bias, labels, g_logp, g_ent)
    for probe in (0, 7, 64):
        alone = run(hidden[probe : probe + 1], weight, bias, labels[probe : probe + 1], g_logp[probe : probe + 1],
                    g_ent[probe : probe + 1], memory_budget=1)
        for k in range(3):
            assert torch.equal(alone[k][0], base[k][probe]), (probe, k)
    for shift, budget in ((13, 1), (40, 2 * V * 16 * hidden.element_size())):
        perm = torch.roll(torch.arange(65), shift)  # every row lands at another position (and row tile)
        gl, ge = g_logp[perm].clone(), g_ent[perm].clone()
        gl[::3], ge[::3] = 0, 0  # rows that carry no gradient change the compaction around the others
        among = run(hidden[perm], weight, bias, labels[perm], gl, ge, memory_budget=budget)
        carries = gl != 0
        assert int(carries.sum()) > 30
        for k in range(3):
            assert torch.equal(among[k][carries], base[k][perm][carries]), (shift, k)


def test_rows_without_gradient_are_not_visited():
    """Rows whose incoming gradient is zero are skipped, not multiplied by zero: their hidden states hold
    NaN (e.g. garbage in padding) and the gradients stay finite and equal to the oracle's on the other rows.
    A backward that visited every row would put ``0 * NaN = NaN`` into ``dW``."""
    hidden, weight, bias, labels, g_logp, g_ent = _problem(N=30, V=70)
    g_logp[::2], g_ent[::2] = 0, 0
    poisoned = hidden.clone()
    poisoned[::2] = float("nan")
    logp, entropy, dh, dw, db = run(poisoned, weight, bias, labels, g_logp, g_ent)
    assert torch.isnan(logp[::2]).all()  # the forward computed them (no active mask)
    ref = float64_math(hidden, weight, bias, labels, 1.0, g_logp, g_ent)
    assert torch.all(dh[::2] == 0) and rel_err(dh, ref[2]) < RTOL
    assert rel_err(dw, ref[3]) < RTOL and rel_err(db, ref[4]) < RTOL


@pytest.mark.parametrize("tiles", [1, 3])
def test_chunk_buffers_stay_within_the_memory_budget(tiles):
    """Every allocation of the backward with a vocabulary-sized last dimension (the chunk buffers ``dZ`` and the
    bias partial sums) counted, in bytes, against a budget of ``tiles`` row tiles; dH keeps its bits."""

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.startswith(("empty", "zeros", "new_empty")) and isinstance(out, torch.Tensor):
                self.sizes.append((tuple(out.shape), out.numel() * out.element_size()))
            return out

    hidden, weight, bias, labels, g_logp, g_ent = _problem(N=70, V=90)
    tile = configs.linear_bwd_config(torch.float32)["dz"]["BLOCK_N"]  # rows of one row tile (16 in the interpreter)
    budget = tiles * (tile * 90 * 4 + 4 * 90)  # fp32 dZ rows of one row tile + its bias partials
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    logp, entropy = linear_logprobs(h, w, b, labels, options=CallOptions(return_entropy=True, memory_budget=budget))
    with Allocations() as rec:
        grads = torch.autograd.grad((logp * g_logp + entropy * g_ent).sum(), (h, w, b))
    chunk = [size for shape, size in rec.sizes if len(shape) == 2 and shape[-1] == 90]
    assert chunk and sum(chunk) <= budget, rec.sizes
    whole = run(hidden, weight, bias, labels, g_logp, g_ent)
    assert torch.equal(grads[0], whole[2])  # dH rows: the same bits for any budget
    for a, c in zip(grads[1:], whole[3:]):  # dW, dbias: sums over the chunks, in another order
        assert rel_err(a, c) < RTOL


def test_fp64_inputs_give_fp64_outputs_computed_in_fp32():
    hidden, weight, bias, labels, g_logp, g_ent = _problem(N=14, V=50)
    out = run(hidden.double(), weight.double(), bias.double(), labels, g_logp.double(), g_ent.double())
    ref = float64_math(hidden, weight, bias, labels, 1.0, g_logp, g_ent)
    for got, want in zip(out, ref):
        assert got.dtype == torch.float64 and rel_err(got, want) < RTOL


@pytest.mark.parametrize("n", [0, 1, 37])
def test_device_compaction_is_a_stable_permutation(n):
    """``compact_rows``: the True indices in order, then the False ones; ``count`` on the device."""
    from gspo_kernels.backends.triton.linear_invariant import compact_rows

    mask = torch.rand(n) > 0.6
    order, count = compact_rows(mask)
    assert torch.equal(order, torch.cat([mask.nonzero()[:, 0], (~mask).nonzero()[:, 0]]))
    assert count.shape == (1,) and int(count) == int(mask.sum())


@pytest.mark.parametrize("budget", [-1, 1.5, "1GB", True])
def test_bad_memory_budget_is_refused(budget):
    """Refused by the public function (validated once there, before the backend runs)."""
    import gspo_kernels as gk

    hidden, weight, _, labels, _, _ = _problem(N=4, V=20)
    with pytest.raises(ValueError, match="memory_budget"):
        gk.linear_logprobs(hidden, weight, labels, memory_budget=budget, backend="triton", batch_invariant=True)


def test_no_floating_point_atomics_in_any_kernel():
    """No ``atomic_add`` (or any other ``tl.atomic_*`` reduction) in the library's Triton sources."""
    sources = sorted(glob.glob(os.path.join(ROOT, "gspo_kernels", "backends", "triton", "*.py")))
    assert {"launch.py", "logits.py", "linear.py", "sequence.py"} <= {os.path.basename(p) for p in sources}
    offenders = [os.path.basename(path) for path in sources
                 if re.search(r"\batomic_(add|max|min|xchg|cas)\b", open(path).read())]
    assert offenders == []


def test_no_host_synchronisation_in_autograd():
    """Forward and backward dispatch no op that reads a device value on the host (``nonzero``, ``item``,
    ``bool(tensor)``, ``any``), so the Function can be captured in a CUDA graph."""

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    hidden, weight, bias, labels, g_logp, g_ent = _problem(N=20)
    g_logp[::4] = 0
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    with Recorder() as rec:
        logp, entropy = linear_logprobs(h, w, b, labels, active=torch.rand(20) > 0.2, options=CallOptions(return_entropy=True))
        (logp * g_logp + entropy * g_ent).sum().backward()
    assert "scatter_" in rec.ops  # the recorder sees the compaction's ops
    assert not rec.ops & {"nonzero", "_local_scalar_dense", "is_nonzero", "any", "masked_select", "unique"}


# --- defects of the hidden path ---------------------------------------------------------------------


def test_minus_inf_bias_entry_gives_finite_entropy_and_gradients():
    """A ``-inf`` bias entry (a vocabulary mask) on non-label columns: finite, and equal to the oracle."""
    hidden, weight, bias, labels, g_logp, g_ent = _problem(N=18, V=70)
    bias[[3, 40, 41, 69]] = float("-inf")
    labels = torch.where(torch.isin(labels, torch.tensor([3, 40, 41, 69])), labels + 1, labels)
    logp, entropy, dh, dw, db = run(hidden, weight, bias, labels, g_logp, g_ent)
    ref = float64_math(hidden, weight, bias, labels, 1.0, g_logp, g_ent)
    assert torch.isfinite(entropy).all() and torch.isfinite(dh).all() and torch.isfinite(dw).all()
    assert rel_err(logp, ref[0]) < RTOL and rel_err(entropy, ref[1]) < RTOL
    assert rel_err(dh, ref[2]) < RTOL and rel_err(dw, ref[3]) < RTOL
    assert torch.isfinite(db).all() and rel_err(db, ref[4]) < RTOL


def test_strided_bias_is_read_with_its_stride():
    """``bias = torch.randn(2 V)[::2]`` (stride 2) gives the same bits as ``bias.contiguous()``."""
    hidden, weight, bias, labels, g_logp, g_ent = _problem(N=12, V=40)
    results = []
    for b in (torch.empty_strided((40,), (2,)).copy_(bias), bias.contiguous()):
        b.requires_grad_()
        assert b.is_contiguous() == (len(results) == 1)
        logp, entropy = linear_logprobs(hidden, weight, b, labels, options=CallOptions(return_entropy=True))
        (db,) = torch.autograd.grad((logp * g_logp + entropy * g_ent).sum(), (b,))
        results.append((logp, entropy, db))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    ref = float64_math(hidden, weight, bias, labels, 1.0, g_logp, g_ent)
    assert rel_err(results[0][0], ref[0]) < RTOL and rel_err(results[0][2], ref[4]) < RTOL


def test_out_of_range_labels_give_nan_rows_only():
    """Labels outside [0, V) (value checks skipped, e.g. under torch.compile): NaN for that row, never a
    read out of bounds, and the other rows unchanged."""
    hidden, weight, bias, labels, _, _ = _problem(N=10, V=40)
    bad = labels.clone()
    bad[2], bad[7] = -100, 40
    logp, entropy = linear_logprobs(hidden, weight, bias, bad, options=CallOptions(return_entropy=True))
    good, _ = linear_logprobs(hidden, weight, bias, labels, options=CallOptions(return_entropy=True))
    assert torch.isnan(logp[2]) and torch.isnan(logp[7])
    keep = torch.ones(10, dtype=torch.bool)
    keep[[2, 7]] = False
    assert torch.equal(logp[keep], good[keep]) and torch.isfinite(entropy).all()


def test_bf16_hidden_with_fp32_weight_runs_bf16_operands(monkeypatch):
    """Mixed dtypes through the public function: the precision policy makes bf16 the operand dtype of both
    (no fp32 ``ieee`` products), the backend keeps no fp32 copy of the hidden states for the backward, and
    the gradients come back in the caller's dtypes."""
    import gspo_kernels as gk
    from gspo_kernels.backends.triton import linear_invariant as linear

    seen = []
    real = linear.linear_logprobs_forward

    def spy(h, w, *args, **kwargs):
        seen.append((h.dtype, w.dtype))
        return real(h, w, *args, **kwargs)

    monkeypatch.setattr(linear, "linear_logprobs_forward", spy)
    hidden, weight, bias, labels, g_logp, _ = _problem(N=16, V=50)
    h16 = hidden.bfloat16().requires_grad_()
    w32 = weight.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logp = gk.linear_logprobs(h16, w32, labels, backend="triton", batch_invariant=True)
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    big = [t for t in saved if t.numel() > 16]
    assert big and all(t.dtype == torch.bfloat16 for t in big), [(t.dtype, t.shape) for t in big]
    assert any(t.data_ptr() == h16.data_ptr() for t in big)
    dh, dw = torch.autograd.grad((logp * g_logp).sum(), (h16, w32))
    assert dh.dtype == torch.bfloat16 and dw.dtype == torch.float32
    ref = float64_math(h16, weight.bfloat16(), None, labels, 1.0, g_logp, torch.zeros(16))
    assert rel_err(logp, ref[0]) < RTOL and rel_err(dw, ref[3]) < GRAD_RTOL[torch.bfloat16]


def test_mixed_operand_dtypes_reaching_the_backend_are_refused():
    """The backend decides no dtype: a pair the precision policy did not make equal raises ``TypeError``
    naming hidden and weight (``precision.kernel_operand_dtype``); fp64 with fp32 runs in fp32."""
    hidden, weight, _, labels, _, _ = _problem(N=4, V=20)
    with pytest.raises(TypeError, match="hidden is torch.bfloat16 and weight is torch.float32"):
        linear_logprobs(hidden.bfloat16(), weight, None, labels)
    logp, _ = linear_logprobs(hidden.double(), weight, None, labels)
    want, _ = linear_logprobs(hidden, weight, None, labels)
    assert logp.dtype == torch.float64 and torch.equal(logp, want.double())


# The unit roundoff of fp32 (half an ulp of 1): a rounding to fp32 moves ``x`` by at most ``U32 * |x|``.
U32 = 2.0**-24


def tiny_temperature_bound(z_max: float, temperature: float, c: float = 4.0) -> float:
    """The relative error (to the largest entry) that fp32 arithmetic allows the log-prob and entropy
    gradients, and the entropy, at ``temperature`` for logits up to ``z_max`` in magnitude: ``c U z_max / T``.

    Derivation. The kernels form each logit ``z = h . w + b`` in fp32 and scale it, ``s = z / T``. Whatever the
    summation order, the result is rounded to fp32: it may differ from the exact ``z`` (which the float64
    reference has) by ``U |z|`` at least, a few ``U |z|`` after the ``H``-term accumulation; and the forward
    (row max and ``log sum exp``) and the backward (``p = exp(s - lse)``) may each round it differently
    (another order of the dot product, ``z * (1 / T)`` contracted into an FMA or rounded first). On ``s`` these
    are absolute errors of order ``U |z| / T``: at ``T = 1e-6`` and ``|z| ~ 1``, one ulp of ``z`` moves ``s``
    by ~0.06. A probability is ``exp(s_j - lse)``, so an absolute error ``e`` in ``s`` is a relative error
    ``e^e - 1 ~ e`` in ``p``; the logit gradient ``(onehot - p) g / T + p (H - log p - ...) g_H / T`` and the
    entropy inherit it relative to their scale ``|g| / T``, and ``dH = dZ W``, ``dW = dZ^T h``, ``db = sum dZ``
    carry it to the same relative order. To first order (valid while ``U z_max / T << 1``):
    ``rel_err <= c U z_max / T``, ``c = 4`` covering the two roundings (forward, backward) of a logit formed
    with a few-ulp accumulation error. The log-probs themselves are ``s - lse`` with ``|s|`` up to
    ``z_max / T``: relative to their largest magnitude the same errors are ~``U``, inside ``RTOL``.

    Beyond that (``U z_max / T`` near 1) fp32 promises nothing about the gradient: ``p`` of a row's top logit
    can be off by a factor ``e^(U z_max / T)``; no fp32 implementation is within ``1e-5`` of float64 there
    unless it forms ``z`` bit for bit as the reference does (the interpreter's ``tl.dot`` happens to give the
    same bits in the forward and the backward; a GPU's does not: 7.2e-2 was measured on an H200 with
    ``z_max ~ 7``, ``T = 1e-6``, where ``U z_max / T ~ 0.45``)."""
    return c * U32 * z_max / temperature


@pytest.mark.parametrize("case", ["offset_1e4", "temperature_1e-6"])
def test_extreme_logits_gradients_within_1e5(case):
    """fp32 logits near 1e4 (through the bias): every output within 1e-5 of float64.

    Temperature 1e-6: the log-probs within 1e-5; the entropy and the gradients within the bound fp32 allows,
    :func:`tiny_temperature_bound` (its docstring derives it). To make that bound say something, the logits
    are scaled by ``2^-10`` (exact in fp32: hidden and bias times a power of two) to ``|z| <= ~7e-3``: the
    scaled logits ``z / T`` still span thousands (a softmax this sharp overflows without the max subtraction;
    the closest pair of a row's top logits sits ~8 apart, so ``p`` is not quite one-hot) and the bound is
    ~2e-3. With the unscaled logits (``|z|`` up to ~7, bound above 1) only finiteness and the log-probs are
    checked."""
    hidden, weight, bias, labels, g_logp, g_ent = _problem(N=24, V=60)
    if case == "offset_1e4":
        bias = bias + 1e4
        out = run(hidden, weight, bias, labels, g_logp, g_ent)
        ref = float64_math(hidden, weight, bias, labels, 1.0, g_logp, g_ent)
        for got, want in zip(out, ref):
            assert rel_err(got, want) < RTOL
        return
    temperature = 1e-6
    out = run(hidden, weight, bias, labels, g_logp, g_ent, temperature=temperature)
    ref = float64_math(hidden, weight, bias, labels, temperature, g_logp, g_ent)
    assert rel_err(out[0], ref[0]) < RTOL
    assert all(bool(torch.isfinite(t).all()) for t in out)
    hidden, bias = hidden * 2.0**-10, bias * 2.0**-10
    z_max = float((hidden.double() @ weight.double().T + bias.double()).abs().max())
    bound = tiny_temperature_bound(z_max, temperature)
    assert 1e-4 < bound < 1e-2  # informative: far below 1, far above RTOL
    out = run(hidden, weight, bias, labels, g_logp, g_ent, temperature=temperature)
    ref = float64_math(hidden, weight, bias, labels, temperature, g_logp, g_ent)
    assert rel_err(out[0], ref[0]) < RTOL
    for name, got, want in zip(("entropy", "dh", "dw", "db"), out[1:], ref[1:]):
        assert rel_err(got, want) <= bound, (name, rel_err(got, want), bound)
    assert float(ref[1].detach().abs().max()) > 1e-4  # some rows are not one-hot: the entropy is not trivially 0


@pytest.mark.gpu
def test_gpu_launches_on_the_tensors_device():
    """Tensors on cuda:1 while cuda:0 is current: the kernels run on cuda:1 (device guard)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (never ran here)")
    torch.cuda.set_device(0)
    hidden, weight, bias, labels, g_logp, g_ent = (t.to("cuda:1") for t in _problem())
    got = run(hidden, weight, bias, labels, g_logp, g_ent)
    ref = float64_math(hidden.cpu(), weight.cpu(), bias.cpu(), labels.cpu(), 1.0, g_logp.cpu(), g_ent.cpu())
    assert all(t.device == torch.device("cuda:1") for t in got)
    assert rel_err(got[0].cpu(), ref[0]) < RTOL and rel_err(got[2].cpu(), ref[2]) < RTOL


@pytest.mark.gpu
def test_gpu_bf16_tensor_cores_against_float64_and_no_sync():
    """The bf16 tensor-core path (never executed by the interpreter) against float64; bitwise repeatable;
    no host synchronisation (``torch.cuda.set_sync_debug_mode('error')``)."""
    torch.manual_seed(0)
    N, H, V = 1000, 512, 5003
    hidden = torch.randn(N, H, device="cuda").bfloat16()
    weight = (torch.randn(V, H, device="cuda") * 0.05).bfloat16()
    labels = torch.randint(0, V, (N,), device="cuda")
    g_logp, g_ent = torch.randn(N, device="cuda"), torch.randn(N, device="cuda") * 0.1
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = run(hidden, weight, None, labels, g_logp, g_ent)
        second = run(hidden, weight, None, labels, g_logp, g_ent)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(first[:4], second[:4]):
        assert torch.equal(a, b)
    ref = float64_math(hidden, weight, None, labels, 1.0, g_logp, g_ent)
    assert rel_err(first[0], ref[0]) < 1e-4 and rel_err(first[1], ref[1]) < 1e-4
    assert rel_err(first[2], ref[2]) < GRAD_RTOL[torch.bfloat16]
    assert rel_err(first[3], ref[3]) < GRAD_RTOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    """Forward + backward captured in a CUDA graph (possible only without host synchronisation) replay the
    same bits as an eager run."""
    hidden, weight, bias, labels, g_logp, g_ent = (t.cuda() for t in _problem(N=300, H=64, V=1000))
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    g_logp[::3] = 0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile the kernels outside the capture
            run(hidden, weight, bias, labels, g_logp, g_ent)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(hidden, weight, bias, labels, g_logp, g_ent)
    graph.replay()
    torch.cuda.synchronize()
    eager = run(hidden, weight, bias, labels, g_logp, g_ent)
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
