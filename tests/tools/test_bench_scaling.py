"""``gspo-kernels bench --scaling``: one record per implementation and point, the points over the memory cap recorded
as out of memory (estimated before running, or an allocation that failed while running), and ``--out`` prefixes."""

from __future__ import annotations

import json

from gspo_kernels.tools import bench, bench_scaling, cli

TINY = "tokens=64,128;vocab=256,512;hidden=16"  # two points per series, one shared: (64, 256), (128, 256), (64, 512)
KEYS = {"impl", "path", "tokens", "vocab", "hidden", "ms", "peak_mb", "status", "reason"}


def test_scaling_writes_one_record_per_implementation_and_point(tmp_path, capsys):
    out = tmp_path / "s.json"  # a prefix ending in .json gets no second .json
    rc = cli.main(["bench", "--scaling", "--device", "cpu", "--impls", "plain-torch", "--series", TINY,
                   "--repeats", "1", "--out", str(out)])
    assert rc == 0
    assert out.exists() and not (tmp_path / "s.json.json").exists()
    payload = json.loads(out.read_text())
    records = payload["records"]
    points = {(64, 256), (128, 256), (64, 512)}
    assert {(r["path"], r["tokens"], r["vocab"]) for r in records} == {(p, *pt) for p in ("linear", "logits")
                                                                       for pt in points}
    assert len(records) == 6
    for r in records:
        assert KEYS <= set(r), r
        assert r["impl"] == "plain-torch" and r["status"] == "ok" and r["reason"] is None, r
        assert r["ms"] > 0 and r["peak_mb"] is not None and r["peak_mb"] >= 0, r
        assert r["hidden"] == (16 if r["path"] == "linear" else None), r
    shared = next(r for r in records if (r["tokens"], r["vocab"]) == (64, 256))
    assert shared["series"] == ["tokens", "vocab"]
    assert payload["environment"]["device"] == "cpu" and payload["environment"]["versions"]["torch"]
    if payload["chart_skipped"] is None:
        assert (tmp_path / "s.png").stat().st_size > 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(lines) == 6 and all("\r" not in line for line in lines)  # a plain progress line per point


def test_a_point_estimated_over_the_memory_cap_is_oom_and_not_run(tmp_path, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a point estimated over the cap ran")

    monkeypatch.setattr(bench, "run_one", must_not_run)
    out = tmp_path / "cap"
    rc = cli.main(["bench", "--scaling", "--device", "cpu", "--impls", "plain-torch", "--cases", "logits",
                   "--series", TINY, "--memory-cap", "0.01", "--out", str(out)])
    assert rc == 0
    records = json.loads((tmp_path / "cap.json").read_text())["records"]
    assert len(records) == 3 and {r["path"] for r in records} == {"logits"}
    for r in records:
        assert r["status"] == "oom" and "cap of 0.01 GiB" in r["reason"] and r["ms"] is None, r
        assert r["estimate_mb"] > 0.01 * 1024, r


def test_an_allocation_past_the_cap_while_running_is_recorded_as_oom():
    """Estimates off: the worker runs under the cap (its data size limit) and its 128 MiB of logits cannot be made."""
    plan = bench_scaling.PLANS[("cpu", True)]
    point = bench_scaling.ScalingPoint(impl="plain-torch", path="logits", tokens=1024, vocab=32768)
    rec = bench_scaling.run_point(point, plan, "cpu", cap=32 * 2**20, predict=False, slack=0)
    assert rec["status"] == "oom", rec
    assert "out of memory while running" in rec["reason"] and "allocate" in rec["reason"], rec


def test_the_estimate_grows_with_tokens_and_vocabulary_and_orders_the_implementations():
    est = bench_scaling.estimate_bytes
    for impl in ("plain-torch", "gspo-cpu", "trl-chunked"):
        assert est(impl, "linear", 2048, 32768, 256, "fp32") > est(impl, "linear", 1024, 32768, 256, "fp32")
        assert est(impl, "linear", 1024, 65536, 256, "fp32") > est(impl, "linear", 1024, 32768, 256, "fp32")
    nv = 4 * 4096 * 32768
    assert est("plain-torch", "linear", 4096, 32768, 256, "fp32") > 3 * nv  # three fp32 [N, V] buffers at least
    assert est("gspo-cpu-recompute", "linear", 4096, 32768, 256, "fp32") < nv
    # the logits themselves and no [N, V] gradient
    assert est("gspo-cpu-inplace", "logits", 4096, 32768, 0, "fp32") < 1.2 * nv + bench_scaling.FIXED_BYTES


def test_bench_out_ending_in_json_gets_no_second_suffix(tmp_path):
    assert bench.output_prefix("results/b.json") == "results/b"
    assert bench.output_prefix("results/b.png") == "results/b"
    assert bench.output_prefix("results/b") == "results/b"
    assert bench.output_prefix("results/v1.5") == "results/v1.5"
    rc = cli.main(["bench", "--quick", "--device", "cpu", "--cases", "logits", "--impls", "gspo-torch", "--repeats",
                   "1", "--out", str(tmp_path / "b.json")])
    assert rc == 0
    assert (tmp_path / "b.json").exists() and not (tmp_path / "b.json.json").exists()
