"""``gspo-kernels gpu-check`` on a machine without a GPU: what can be checked here.

The GPU steps themselves (GPU tests, memcheck, benchmarks) never ran in this project's development
environment; these tests pin the command's parsing, its no-GPU behaviour, the report it writes (with a
fake list of steps), and that the memcheck workload runs (in the Triton interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest
import torch

from gspo_kernels.tools import cli, gpu_check
from gspo_kernels.tools.gpu_check import Step, StepResult


def _parse(argv):
    parser = argparse.ArgumentParser()
    gpu_check.add_arguments(parser)
    return parser.parse_args(argv)


def test_arguments():
    args = _parse([])
    assert args.out == "results" and not args.static_only and args.budget_s is None and not args.quick
    assert gpu_check.DEFAULT_BUDGET_S == 1200 and gpu_check.QUICK_BUDGET_S == 240
    assert gpu_check.parse_steps(args.steps) == list(gpu_check.ALL_STEPS)
    args = _parse(["--out", "x", "--steps", "versions,memcheck", "--static-only", "--budget-s", "60"])
    assert gpu_check.parse_steps(args.steps) == ["versions", "memcheck"] and args.static_only
    with pytest.raises(ValueError, match="--steps"):
        gpu_check.parse_steps("versions,benchmark")  # a misspelt step is an error, not silently dropped
    assert "gpu-check" in cli.SUBCOMMANDS


def test_quick_time_in_the_help_is_the_one_the_docs_state():
    """``gpu-check --help`` and every README / docs line that times ``--quick`` say the same measured time."""
    from pathlib import Path

    parser = argparse.ArgumentParser()
    gpu_check.add_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    assert f"--quick {gpu_check.QUICK_TIME}" in help_text
    root = Path(__file__).resolve().parents[2]
    timed = [line for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
             for line in path.read_text().splitlines() if "gpu-check --quick" in line and "minute" in line]
    assert timed, "no README / docs line times gpu-check --quick"
    for line in timed:
        assert gpu_check.QUICK_TIME in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")
def test_without_cuda_it_says_so_and_exits_nonzero(tmp_path, capsys):
    status = cli.main(["gpu-check", "--out", str(tmp_path)])
    assert status == 2
    assert "no CUDA device" in capsys.readouterr().err
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["header"]["cuda_available"] is False
    assert [s["status"] for s in report["steps"]] == ["not run"] * len(gpu_check.ALL_STEPS)
    assert "nothing measured" in (tmp_path / "gpu_check.md").read_text()


def test_report_from_a_fake_step_list(tmp_path):
    """Each step's result lands in the JSON and the Markdown table; a raising step is a failure, a skipped
    one is not; the benchmark rows become a measurements table; the exit status follows."""

    def ok(out_dir, limit):
        return StepResult("versions", "ok", 0.1, "torch x", {"torch": "x"})

    def boom(out_dir, limit):
        raise RuntimeError("compile failed")

    def skipped(out_dir, limit):
        return StepResult("memcheck", "skipped", 0.0, "compute-sanitizer not found")

    def bench(out_dir, limit):
        rows = [{"case": "gspo_kernels triton (inplace)", "median_ms": 5.1, "GB_s": 2930.0,
                 "fraction_of_hbm_peak": 0.87}]
        return StepResult("benchmarks", "ok", 3.0, "1 measurements", {"rows": rows})

    steps = [Step("versions", ok, 10), Step("h100-report", boom, 10), Step("memcheck", skipped, 10),
             Step("benchmarks", bench, 10)]
    results = gpu_check.run_steps(steps, str(tmp_path), budget_s=60, header={"mode": "test"})
    assert [r.status for r in results] == ["ok", "failed", "skipped", "ok"]
    assert gpu_check.exit_status(results) == 1
    assert gpu_check.exit_status([results[0], results[2]]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["header"]["mode"] == "test"
    assert report["steps"][1]["summary"] == "RuntimeError: compile failed"
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| h100-report | failed |" in md and "| memcheck | skipped |" in md
    assert "## Measurements" in md and "gspo_kernels triton (inplace)" in md and "2930" in md


def test_budget_spent_marks_the_remaining_steps_not_run(tmp_path):
    def slow(out_dir, limit):
        time.sleep(1.2)
        return StepResult("versions", "ok", 1.2)

    results = gpu_check.run_steps([Step("versions", slow, 10), Step("gpu-tests", slow, 10)], str(tmp_path),
                                  budget_s=2.0)
    assert [r.status for r in results] == ["ok", "not run"]


def test_memcheck_skips_with_a_reason_without_compute_sanitizer(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "compute_sanitizer", lambda: None)
    result = gpu_check.step_memcheck(str(tmp_path), 10)
    assert result.status == "skipped" and "compute-sanitizer" in result.summary


CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_pytest_step_where_everything_skipped_fails(tmp_path, monkeypatch):
    """A check that cannot fail is no check: zero tests run counts as a failed step."""
    monkeypatch.setitem(gpu_check._tree, "root", CHECKOUT)  # set by `run` (which this test does not call)
    xml = tmp_path / "gpu_tests.xml"

    def fake_subprocess(name, argv, limit_s, env=None, log_path=None):
        xml.write_text('<testsuites><testsuite tests="3" failures="0" errors="0" skipped="3"/></testsuites>')
        return StepResult(name, "ok", 1.0, "exit status 0")

    monkeypatch.setattr(gpu_check, "_subprocess", fake_subprocess)
    result = gpu_check.step_gpu_tests(str(tmp_path), 10)
    assert result.status == "failed" and "every test skipped" in result.summary


def test_benchmarks_step_with_nothing_measured_fails(tmp_path, monkeypatch):
    """Every benchmark skipped (no measurement) is a failed step; measured rows are collected."""
    monkeypatch.setitem(gpu_check._tree, "root", CHECKOUT)
    monkeypatch.setitem(gpu_check._mode, "quick", False)
    written = []

    def fake_subprocess(name, argv, limit_s, env=None, log_path=None):
        for line in written:
            with open(env["GSPO_BENCH_JSON"], "a") as f:
                f.write(line + "\n")
        return StepResult(name, "ok", 1.0, "exit status 0")

    monkeypatch.setattr(gpu_check, "_subprocess", fake_subprocess)
    result = gpu_check.step_benchmarks(str(tmp_path), 10)
    assert result.status == "failed" and "every benchmark skipped" in result.summary
    written.append('{"impl": "gspo_kernels triton backward", "active_share": 0.5, "bwd_ms": 80.0}')
    result = gpu_check.step_benchmarks(str(tmp_path), 10)
    assert result.status == "ok"
    assert result.data["rows"] == [{"impl": "gspo_kernels triton backward", "active_share": 0.5, "bwd_ms": 80.0}]


def test_memcheck_workload_runs_in_the_interpreter():
    from gspo_kernels.backends.triton.launch import interpreter_active

    if not interpreter_active():
        pytest.skip("the workload runs on the GPU here (the GPU step covers it)")
    gpu_check.workload("cpu", vocab_size=37, linear_vocab_size=40, loss_types=("grpo",))


def test_an_installed_package_without_tests_skips_the_tree_steps_and_says_why(tmp_path, monkeypatch):
    """From an installed package (no tests/ next to it, none in the current directory), the steps that run the
    repository's test files are skipped with the reason, never counted as passed, and the package's own
    checks (versions, the static report, ``verify``) remain; a source tree is found by ``--tests-dir`` or
    ``$GSPO_KERNELS_TESTS``."""
    import os

    monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path / "site-packages"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GSPO_KERNELS_TESTS", raising=False)
    assert gpu_check.find_test_tree() is None
    monkeypatch.setitem(gpu_check._tree, "root", None)
    for name in gpu_check.TREE_STEPS:
        result = gpu_check.STEP_FUNCTIONS[name](str(tmp_path), 10.0)
        assert result.status == "skipped" and "--tests-dir" in result.summary, name
    assert "verify" in gpu_check.ALL_STEPS and "verify" not in gpu_check.TREE_STEPS
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert gpu_check.find_test_tree(checkout) == checkout
    monkeypatch.setenv("GSPO_KERNELS_TESTS", checkout)
    assert gpu_check.find_test_tree() == checkout


def _record_commands(monkeypatch) -> dict:
    """Each step's command line instead of running it: ``{step name: argv}`` (every step "ok")."""
    seen = {}

    def fake_subprocess(name, argv, limit_s, env=None, log_path=None):
        seen[name] = list(argv)
        return StepResult(name, "ok", 1.0, "exit status 0")

    monkeypatch.setattr(gpu_check, "_subprocess", fake_subprocess)
    return seen


def test_quick_mode_fits_four_minutes_and_selects_the_gpu_tests_in_parallel(tmp_path, monkeypatch):
    """``--quick``: its steps' own limits add up to its 240 s budget; the GPU-test step runs the gpu-marked tests
    and the kernel files (not the static report) in pytest-xdist processes when xdist is installed; memcheck
    runs the one-loss-type workload; files whose peer is missing are left out with the reason in the summary."""
    steps = gpu_check.make_steps(gpu_check.QUICK_STEPS, quick=True)
    assert [s.name for s in steps] == ["versions", "verify", "gpu-tests", "memcheck", "benchmarks"]
    assert sum(s.limit_s for s in steps) <= gpu_check.QUICK_BUDGET_S
    seen = _record_commands(monkeypatch)
    monkeypatch.setitem(gpu_check._tree, "root", CHECKOUT)
    monkeypatch.setitem(gpu_check._mode, "quick", True)
    monkeypatch.setattr(gpu_check, "xdist_workers", lambda: 15)
    monkeypatch.setattr(gpu_check, "left_out_test_files", lambda root: {"tests/integrations/test_verl.py": "verl not installed"})
    result = gpu_check.step_gpu_tests(str(tmp_path), 90)
    argv = seen["gpu-tests"]
    k = argv[argv.index("-k") + 1]
    assert "gpu" in k and "test_triton_logits" in k and "test_triton_linear" in k and "not h100_static_report" in k
    assert argv[argv.index("-n") + 1] == "15" and "--ignore=tests/integrations/test_verl.py" in argv
    assert "left out: test_verl.py (verl not installed)" in result.summary and "15 processes" in result.summary
    monkeypatch.setattr(gpu_check, "compute_sanitizer", lambda: "/usr/bin/compute-sanitizer")
    gpu_check.step_memcheck(str(tmp_path), 30)
    assert "--workload-quick" in seen["memcheck"]


def test_left_out_test_files_names_the_missing_peer(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "verl" else real(name, *a))
    left_out = gpu_check.left_out_test_files(CHECKOUT)
    assert "tests/integrations/test_verl.py" in left_out and "verl not installed" in left_out["tests/integrations/test_verl.py"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert gpu_check.left_out_test_files(CHECKOUT) == {}


@pytest.mark.parametrize("index_up", [True, False], ids=["index-reachable", "offline"])
def test_suite_step_runs_every_test_but_what_this_machine_cannot(tmp_path, monkeypatch, index_up):
    """``suite``: ``pytest tests`` in parallel; a missing peer's file is ignored and its single test deselected, and
    without the package index the network-marked tests are left out, each named in the summary."""
    seen = _record_commands(monkeypatch)
    monkeypatch.setitem(gpu_check._tree, "root", CHECKOUT)
    monkeypatch.setattr(gpu_check, "xdist_workers", lambda: 15)
    monkeypatch.setattr(gpu_check, "package_index_reachable", lambda timeout_s=3.0: index_up)
    monkeypatch.setattr(gpu_check, "left_out_test_files", lambda root: {
        "tests/integrations/test_verl.py": "verl not installed", "tests/objectives/test_objectives.py::test_matches_verl_policy_losses": "verl"})
    result = gpu_check.step_suite(str(tmp_path), 600)
    argv = seen["suite"]
    assert argv[argv.index("pytest") + 1] == "tests" and argv[argv.index("-n") + 1] == "15"
    assert "--ignore=tests/integrations/test_verl.py" in argv
    assert "--deselect=tests/objectives/test_objectives.py::test_matches_verl_policy_losses" in argv
    assert ("not network" in argv) is (not index_up)
    assert ("network-marked tests" in result.summary) is (not index_up)


def test_quick_benchmarks_run_bench_gpu_when_it_exists(tmp_path, monkeypatch):
    """With ``gspo_kernels.tools.bench_gpu`` present, --quick's benchmarks step is ``bench --gpu`` within the step's
    time (its results and targets in the report); without it, the benchmark files' headline cases."""
    seen = {}

    def fake_subprocess(name, argv, limit_s, env=None, log_path=None):
        seen["argv"] = list(argv)
        if "--gpu" in argv:
            prefix = argv[argv.index("--out") + 1]
            with open(prefix + ".json", "w") as f:
                json.dump({"results": [{"case": "hidden", "impl": "fused_linear_gspo_loss", "ms": 113.3}],
                           "targets": [{"target": "x plain", "value": 0.98, "limit": "<= 1", "status": "met"}]}, f)
        return StepResult(name, "ok", 1.0, "exit status 0")

    monkeypatch.setattr(gpu_check, "_subprocess", fake_subprocess)
    monkeypatch.setitem(gpu_check._tree, "root", CHECKOUT)
    monkeypatch.setitem(gpu_check._mode, "quick", True)
    monkeypatch.setattr(gpu_check, "has_bench_gpu", lambda: True)
    result = gpu_check.step_benchmarks(str(tmp_path), 60)
    argv = seen["argv"]
    assert argv[argv.index("bench") + 1] == "--gpu" and float(argv[argv.index("--budget-s") + 1]) < 60
    assert result.status == "ok" and result.data["rows"][0]["ms"] == 113.3
    md = gpu_check.format_markdown([result])
    assert "## Measurements" in md and "## Targets (bench --gpu)" in md and "| x plain | 0.98 |" in md
    monkeypatch.setattr(gpu_check, "has_bench_gpu", lambda: False)
    gpu_check.step_benchmarks(str(tmp_path), 60)
    assert "benchmarks/test_gpu_logits.py" in seen["argv"] and "-k" in seen["argv"]
