"""Every public function compiles whole: ``torch.compile(f, fullgraph=True)`` of a function calling it, forward
and backward, on every backend, gives the eager results.

The broad matrix compiles with ``backend="aot_eager"``: Dynamo and AOTAutograd trace the functions through the
operators' fake implementations and autograd formulas exactly as inductor does, without its C++ code generation
(tens of seconds per graph on 2 cores); a few cases run inductor itself. Tolerances: bitwise where the compiled
graph runs the eager kernels on the same rows (``cpu``, the Triton operators); fp32 rounding where compiling
changes the arithmetic's order (the ``torch`` backend's masked full-size rows under tracing; inductor's fusion).
"""

from __future__ import annotations

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.backends import BACKENDS as ALL_BACKENDS
from gspo_kernels.options import CallOptions
from tests.compile import cases
from tests.support import device_for

BACKENDS = [b for b in ALL_BACKENDS if b in gk.available_backends(device_for(b))]

# (backend, case name) pairs that do not compile yet; strict: each starts failing the test once it compiles.
NOT_YET: set = set()

# Where eager and compiled run the same kernels on the same rows: the same bits.
BITWISE = {"cpu"}


def _compare(eager, compiled, backend: str) -> None:
    for e, c in zip(eager, compiled):
        if backend in BITWISE:
            assert torch.equal(e, c), (e, c)
        else:  # fp32 rounding of a differently ordered sum
            torch.testing.assert_close(c, e, rtol=2e-6, atol=2e-6)


def _marks(backend: str, name: str):
    if (backend, name) in NOT_YET:
        return [pytest.mark.xfail(strict=True, reason="does not compile with fullgraph=True yet")]
    return []


MATRIX = [pytest.param(b, c, id=f"{b}-{c.name}", marks=_marks(b, c.name)) for b in BACKENDS for c in cases.CASES]
MATRIX += [pytest.param(b, c, id=f"{b}-{c.name}", marks=_marks(b, c.name))
           for b in BACKENDS if b in cases.INVARIANT_BACKENDS for c in cases.INVARIANT_CASES]


@pytest.mark.parametrize("backend, case", MATRIX)
def test_public_call_compiles_whole_and_matches_eager(backend, case):
    """``fullgraph=True``: a graph break anywhere (a data-dependent shape, an untraceable launch) is an error."""
    t = cases.draw(device_for(backend))
    torch._dynamo.reset()
    eager = cases.run(case, t, backend)
    compiled = cases.run(case, t, backend, torch.compile(case.call, fullgraph=True, backend="aot_eager"))
    _compare(eager, compiled, backend)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in cases.INVARIANT_BACKENDS])
def test_batch_invariant_compiled_rows_are_the_same_bits_alone_and_in_the_batch(backend):
    """``batch_invariant=True`` compiled (``fullgraph=True``; a batch of N, then single rows, the graph made
    dynamic on the way): a row's log-prob, entropy and ``dH`` row are the same bits computed alone as among the
    batch's rows."""
    t = cases.draw(device_for(backend))
    hidden, labels = t["hidden"].reshape(-1, cases.H), t["labels"].reshape(-1)

    def rows(hidden, weight, labels):
        return gk.linear_logprobs(hidden, weight, labels, return_entropy=True, temperature=0.8, backend=backend,
                                  batch_invariant=True)

    torch._dynamo.reset()
    compiled = torch.compile(rows, fullgraph=True, backend="aot_eager")

    def run(h, y):
        h = h.clone().requires_grad_()
        logp, entropy = compiled(h, t["weight"], y)
        (dh,) = torch.autograd.grad(logp.sum() + 0.3 * entropy.sum(), h)
        return logp.detach(), entropy.detach(), dh

    batch = run(hidden, labels)
    for k in (0, 7):
        alone = run(hidden[k:k + 1], labels[k:k + 1])
        for b, a in zip(batch, alone):
            assert torch.equal(b[k:k + 1], a), (k, b[k], a)


@pytest.mark.parametrize("entropy", [False, True])
def test_torch_backend_full_size_rows_under_tracing_equal_the_selected_rows(monkeypatch, entropy):
    """The ``torch`` backend's CPU route without a host read (its form under ``torch.compile``): every row computed,
    the unselected ones masked. The selected rows' log-probs and every gradient equal eager's row selection, and
    garbage (NaN, inf) in the masked rows' hidden states reaches no output and no gradient."""
    from gspo_kernels.backends.torch import linear as torch_linear

    t = cases.draw("cpu")
    t["hidden"][1, 3] = float("nan")
    t["hidden"][0, 2] = float("inf")
    mask = t["mask"].clone()
    mask[1, 3] = mask[0, 2] = 0.0
    t["mask"] = mask
    config = gk.GSPOConfig(entropy_coef=0.01 if entropy else 0.0)

    def call(t, backend, hidden, weight, bias):
        return gk.fused_linear_gspo_loss(hidden, weight, t["labels"], t["adv"], t["old"], bias=bias, mask=t["mask"],
                                         config=config, backend=backend).loss

    def per_token(t):  # the backend's own outputs: 0 at the rows not selected
        return torch_linear.linear_logprobs(t["hidden"].reshape(-1, cases.H), t["weight"], t["bias"],
                                            t["labels"].reshape(-1), mask.reshape(-1) > 0,
                                            CallOptions(return_entropy=True))

    case = cases.Case("masked", ("hidden", "weight", "bias"), call)
    selected = cases.run(case, t, "torch")
    with torch.no_grad():
        rows_selected = per_token(t)
    monkeypatch.setattr(torch_linear, "host_reads_allowed", lambda: False)
    full_size = cases.run(case, t, "torch")
    with torch.no_grad():
        rows_full = per_token(t)
    for s, f in zip(rows_selected, rows_full):
        assert torch.equal(f[mask.reshape(-1) == 0], torch.zeros(int((mask == 0).sum())))
        torch.testing.assert_close(f, s, rtol=2e-6, atol=2e-6)
    for s, f in zip(selected, full_size):
        assert torch.isfinite(f).all()
        torch.testing.assert_close(f, s, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_under_compile_gets_the_eager_errors(backend):
    """A structure error (shapes, options) is raised while tracing: the eager ``ValueError`` itself by default,
    and under ``fullgraph=True`` Dynamo's error (it allows no exception out of the graph) naming that
    ``ValueError`` and its text; a value error (labels out of range, a bad mask) is a ``RuntimeError``
    with the rule's text from the graph's assert, where eager raises ``ValueError`` with the same rule."""
    t = cases.draw(device_for(backend))

    def loss(hidden, weight, labels, adv, mask):
        return gk.fused_linear_gspo_loss(hidden, weight, labels, adv, mask=mask, backend=backend).loss

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    good = (t["hidden"], t["weight"], t["labels"], t["adv"], t["mask"])
    torch.testing.assert_close(compiled(*good), loss(*good), rtol=2e-6, atol=2e-6)
    bad_shape = (t["hidden"], t["weight"][:, :-1], t["labels"], t["adv"], t["mask"])
    with pytest.raises(RuntimeError, match=r"ValueError.*weight must be \[V, H\]"):  # Dynamo's, naming it
        compiled(*bad_shape)
    torch._dynamo.reset()  # (the compiled frames are cached per code object, whatever the wrapper's options)
    for fn in (loss, torch.compile(loss, backend="aot_eager")):  # the default, fullgraph=False: the ValueError itself
        with pytest.raises(ValueError, match=r"weight must be \[V, H\]"):
            fn(*bad_shape)
    torch._dynamo.reset()
    bad_labels = t["labels"].clone()
    bad_labels[0, 0] = cases.V
    with pytest.raises(ValueError, match="labels must lie in"):
        loss(t["hidden"], t["weight"], bad_labels, t["adv"], t["mask"])
    with pytest.raises(RuntimeError, match="labels must lie in"):
        compiled(t["hidden"], t["weight"], bad_labels, t["adv"], t["mask"])
    bad_mask = t["mask"].clone()
    bad_mask[1, 1] = 0.5
    with pytest.raises(RuntimeError, match="mask must hold only 0 and 1"):
        compiled(t["hidden"], t["weight"], t["labels"], t["adv"], bad_mask)


SPECIALIZES = pytest.mark.xfail(strict=True, reason="the torch backend's CPU route loops over row blocks in "
                                 "Python (range over N): each new N compiles again")


@pytest.mark.parametrize("backend", [pytest.param(b, marks=[SPECIALIZES] if b == "torch" else []) for b in BACKENDS])
def test_dynamic_shapes_compile_once_for_every_sequence_length(backend):
    """``dynamic=True``: steps of new lengths ``T`` and batch sizes reuse the one graph (no size is specialized:
    neither a cache keyed by the sizes nor a float option turned symbolic breaks or guards it), each step equal to
    eager."""
    from torch._dynamo.utils import counters

    device = device_for(backend)
    weight = torch.randn(cases.V, cases.H, device=device) * 0.3

    def step(hidden, labels, adv, mask):
        return gk.fused_linear_gspo_loss(hidden, weight, labels, adv, mask=mask, config=cases.SOFTCAP,
                                         backend=backend).loss

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, dynamic=True, fullgraph=True, backend="aot_eager")
    for B, T in ((2, 5), (3, 9), (2, 4)):
        args = (torch.randn(B, T, cases.H, device=device), torch.randint(0, cases.V, (B, T), device=device),
                torch.randn(B, device=device), (torch.rand(B, T, device=device) > 0.2).float())
        torch.testing.assert_close(compiled(*args), step(*args), rtol=2e-6, atol=2e-6)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


FIRST_USE = """
import torch
import gspo_kernels as gk
from torch._dynamo.utils import counters
gk.available_backends("cpu")  # loaded before compiling, as documented; no loss computed yet in this process
def step(logits, labels, adv, old):
    return gk.gspo_loss(logits, labels, adv, old, backend="torch").loss  # no config: the defaults
compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
for seed in range(3):
    g = torch.Generator().manual_seed(seed)
    compiled(torch.randn(2, 5, 11, generator=g), torch.randint(0, 11, (2, 5), generator=g),
             torch.randn(2, generator=g), -2.4 + 0.1 * torch.randn(2, 5, generator=g))
print("graphs", counters["stats"]["unique_graphs"])
"""


def test_first_call_in_a_process_compiled_leaves_no_guard_that_recompiles():
    """A process whose first loss call is compiled (the defaults' config included, nothing built lazily under
    tracing) compiles once for calls of one shape: state created at the first call would leave a guard on it that
    fails at the second call (one more compilation of the step)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", FIRST_USE], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["graphs", "1"], proc.stdout
