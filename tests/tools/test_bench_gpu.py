"""``gspo-kernels bench --gpu``: the exit status without CUDA, the CPU smoke path (``--device cpu --tiny``) of
every measured code path, and the ratio / target arithmetic. The GPU numbers themselves are measured on a GPU
machine (``benchmarks/gpu_run.sh``); nothing here is a measurement."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gspo_kernels.tools import bench_gpu
from gspo_kernels.tools.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA exit status needs a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2(tmp_path, capsys):
    out = tmp_path / "bench_gpu"
    assert main(["bench", "--gpu", "--out", str(out)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "bench_gpu.json").exists()


def test_cpu_device_is_only_the_tiny_smoke_run(tmp_path, capsys):
    assert main(["bench", "--gpu", "--device", "cpu", "--out", str(tmp_path / "x")]) == 2
    assert "--tiny" in capsys.readouterr().err
    assert main(["bench", "--gpu", "--device", "cpu", "--tiny", "--sections", "nope", "--out", str(tmp_path / "x")]) == 2
    assert main(["bench", "--gpu", "--device", "cpu", "--tiny", "--peers", "nope", "--out", str(tmp_path / "x")]) == 2


def test_tiny_smoke_run_covers_every_in_process_case(tmp_path):
    """hidden, logits and torch-backend sections on tiny CPU shapes, in their subprocess, end to end."""
    out = tmp_path / "bench_gpu"
    code = main(["bench", "--gpu", "--device", "cpu", "--tiny", "--sections", "hidden,logits,torch-backend",
                 "--peers", "trl,cce", "--out", str(out)])  # Liger's import alone takes ~6 s here
    payload = json.loads((tmp_path / "bench_gpu.json").read_text())
    rows = {(r["section"], r["case"]): r for r in payload["results"]}
    assert code == 0, [r for r in payload["results"] if r["status"] == "error"]
    assert payload["tiny"] and payload["environment"]["device"] == "cpu"
    must_run = [
        ("hidden", "ceiling: cuBLAS bf16 GEMM n^3"),
        ("hidden", "ceiling: cuBLAS hidden @ weight.T at the shape"),
        ("hidden", "ceiling: chunk GEMM by rows, H=32"),
        ("hidden", "plain PyTorch, all rows"),
        ("hidden", "ours fused_linear_gspo_loss, all rows"),
        ("hidden", "plain PyTorch, half zero advantage"),
        ("hidden", "ours fused_linear_gspo_loss, half zero advantage"),
        ("hidden", "forward: ours linear_logprobs (no grad)"),
        ("logits", "ceiling: device-to-device copy"),
        ("logits", "ours gspo_loss, V=256"), ("logits", "plain PyTorch, V=256"),
        ("logits", "ours gspo_loss, V=200"), ("logits", "plain PyTorch, V=200"),
    ]
    sweep = rows[("hidden", "ceiling: chunk GEMM by rows, H=32")]
    assert sorted(int(m) for m in sweep["sweep"]) == [8, 16, 24, 32] and all(t > 0 for t in sweep["sweep"].values())
    torch_cases = [k for k in rows if k[0] == "torch-backend"]
    assert len(torch_cases) == 4
    for key in must_run + torch_cases:
        assert rows[key]["status"] == "ok", (key, rows[key])
        assert rows[key]["ms"] > 0 and len(rows[key]["ms_all"]) == rows[key]["reps"]
    # The measured paths compute the same thing: ours' gradients are plain PyTorch's (fp32 on the CPU).
    ours = rows[("hidden", "ours fused_linear_gspo_loss, all rows")]
    assert ours["dh_rel_err_vs_plain"] < 1e-5 and ours["dw_rel_err_vs_plain"] < 1e-5
    assert rows[("hidden", "plain PyTorch, all rows")]["x_plain"] == 1.0
    assert math.isclose(ours["x_plain"], ours["ms"] / rows[("hidden", "plain PyTorch, all rows")]["ms"])
    # Peers: run where importable on a CPU, skipped with a reason otherwise (never an error).
    for key in [("hidden", "TRL ChunkedLogProbFunction + GSPO formula, all rows"),
                ("hidden", "forward: TRL ChunkedLogProbFunction (no grad)")]:
        assert rows[key]["status"] in ("ok", "skipped"), rows[key]
        assert rows[key]["status"] == "ok" or "not importable" in rows[key]["reason"]
    assert "need CUDA" in rows[("hidden", "Cut Cross-Entropy linear_cross_entropy + GSPO formula")]["reason"]
    assert "not selected" in rows[("hidden", "Liger LigerFusedLinearGRPOLoss (sequence), all rows")]["reason"]
    assert rows[("logits", "Liger triton_grpo_loss (sequence), V=256")]["status"] == "skipped"
    assert len(payload["targets"]) == len(bench_gpu.TARGETS)
    md = (tmp_path / "bench_gpu.md").read_text()
    assert "not a measurement" in md and "| ours fused_linear_gspo_loss, all rows |" in md


def _row(section, case, ms, **kw):
    return dict(section=section, case=case, status="ok", ms=ms, **kw)


def test_ratios_and_targets_from_rows():
    rows = [
        _row("hidden", "plain PyTorch, all rows", 100.0),
        _row("hidden", "ours fused_linear_gspo_loss, all rows", 80.0, peak_extra_gib=4.5),
        _row("hidden", "plain PyTorch, half zero advantage", 90.0),
        _row("hidden", "ours fused_linear_gspo_loss, half zero advantage", 50.0, peak_extra_gib=8.5),
        _row("hidden", "forward: ours linear_logprobs (no grad)", 30.0),
        _row("hidden", "forward: TRL ChunkedLogProbFunction (no grad)", 29.0),
        _row("trl-step", "stock trl.GRPOTrainer", 58.0, peak_extra_gib=4.0),
        _row("trl-step", "drop-in integrations.trl.GRPOTrainer", 49.0, peak_extra_gib=3.0),
        _row("logits", "ours gspo_loss, V=151936", 4.0, V=151936, of_floor=0.9, issue_ms=0.3, waited_on_device=False),
        _row("logits", "plain PyTorch, V=151936", 40.0, V=151936),
        _row("logits", "ours gspo_loss, V=50257", 2.0, V=50257, of_floor=0.7, issue_ms=0.2, waited_on_device=True),
        _row("torch-backend", "ours backend='torch', logits [8, 1025, 151936]", 30.0, shape="logits [8, 1025, 151936]"),
        _row("torch-backend", "plain PyTorch, logits [8, 1025, 151936]", 20.0, shape="logits [8, 1025, 151936]"),
    ]
    bench_gpu.add_ratios(rows)
    assert rows[1]["x_plain"] == pytest.approx(0.8)
    assert rows[3]["x_plain"] == pytest.approx(50 / 90)  # against plain on the same (half) inputs
    assert rows[4]["x_trl_forward"] == pytest.approx(30 / 29)
    assert rows[7]["x_plain"] == pytest.approx(49 / 58)
    assert rows[8]["x_plain"] == pytest.approx(0.1)
    targets = {t["key"]: t for t in bench_gpu.evaluate_targets(rows)}
    status = {key: t["status"] for key, t in targets.items()}
    assert status == {
        "hidden_all": "met",  # 0.80 <= 0.80
        "hidden_half": "MISSED",  # 0.556 > 0.55
        "hidden_peak": "MISSED",  # 8.5 GiB
        "two_pass_fwd": "MISSED",
        "trl_time": "met",
        "trl_peak": "met",  # 0.75
        "logits_host": "met",
        # the call's one host read waited behind the spin: its issue_ms is then the issue time from an idle GPU
        "logits_host_small": "met",
        "logits_floor": "met",
        "logits_floor_small": "MISSED",  # 0.7 of the floor < 0.75
        "torch_logits": "MISSED",
        "torch_hidden": "not measured",
    }
    assert "idle GPU" in targets["logits_host_small"]["note"] and targets["logits_host"]["note"] is None


@pytest.mark.slow
def test_tiny_liger_fused_linear_grpo_runs_on_cpu(tmp_path):
    """The Liger hidden-state peer's code path (its import alone takes seconds: a test of its own)."""
    import liger_kernel  # noqa: F401  (make test installs it: missing, this is an error, not a skip)

    assert main(["bench", "--gpu", "--device", "cpu", "--tiny", "--sections", "hidden", "--peers", "liger",
                 "--out", str(tmp_path / "b")]) == 0
    rows = {r["case"]: r for r in json.loads((tmp_path / "b.json").read_text())["results"]}
    liger = rows["Liger LigerFusedLinearGRPOLoss (sequence), all rows"]
    assert liger["status"] == "ok" and liger["reps"] == 2, liger


@pytest.mark.slow
def test_tiny_trl_step_runs_both_trainers_in_fresh_processes():
    """Stock TRL, the drop-in as it comes and with gspo_one_pass=True: the same loss and lm_head gradient, each timed
    against stock's."""
    import trl  # noqa: F401  (make test installs it: missing, this is an error, not a skip)

    result = bench_gpu.run_trl_step("cpu", tiny=True, limit_s=240)
    assert result["status"] == "ok", result
    stock, ours, other = result["rows"]
    assert stock["trainer"] == "trl" and ours["trainer"] == other["trainer"] == "gspo"
    assert "gspo_one_pass=True" in other["case"] and "one_pass" not in ours["case"]
    assert stock["shape"] == ours["shape"] == other["shape"] == "tiny"
    for row in (ours, other):
        assert row["loss"] == pytest.approx(stock["loss"], rel=1e-5, abs=1e-6)
        assert row["lm_head_grad_norm"] == pytest.approx(stock["lm_head_grad_norm"], rel=1e-4)
    bench_gpu.add_ratios(result["rows"])
    assert ours["x_plain"] == pytest.approx(ours["ms"] / stock["ms"])
    assert other["x_plain"] == pytest.approx(other["ms"] / stock["ms"])


def test_profiled_busy_merges_device_intervals_and_times_the_first_op():
    """``profiled_busy``: the union of device intervals (overlaps counted once, user annotations' GPU projections
    left out), and the host lead from the CPU mark's start to the first device op (hand-made events, in us)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(name, device, t0, t1, annotation=False):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=t0, end=t1),
                               is_user_annotation=annotation)

    events = [
        ev("gspo_bench_step", DeviceType.CPU, 100.0, 900.0),
        ev("gspo_bench_step", DeviceType.CUDA, 400.0, 2000.0, annotation=True),  # spans the gaps: not work
        ev("gemm", DeviceType.CUDA, 400.0, 1000.0),
        ev("epilogue", DeviceType.CUDA, 900.0, 1100.0),  # overlaps the GEMM by 100 us
        ev("cast", DeviceType.CUDA, 1500.0, 1600.0),
        ev("aten::mm", DeviceType.CPU, 150.0, 160.0),
    ]
    busy, first = bench_gpu.profiled_busy(events, "gspo_bench_step")
    assert busy == pytest.approx((1100 - 400 + 100) / 1e3)
    assert first == pytest.approx((400 - 100) / 1e3)
    assert bench_gpu.profiled_busy(events)[1] is None
    assert bench_gpu.profiled_busy(events[:1], "gspo_bench_step") == (0.0, None)


def test_chunk_gemm_sweep_times_the_librarys_own_chunk_rows_and_multiples_of_128():
    """The sweep's rows at the bench's and the TRL client's shapes hold the row counts the library's chunk rules give
    there (the no-grad pass's 1 GiB, the sliced route's 256 MiB forward) beside multiples of 128, and none above N."""
    import torch

    from gspo_kernels.backends.triton import configs

    for N in (16384, 8192):
        rows = bench_gpu.chunk_gemm_rows(N, 151936, torch.bfloat16, tiny=False)
        own = {configs.gemm_chunk_rows(N, 151936, torch.bfloat16, b, need_dz=False)
               for b in (None, configs.VOCAB_SLICE_BUDGET)}
        assert own == {1760, 432} and own <= set(rows)
        assert {384, 512, 1536, 1664, 1792} <= set(rows) and rows == sorted(rows)
    assert bench_gpu.chunk_gemm_rows(20, 256, torch.float32, tiny=True) == [8, 16, 20]
    assert bench_gpu.chunk_gemm_hidden_sizes(4096, tiny=False) == (4096, 2048)
    assert bench_gpu.chunk_gemm_hidden_sizes(2048, tiny=False) == (2048,)
