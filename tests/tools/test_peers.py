"""An optional peer the benchmarks compare against: imported when it is there, a skip naming it (never an error
that stops the run) when it is missing or fails at import, in ``bench`` and ``bench --gpu`` alike."""

from __future__ import annotations

import sys
import time

import pytest

from gspo_kernels.tools import bench
from gspo_kernels.tools.bench_gpu import measure
from gspo_kernels.tools.peers import Skip, peer


def _hide_trl(monkeypatch) -> None:
    """``import trl`` and every ``trl.*`` raise ImportError, even where another test imported them already."""
    for name in [n for n in sys.modules if n == "trl" or n.startswith("trl.")] + ["trl"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_an_installed_peer_is_imported():
    assert peer("json", "dumps") is __import__("json").dumps


def test_a_missing_peer_is_a_skip_naming_its_package(monkeypatch):
    _hide_trl(monkeypatch)  # import trl raises ImportError
    with pytest.raises(Skip, match=r"^trl not installed or not importable here: trl\.kernels\.ChunkedLogProbFunction"):
        peer("trl.kernels", "ChunkedLogProbFunction")
    with pytest.raises(Skip, match=r"^liger-kernel not installed .*ModuleNotFoundError"):  # the package's own name
        peer("no_such_module_here.chunked_loss", "LigerFusedLinearGRPOLoss", "liger-kernel")


def test_a_peer_failing_at_import_is_a_skip(tmp_path, monkeypatch):
    (tmp_path / "broken_peer_mod.py").write_text("raise RuntimeError('needs a GPU driver')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(Skip, match="RuntimeError: needs a GPU driver"):
        peer("broken_peer_mod", "f")


def test_bench_reports_a_missing_peer_as_skipped(monkeypatch):
    _hide_trl(monkeypatch)
    case = dict(path="logits", B=1, T=4, V=16, dtype="fp32", inactive=0.0)
    inputs = bench.make_inputs(case, "cpu")
    with pytest.raises(bench.Skip, match="^trl not installed"):
        bench.build_impl("trl-selective", case, inputs)


def test_bench_gpu_reports_a_missing_peer_as_skipped(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", None)
    ctx = measure._Ctx("cpu", tiny=True, deadline=time.time() + 60)
    row = measure._run_case(ctx, "hidden", "cce", lambda: dict(fn=peer("cut_cross_entropy", "linear_cross_entropy")),
                            peer="cce")
    assert row["status"] == "skipped" and "cut_cross_entropy not installed" in row["reason"], row
