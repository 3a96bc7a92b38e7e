"""``gspo-kernels bench``'s compiled rows: each ``<impl>-compiled`` is ``<impl>``'s step under ``torch.compile``."""

from __future__ import annotations

import pytest
import torch

from gspo_kernels import available_backends
from gspo_kernels.tools import bench, bench_compiled

TINY = {
    "linear": dict(path="linear", B=2, T=8, H=16, V=64, dtype="fp32", inactive=0.0),
    "logits": dict(path="logits", B=2, T=8, V=64, dtype="fp32", inactive=0.0),
}
IMPLS = [i for i in ("gspo-cpu", "gspo-torch", "plain-torch") if not i.startswith("gspo-")
         or i.split("-")[1] in available_backends("cpu")]


def test_every_path_lists_its_compiled_rows_after_the_eager_ones():
    for path, names in bench.IMPLS.items():
        compiled = [n for n in names if n.endswith("-compiled")]
        assert compiled == [n + "-compiled" for n in bench_compiled.COMPILED[path]], path
        assert all(n[: -len("-compiled")] in names for n in compiled), "each compiled row has its eager row"
        assert names.index(compiled[0]) > max(names.index(n[: -len("-compiled")]) for n in compiled)


@pytest.mark.parametrize("path", ["linear", "logits"])
@pytest.mark.parametrize("impl", IMPLS)
def test_compiled_row_runs_its_eager_step_through_dynamo(path, impl, monkeypatch):
    """The compiled step traces the implementation's own step (ours: the library's operator in the graph; plain
    PyTorch: log_softmax) in one graph, and gives its eager loss and gradients to fp32 rounding."""
    graphs = []

    def record(gm, example_inputs):  # a Dynamo backend that keeps the traced graph and runs it as traced
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(bench_compiled, "COMPILE_BACKEND", record)
    case = TINY[path]
    results = []
    torch._dynamo.reset()
    for name in (impl, impl + "-compiled"):
        step, leaves = bench.build_impl(name, case, bench.make_inputs(case, torch.device("cpu")))
        loss = step()
        loss.backward()
        results.append([loss.detach()] + [leaf.grad.clone() for leaf in leaves])
    torch._dynamo.reset()
    assert len(graphs) == 1
    targets = " ".join(str(node.target) for node in graphs[0].graph.nodes
                       if node.op in ("call_function", "call_method"))
    if impl == "gspo-cpu":
        assert "gspo_kernels." in targets, targets  # the C++ kernels' torch.library operators
    elif impl == "plain-torch":
        assert "log_softmax" in targets and "gspo_kernels." not in targets, targets
    else:
        assert "log_softmax" not in targets and "gspo_kernels." not in targets, targets
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_unknown_compiled_name_is_refused_naming_it():
    case = TINY["logits"]
    with pytest.raises(ValueError, match="'trl-selective-compiled' is not a compiled implementation of the logits"):
        bench.build_impl("trl-selective-compiled", case, bench.make_inputs(case, torch.device("cpu")))


def test_compiled_table_sets_each_row_beside_its_eager_one_and_plain_compiled(capsys):
    def row(impl, total, status="ok"):
        return dict(case="logits", impl=impl, status=status, total_ms=total)

    results = [row("gspo-cpu", 30.0), row("plain-torch", 60.0), row("gspo-cpu-compiled", 24.0),
               row("plain-torch-compiled", 40.0), row("gspo-torch-compiled", 0.0, status="error")]
    ratios = {r["impl"]: r for r in bench_compiled.compiled_ratios(results)}
    assert sorted(ratios) == ["gspo-cpu-compiled", "plain-torch-compiled"]  # the row that failed is left out
    assert ratios["gspo-cpu-compiled"]["compiled_over_eager"] == pytest.approx(0.8)
    assert ratios["gspo-cpu-compiled"]["over_plain_compiled"] == pytest.approx(0.6)
    assert ratios["gspo-cpu-compiled"]["eager_over_plain_compiled"] == pytest.approx(0.75)
    assert ratios["plain-torch-compiled"]["compiled_over_eager"] == pytest.approx(40 / 60)
    bench_compiled.print_compiled(results)
    out = capsys.readouterr().out
    assert "gspo-cpu-compiled" in out and " 0.80 " in out and " 0.60 " in out
