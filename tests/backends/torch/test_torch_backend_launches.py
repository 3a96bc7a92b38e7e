"""backend="torch" on an accelerator: ops dispatched and host reads per call (counted, not timed).

On CUDA every host read (``nonzero``, ``.item()``, a boolean-mask index, ``.tolist()``) stalls the GPU until
the CPU has issued the next launches, and ``index_put_(accumulate=True)`` sorts its indices. The accelerator
route of the torch backend (forced here on CPU tensors through ``_accelerated``) reads each row selection
once per call (``_to_host``) and otherwise dispatches none of these ops, whatever the number of chunks;
the number of ops grows with the chunks only, and the chunks follow a byte budget.

Counting: a ``TorchDispatchMode`` records every aten op the backend's forward and backward dispatch. The
host-side planning (``_row_plan``: a cumulative sum and ``nonzero`` of the host copy of the mask) runs on
the CPU copy that ``_to_host`` returned, so it is excluded from the count and ``_to_host``'s calls are
counted as the host reads.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gspo_kernels as gk
from gspo_kernels import reference
from gspo_kernels.backends import DEFAULT_MEMORY_BUDGET
from gspo_kernels.backends.torch import linear as torch_linear
from gspo_kernels.backends.torch import logits as torch_logits
from gspo_kernels.backends.torch import rows as torch_rows
from gspo_kernels.options import CallOptions

# ops that wait for the device on CUDA (or sort there): none may run per chunk
SYNCING = {"nonzero", "_local_scalar_dense", "item", "is_nonzero", "equal", "masked_select", "sort", "unique",
           "_unique2", "nonzero_static", "_assert_async"}


_ORIGINAL = dict(to_host=torch_rows._to_host, row_plan=torch_logits._row_plan,
                 forward=torch_logits._LogitsLogprobs.forward, backward=torch_logits._LogitsLogprobs.backward)


def patch(monkeypatch, name, value):
    """``name = value`` in each module of the torch backend that binds it (a helper of ``rows.py`` is looked up
    in the module that calls it)."""
    for module in (torch_rows, torch_logits, torch_linear):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)


NOT_KERNELS = {"slice", "select", "view", "unsqueeze", "detach", "as_strided", "alias", "expand", "t", "split",
               "split_with_sizes", "scalar_tensor", "empty", "empty_like", "lift_fresh"}


def kernels(ops):
    """The ops that launch a kernel on a device (views and host scalars left out)."""
    return [op for op in ops if op not in NOT_KERNELS]


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            name = func.overloadpacket.__name__
            if name in ("index_put", "index_put_") and (kwargs.get("accumulate") or (len(args) > 3 and args[3])):
                name = "index_put_accumulate"  # sorts its indices on CUDA
            self.ops.append(name)
        return func(*args, **kwargs)


def count_call(monkeypatch, B=16, T=1024, V=64, rows_per_chunk=589, clipped=(), masked_tail=0,
               dtype=torch.bfloat16):
    """Forward + backward of ``gspo_loss`` on ``logits[:, :-1]`` of ``[B, T + 1, V]`` through the accelerator
    route, chunks of ``rows_per_chunk`` rows. Returns ``(ops, host_reads, chunks, grad)``: the aten ops the
    torch backend dispatched, ``_to_host`` calls, the forward's number of chunks, the logits' gradient."""
    patch(monkeypatch, "_accelerated", lambda device: True)
    tiles = 3  # 2 scratch blocks + the active mask's block (no temperature, no cap)
    patch(monkeypatch, "ACCELERATOR_BUDGET", rows_per_chunk * tiles * V * 4)
    counter = _Counter()
    reads, chunks = [], []
    to_host, row_plan = _ORIGINAL["to_host"], _ORIGINAL["row_plan"]

    def counted_to_host(mask):
        reads.append(mask.numel())
        return to_host(mask)

    def paused_row_plan(blocks, mask, device):
        counter.paused += 1
        try:
            plan = row_plan(blocks, mask, device)
        finally:
            counter.paused -= 1
        chunks.append(len(plan))
        return plan

    patch(monkeypatch, "_to_host", counted_to_host)
    patch(monkeypatch, "_row_plan", paused_row_plan)
    fwd, bwd = _ORIGINAL["forward"], _ORIGINAL["backward"]

    def counted(fn):
        def run(*args):
            with counter:
                return fn(*args)
        return run

    monkeypatch.setattr(torch_logits._LogitsLogprobs, "forward", staticmethod(counted(fwd)))
    monkeypatch.setattr(torch_logits._LogitsLogprobs, "backward", staticmethod(counted(bwd)))
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(B, T + 1, V, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen)
    adv = torch.ones(B)
    adv[list(clipped)] = 0.0  # zero advantage: no gradient for these responses
    mask = torch.ones(B, T)
    if masked_tail:
        mask[:, T - masked_tail:] = 0
    out = gk.gspo_loss(full[:, :-1], labels, adv, mask=mask, backend="torch")
    out.loss.backward()
    return counter.ops, len(reads), chunks[0], full.grad


def test_no_host_read_or_sort_per_chunk(monkeypatch):
    ops, reads, chunks, _ = count_call(monkeypatch, B=4, T=64, rows_per_chunk=24, clipped=(1,), masked_tail=5)
    assert chunks == 4 * 3  # [:, :-1] is walked per response: 64 rows in 3 balanced chunks each
    assert reads <= 2, "one host read per selection (the forward's active rows, the backward's rows with gradient)"
    syncing = sorted({op for op in ops if op in SYNCING or op == "index_put_accumulate"})
    assert syncing == [], f"ops that wait for the device or sort, per chunk: {syncing}"


def test_ops_grow_with_chunks_only(monkeypatch):
    """Kernels per chunk are a small constant: 4x the chunks adds at most 18 kernel ops (ops other than views
    and host scalars) per added chunk, forward and backward together (it was ~50 with the per-chunk selection).
    Two of the 18 are the bf16 -> fp32 conversions into scratch that CPU tensors need (no softmax kernel reads
    half rows there; on CUDA, where one does, they are not made)."""
    small, _, c_small, _ = count_call(monkeypatch, B=4, T=64, rows_per_chunk=64)
    large, _, c_large, _ = count_call(monkeypatch, B=4, T=64, rows_per_chunk=16)
    assert (c_small, c_large) == (4, 16)
    per_chunk = (len(kernels(large)) - len(kernels(small))) / (c_large - c_small)
    assert 0 < per_chunk <= 18, per_chunk


def test_gpu_shape_takes_few_chunks():
    """At the measured GPU shape (bf16 logits [16, 1025, 151936] through [:, :-1], fp32 scratch, an active
    mask: 3 blocks) the default budget gives 2 chunks per response, 32 in all (the CPU route's 55-row blocks
    gave 304)."""
    rows = torch_logits._logits_block_rows(151936, torch.device("cuda"), 3, 4)
    assert rows == DEFAULT_MEMORY_BUDGET // (3 * 151936 * 4)
    assert 16 * -(-1024 // rows) == 32
    assert torch_logits._logits_block_rows(151936, torch.device("cpu"), 3, 4) == 55


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accelerator_route_matches_cpu_route(monkeypatch, dtype):
    """The accelerator route (budget chunks, one host read, entr) gives the CPU route's gradient."""
    B, T, V = 4, 32, 50
    _, _, _, got = count_call(monkeypatch, B=B, T=T, V=V, rows_per_chunk=12, clipped=(2,), masked_tail=3,
                              dtype=dtype)
    monkeypatch.undo()
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(B, T + 1, V, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen)
    adv = torch.ones(B)
    adv[2] = 0.0
    mask = torch.ones(B, T)
    mask[:, T - 3:] = 0
    gk.gspo_loss(full[:, :-1], labels, adv, mask=mask, backend="torch").loss.backward()
    want = full.grad
    assert torch.all(got[2] == 0) and torch.all(got[:, T - 3:] == 0)
    tol = 1e-6 if dtype == torch.float32 else 2.0 ** -8  # bf16: the CPU route rounds once, the direct route twice
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))


def _hidden_case(B=4, T=24, H=16, V=40, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(B, T, H, generator=gen) * 0.7).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * H**-0.5 * 2).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=gen)
    return hidden, weight, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, 3.0)])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_hidden_accelerator_route_matches_float64(monkeypatch, dtype, temperature, softcap, entropy_grad):
    """The accelerator route of the hidden-state path (budget chunks, one GEMM per chunk, dZ cast once, dW in an
    fp32 accumulator; forced here on CPU tensors, where the half GEMMs fall back to upcast operands) against the
    float64 reference: log-probs, entropies and the gradients of a loss of the log-probs alone (the entropy's
    gradient None) or of both, with masked rows compacted and NaN hidden states in them (which must not reach dW)."""
    patch(monkeypatch, "_accelerated", lambda device: True)
    hidden, weight, labels = _hidden_case(dtype=dtype)
    B, T, H = hidden.shape
    V = weight.shape[0]
    active = torch.ones(B, T, dtype=torch.bool)
    active[:, -5:] = False
    hidden[:, -5:] = float("nan")  # padding: never read into a result or a gradient
    gw = torch.randn(B, T, generator=torch.Generator().manual_seed(1)) * active
    gw[1] = 0.0  # a response without gradient
    ge = torch.randn(B, T, generator=torch.Generator().manual_seed(2)) * active * 0.3
    ge[1] = 0.0
    ge = ge if entropy_grad else torch.zeros_like(ge)
    budget = 7 * V * 4 * 2  # 7 rows per chunk in the forward (2 fp32 tiles): several chunks
    kw = dict(temperature=temperature, return_entropy=True, memory_budget=budget)
    if softcap is not None:
        kw["softcap"] = softcap
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = torch_linear.linear_logprobs(h, w, None, labels.reshape(-1), active=active.reshape(-1),
                                           options=CallOptions(**kw))
    ((lp * gw.reshape(-1)).sum() + ((ent * ge.reshape(-1)).sum() if entropy_grad else 0)).backward()
    hd = torch.where(active[..., None], hidden.double(), 0.0).requires_grad_()
    wd = weight.double().requires_grad_()
    rl, re = reference.token_logprobs(_ref_logits(hd, wd, softcap), labels.reshape(-1), temperature=temperature,
                                      return_entropy=True)
    ((rl * gw.reshape(-1).double()).sum() + (re * ge.reshape(-1).double()).sum()).backward()
    a = active.reshape(-1)
    assert torch.all(lp[~a] == 0) and torch.all(ent[~a] == 0)
    torch.testing.assert_close(lp[a].double(), rl[a], rtol=1e-5, atol=1e-5 * float(rl.abs().max()))
    torch.testing.assert_close(ent[a].double(), re[a], rtol=1e-5, atol=1e-5 * float(re.abs().max()))
    # fp32: fp32 sums; bf16: dZ rounded once to bf16 (2^-9), the gradients rounded once when stored (2^-9)
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    assert torch.isfinite(w.grad).all() and torch.all(h.grad[:, -5:] == 0) and torch.all(h.grad[1] == 0)
    for got, want in ((h.grad, hd.grad), (w.grad, wd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


def _ref_logits(h, w, softcap):
    z = h.reshape(-1, h.shape[-1]) @ w.T
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def test_hidden_accelerator_route_host_reads_and_ops(monkeypatch):
    """One host read per call (the forward's active rows), none in the backward; no op that waits for the device or
    sorts in either; the chunks follow the budget (forward: 2 fp32 tiles per row; backward without an entropy
    gradient: the logits tile, holding dZ too, and p) and each chunk adds a constant number of kernels."""
    patch(monkeypatch, "_accelerated", lambda device: True)
    reads = []
    to_host = _ORIGINAL["to_host"]
    patch(monkeypatch, "_to_host", lambda mask: reads.append(1) or to_host(mask))
    hidden, weight, labels = _hidden_case(B=4, T=32, dtype=torch.bfloat16)
    V = weight.shape[0]
    active = torch.ones(4 * 32, dtype=torch.bool)
    active[-7:] = False

    current = []
    active_index = torch_linear._active_index

    def paused_active_index(mask, device):  # host-side work on the host copy: not counted (as _row_plan above)
        current[-1].paused += 1
        try:
            return active_index(mask, device)
        finally:
            current[-1].paused -= 1

    patch(monkeypatch, "_active_index", paused_active_index)

    def run(rows_per_chunk):
        fwd, bwd = _Counter(), _Counter()
        current.append(fwd)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with fwd:
            lp, _ = torch_linear.linear_logprobs(h, w, None, labels.reshape(-1), active=active, options=CallOptions(return_entropy=True, memory_budget=rows_per_chunk * V * 4 * 2))
        reads_fwd = len(reads)
        with bwd:
            lp.sum().backward()
        return fwd.ops, bwd.ops, reads_fwd, len(reads) - reads_fwd

    reads.clear()
    f_small, b_small, rf, rb = run(121)  # 121 active rows: one chunk
    assert (rf, rb) == (1, 0), "one host read in the forward, none in the backward"
    f_large, b_large, _, _ = run(11)  # 11 chunks
    for ops in (f_small, b_small, f_large, b_large):
        assert sorted({op for op in ops if op in SYNCING or op == "index_put_accumulate"}) == []
    adds = ("addmm", "addmm_")  # addmm(out_dtype=, out=) on CUDA, addmm_ of upcast operands here
    assert b_small.count("mm") == 3 and sum(b_small.count(a) for a in adds) == 0  # logits, dH, dW written
    assert sum(b_large.count(a) for a in adds) == 10  # dW: written by the first chunk, added to by the 10 others
    per_chunk = (len(kernels(f_large + b_large)) - len(kernels(f_small + b_small))) / 10
    assert 0 < per_chunk <= 28, per_chunk  # ~26 here, 4 of them upcasts that CUDA (out_dtype GEMMs) does not make



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_direct_half_backward_matches_float64(monkeypatch, dtype):
    """The accelerator route's backward for half rows without a kernel that reads them into fp32 (CPU tensors here,
    bf16 on CUDA where PyTorch has none): a softmax in the rows' dtype written into the gradient, one multiply, the
    label's entry from the forward's fp32 log-prob. Against float64: each entry within two roundings of the
    dtype (p, then the product), the label's entries within one, also where the label is nearly certain and
    ``p_y - 1`` formed from a rounded ``p_y`` would be far off; rows without gradient exactly 0."""
    patch(monkeypatch, "_accelerated", lambda device: True)
    patch(monkeypatch, "ACCELERATOR_BUDGET", 5 * 3 * 64 * 4)  # 5 rows per chunk: several chunks
    direct = []
    original = torch_logits._rows_backward_direct
    patch(monkeypatch, "_rows_backward_direct", lambda *a: direct.append(a[0].shape[0]) or original(*a))
    B, T, V = 3, 12, 64
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(B, T + 1, V, generator=gen) * 2
    labels = torch.randint(0, V, (B, T), generator=gen)
    full[0, :T].scatter_(1, labels[0, :, None], 9.0)  # response 0: p_y about 0.99, 1 - p_y about 0.01
    full = full.to(dtype)
    active = torch.ones(B, T, dtype=torch.bool)
    active[2, -4:] = False
    g = torch.randn(B, T, generator=gen) * active
    g[1] = 0.0  # a response without gradient
    x = full.clone().requires_grad_()
    lp, _ = torch_logits.logits_logprobs(x[:, :-1], labels.reshape(-1), active=active.reshape(-1))
    (lp * g.reshape(-1)).sum().backward()
    assert sum(direct) == 2 * T - 4  # only the rows with gradient, all through the direct route
    xd = full.double().requires_grad_()
    rl = reference.token_logprobs(xd[:, :-1].reshape(-1, V), labels.reshape(-1))
    (rl * g.reshape(-1).double()).sum().backward()
    a = active.reshape(-1)
    torch.testing.assert_close(lp[a].double(), rl[a].detach(), rtol=1e-5, atol=1e-5)
    got, want = x.grad.double(), xd.grad
    assert torch.all(got[1] == 0) and torch.all(got[:, -1] == 0) and torch.all(got[2, T - 4 : T] == 0)
    u = 2.0 ** -(8 if dtype == torch.bfloat16 else 11)  # half the dtype's ulp at 1: one rounding, relative
    slack = 1e-5 * float(want.abs().max())  # the fp32 softmax's own error
    assert torch.all((got - want).abs() <= 2.02 * u * want.abs() + slack)  # two roundings
    rows = torch.arange(T)
    for b in (0, 2):
        at_label, ref_label = got[b, rows, labels[b]], want[b, rows, labels[b]]
        assert torch.all((at_label - ref_label).abs() <= 1.01 * u * ref_label.abs() + slack), (at_label, ref_label)


def test_tolerance_names_the_direct_routes_second_rounding(monkeypatch):
    """``testing.gradient_tolerance`` (what ``verify`` and the conformance tests use) allows the logits path two
    roundings exactly where the torch backend may take the direct half route (an accelerator, half rows, no softmax
    kernel that reads them into fp32), one everywhere else, and never more than 2^-6."""
    from gspo_kernels import testing

    one, two = (testing.FP32_RTOL + k * testing.UNIT_ROUNDOFF["bf16"] for k in (1, 2))
    assert testing.gradient_tolerance("bf16", "logits", backend="torch", device="cpu") == one
    assert testing.gradient_tolerance("bf16", "logits") == one
    patch(monkeypatch, "_accelerated", lambda device: True)
    assert testing.gradient_tolerance("bf16", "logits", backend="torch", device="cpu") == two <= 2.0**-6
    assert testing.gradient_tolerance("fp32", "logits", backend="torch", device="cpu") == testing.FP32_RTOL
    assert testing.gradient_tolerance("bf16", "logits", backend="triton", device="cpu") == one
    monkeypatch.setitem(torch_rows._half_softmax_ok, ("cpu", torch.bfloat16), True)  # a kernel that reads bf16
    assert testing.gradient_tolerance("bf16", "logits", backend="torch", device="cpu") == one


def test_direct_half_backward_has_no_host_read_per_chunk(monkeypatch):
    """The half-row backward (bf16 logits, CPU tensors) with 4x the chunks: the same host reads (one per selection),
    no op that waits for the device or sorts, and the same kernels per chunk as the route it replaces."""
    calls = []
    original = torch_logits._rows_backward_direct

    def spy(*args):
        calls.append(1)
        return original(*args)

    patch(monkeypatch, "_rows_backward_direct", spy)
    few, reads_few, chunks_few, _ = count_call(monkeypatch, B=4, T=64, rows_per_chunk=64, clipped=(1,))
    used = len(calls)
    many, reads_many, chunks_many, _ = count_call(monkeypatch, B=4, T=64, rows_per_chunk=16, clipped=(1,))
    assert (chunks_few, chunks_many) == (4, 16) and used == 3 and len(calls) - used == 12  # 3 responses with gradient
    assert reads_few == reads_many <= 2
    for ops in (few, many):
        assert sorted({op for op in ops if op in SYNCING or op == "index_put_accumulate"}) == []
    per_chunk = (len(kernels(many)) - len(kernels(few))) / (chunks_many - chunks_few)
    assert 0 < per_chunk <= 18, per_chunk


class _Fp32OutGemms(TorchDispatchMode):
    """CUDA's ``mm`` / ``addmm`` with ``out_dtype=float32`` from half operands, on CPU tensors: the operands converted
    exactly, the product in fp32 (as cuBLAS accumulates), written into ``out``. With it the accelerator route takes its
    CUDA GEMM calls here (``_Gemms.native``), where CPU tensors otherwise get upcast copies."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, overload = func.overloadpacket.__name__, func._overloadname
        if name in ("mm", "addmm") and overload in ("dtype", "dtype_out"):
            tensors = [a.float() for a in args if isinstance(a, torch.Tensor)]
            extra = {k: v for k, v in kwargs.items() if k in ("beta", "alpha")}
            res = torch.mm(*tensors) if name == "mm" else torch.addmm(*tensors, **extra)
            return kwargs["out"].copy_(res) if "out" in kwargs else res
        return func(*args, **kwargs)


@pytest.fixture
def fp32_out_gemms(monkeypatch):
    monkeypatch.setitem(torch_linear._mm_fp32_out_ok, ("cpu", torch.bfloat16), True)
    with _Fp32OutGemms():
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_hidden_kept_probabilities_match_float64(monkeypatch, fp32_out_gemms, dtype, entropy_grad):
    """The accelerator route keeps ``p`` of the active rows for the backward when it takes no more bytes than the
    fp32 ``dW`` accumulator (m rows <= 4H / itemsize: 76 rows at H = 96 here): the backward makes no logits GEMM,
    ``dH`` and ``dW`` one GEMM each. Against float64, with a bias, a temperature, masked rows (NaN hidden states
    in them), a response without gradient; with an entropy gradient the backward recomputes (it needs log p).
    Tolerances as the recomputing route's test; a second backward (retain_graph) gives the same gradients."""
    patch(monkeypatch, "_accelerated", lambda device: True)
    kept_used = []
    original = torch_linear._linear_backward_kept
    patch(monkeypatch, "_linear_backward_kept", lambda *a: kept_used.append(1) or original(*a))
    hidden, weight, labels = _hidden_case(H=96, dtype=dtype)
    B, T, H = hidden.shape
    V = weight.shape[0]
    bias = (torch.randn(V, generator=torch.Generator().manual_seed(4)) * 0.5).to(dtype)
    active = torch.ones(B, T, dtype=torch.bool)
    active[:, -5:] = False
    hidden[:, -5:] = float("nan")
    gw = torch.randn(B, T, generator=torch.Generator().manual_seed(1)) * active
    gw[1] = 0.0
    ge = torch.randn(B, T, generator=torch.Generator().manual_seed(2)) * active * 0.3 if entropy_grad else None
    if ge is not None:
        ge[1] = 0.0
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    lp, ent = torch_linear.linear_logprobs(h, w, b, labels.reshape(-1), active=active.reshape(-1), options=CallOptions(temperature=0.8, return_entropy=True, memory_budget=7 * V * 4 * 2))
    loss = (lp * gw.reshape(-1)).sum() + ((ent * ge.reshape(-1)).sum() if entropy_grad else 0)
    loss.backward(retain_graph=True)
    assert len(kept_used) == (0 if entropy_grad else 1)
    first = [t.grad.clone() for t in (h, w, b)]
    hd = torch.where(active[..., None], hidden.double(), 0.0).requires_grad_()
    wd, bd = weight.double().requires_grad_(), bias.double().requires_grad_()
    z = hd.reshape(-1, H) @ wd.T + bd
    rl, re = reference.token_logprobs(z, labels.reshape(-1), temperature=0.8, return_entropy=True)
    ((rl * gw.reshape(-1).double()).sum() + ((re * ge.reshape(-1).double()).sum() if entropy_grad else 0)).backward()
    a = active.reshape(-1)
    torch.testing.assert_close(lp[a].double(), rl[a], rtol=1e-5, atol=1e-5 * float(rl.abs().max()))
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    assert torch.all(h.grad[:, -5:] == 0) and torch.all(h.grad[1] == 0)
    for got, want in ((h.grad, hd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    for t in (h, w, b):
        t.grad = None
    loss.backward()  # the kept p was consumed: this one recomputes
    for t, want in zip((h, w, b), first):
        torch.testing.assert_close(t.grad.double(), want.double(), rtol=tol, atol=tol * float(want.abs().max()))


def test_hidden_kept_probabilities_backward_ops(monkeypatch, fp32_out_gemms):
    """With ``p`` kept: no host read and no softmax in the backward, two GEMMs (dH, dW) whatever the chunks, no
    fp32 ``dW`` accumulator (no addmm). Not kept (m > 4H / itemsize, or GEMMs that cannot write fp32 from bf16
    operands): the recomputing backward's three or more."""
    patch(monkeypatch, "_accelerated", lambda device: True)
    reads = []
    to_host = _ORIGINAL["to_host"]
    patch(monkeypatch, "_to_host", lambda mask: reads.append(1) or to_host(mask))

    def backward_ops(H, rows_per_chunk):
        hidden, weight, labels = _hidden_case(B=4, T=32, H=H, dtype=torch.bfloat16)
        V = weight.shape[0]
        h, w = hidden.requires_grad_(), weight.requires_grad_()
        lp, _ = torch_linear.linear_logprobs(h, w, None, labels.reshape(-1), options=CallOptions(return_entropy=True, memory_budget=rows_per_chunk * V * 4 * 2))
        counter = _Counter()
        n_reads = len(reads)
        with counter:
            lp.sum().backward()
        assert len(reads) == n_reads
        return counter.ops

    for rows in (128, 16):  # 1 and 8 chunks in the forward: 128 rows * 2 bytes <= 4 * 64
        ops = backward_ops(64, rows)
        assert ops.count("mm") == 2 and "addmm" not in ops and "addmm_" not in ops
        assert not [op for op in ops if "softmax" in op or op in SYNCING]
    ops = backward_ops(16, 16)  # 128 rows * 2 bytes > 4 * 16: recomputed, 8 chunks
    assert ops.count("mm") >= 3 and any("softmax" in op for op in ops)
    monkeypatch.setitem(torch_linear._mm_fp32_out_ok, ("cpu", torch.bfloat16), False)
    ops = backward_ops(64, 128)  # upcast operands: a kept p would need an fp32 copy of dZ, so none is kept
    assert ops.count("mm") >= 3 and any("softmax" in op for op in ops)


def test_hidden_keeps_nothing_without_a_graph(monkeypatch, fp32_out_gemms):
    """Under ``torch.no_grad()`` (an old-log-prob pass, weights requiring grad) nothing is kept: no ``[m, V]``
    buffer and no copy into it (``ctx.needs_input_grad`` says True there too)."""
    patch(monkeypatch, "_accelerated", lambda device: True)
    hidden, weight, labels = _hidden_case(B=2, T=16, H=64, dtype=torch.bfloat16)
    w = weight.requires_grad_()
    counter = _Counter()
    with torch.no_grad(), counter:
        torch_linear.linear_logprobs(hidden, w, None, labels.reshape(-1), options=CallOptions(return_entropy=True))
    with_graph = _Counter()
    with with_graph:
        torch_linear.linear_logprobs(hidden, w, None, labels.reshape(-1), options=CallOptions(return_entropy=True))
    assert with_graph.ops.count("copy_") == counter.ops.count("copy_") + 1  # p into the kept buffer, one chunk
