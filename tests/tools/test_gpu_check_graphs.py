"""``gpu-check``'s ``cuda-graphs`` step (``gspo_kernels.tools.gpu_check_graphs``): its options, the selection it
runs, and its place in ``gpu-check``. The capture itself needs a GPU (never ran here)."""

from __future__ import annotations

import json

import pytest

from gspo_kernels.tools import gpu_check, gpu_check_graphs
from gspo_kernels.tools.gpu_check import StepResult


def test_selections_default_to_all_and_keep_the_order_given():
    args = gpu_check_graphs.parse_args(["--out", "x.json"])
    assert (args.backends, args.paths, args.shapes) == (["triton", "torch"], ["linear", "logits"], ["small", "medium"])
    assert args.repeats == 10
    args = gpu_check_graphs.parse_args(["--out", "x.json", "--backends", "torch", "--paths", "logits,linear,logits",
                                        "--shapes", " medium ", "--repeats", "3"])
    assert (args.backends, args.paths, args.shapes, args.repeats) == (["torch"], ["logits", "linear"], ["medium"], 3)


@pytest.mark.parametrize("argv, named", [
    (["--backends", "cpu"], "--backends must name among triton, torch; got cpu"),
    (["--paths", "linear,hidden"], "--paths must name among linear, logits; got hidden"),
    (["--shapes", "huge"], "--shapes must name among small, medium; got huge"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
])
def test_a_bad_selection_is_refused_naming_the_option(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check_graphs.parse_args(["--out", "x.json", *argv])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_without_cuda_it_says_so_and_exits_2(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the step would run")
    assert gpu_check_graphs.main(["--out", str(tmp_path / "r.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "r.json").exists()


def test_gpu_check_runs_it_as_its_own_step_in_a_subprocess(tmp_path, monkeypatch):
    """``--steps cuda-graphs`` selects it (part of the full check, not of ``--quick``); the step runs this module in a
    subprocess writing ``cuda_graphs.json``, whose records it reads, counting the failed ones in its summary."""
    assert gpu_check.parse_steps("cuda-graphs") == ["cuda-graphs"]
    assert "cuda-graphs" in gpu_check.ALL_STEPS and "cuda-graphs" not in gpu_check.QUICK_STEPS
    (step,) = gpu_check.make_steps(["cuda-graphs"])
    assert step.limit_s == gpu_check.STEP_LIMITS_S["cuda-graphs"]
    (tmp_path / "cuda_graphs.json").write_text("stale")  # a previous run's file is never read
    seen = {}

    def fake_subprocess(name, argv, limit_s, env=None, log_path=None):
        seen.update(name=name, argv=list(argv), limit_s=limit_s)
        records = [dict(backend="triton", path="linear", shape="small", ok=True),
                   dict(backend="torch", path="logits", shape="medium", ok=False, error="x"),
                   dict(backend="torch", path="linear", shape="small", ok=None, skipped="unavailable")]
        (tmp_path / "cuda_graphs.json").write_text(json.dumps(dict(records=records)))
        return StepResult(name, "failed", 1.0, "exit status 1")

    monkeypatch.setattr(gpu_check, "_subprocess", fake_subprocess)
    result = step.run(str(tmp_path), 123.0)
    assert seen["name"] == "cuda-graphs" and seen["limit_s"] == 123.0
    assert seen["argv"][1:] == ["-m", "gspo_kernels.tools.gpu_check_graphs", "--out", str(tmp_path / "cuda_graphs.json")]
    assert result.status == "failed" and len(result.data["records"]) == 3
    assert result.summary.endswith("; 1 of 3 captured and equal to eager; failed: torch/logits/medium")


def test_a_run_that_wrote_nothing_reads_no_previous_records(tmp_path, monkeypatch):
    (tmp_path / "cuda_graphs.json").write_text(json.dumps(dict(records=[dict(backend="torch", path="linear",
                                                                              shape="small", ok=True)])))
    monkeypatch.setattr(gpu_check, "_subprocess", lambda name, argv, limit_s, **kw: StepResult(name, "timeout", 1.0,
                                                                                                "killed after 1 s"))
    result = gpu_check.make_steps(["cuda-graphs"])[0].run(str(tmp_path), 1.0)
    assert result.status == "timeout" and "records" not in result.data and result.summary == "killed after 1 s"
