"""``gspo-kernels gpu-check``: the one command to run first on a machine with a GPU.

It runs, in order, each step under its own time limit and all of them under one budget (20 minutes by
default, sized for an H100):

1. ``versions``: Python, torch (and the CUDA it was built with), triton, the driver and the devices
   (``nvidia-smi``), the library's path and git commit.
2. ``h100-report``: the static sm_90a report (registers, spills, HGMMA, 128-bit loads) compiled with the
   *installed* Triton (``gspo-kernels h100-report``).
3. ``verify``: ``gspo-kernels verify`` on the GPU (every backend against the float64 reference).
4. ``gpu-tests``: ``pytest -m gpu tests`` (the GPU-only checks: the bf16 tensor-core path against float64,
   determinism, peak memory, devices other than the current one).
5. ``triton-tests``: ``tests/backends/triton/test_triton_logits*.py`` and
   ``tests/backends/triton/test_triton_linear.py`` (every kernel against the float64 reference, on the GPU this time
   instead of the interpreter).
6. ``memcheck``: ``compute-sanitizer --tool memcheck`` over small shapes of every Triton launch
   (``--workload``), with PyTorch's caching allocator off so that a read past an allocation is caught;
   skipped with a reason when ``compute-sanitizer`` is not installed.
7. ``benchmarks``: ``benchmarks/test_gpu_logits.py`` (GB/s against the 3-pass floor, the peers, the
   backward at 100/50/25% active rows) and ``benchmarks/test_gpu_linear.py`` (TFLOP/s against 6NHV / 8NHV,
   the backward at 100/50/25% active rows, the peers).
8. ``cuda-graphs``: the compiled loss step captured as CUDA graphs (``mode="reduce-overhead"``), checked against
   eager and timed beside it (:mod:`gspo_kernels.tools.gpu_check_graphs`, ``cuda_graphs.json``).
9. ``suite``: ``pytest tests``, the whole suite (not yet run through this step on a GPU), with the
   parity tests of missing peers and, when ``pypi.org`` is unreachable, the ``network``-marked packaging tests
   left out and named.

``--quick`` (about 2.5 minutes on an H200, measured, compilation included; budget 240 s): ``versions``, ``verify``,
``gpu-tests`` on a selection (every ``gpu``-marked test and the Triton kernel files, the static-report tests
left out; in parallel processes with pytest-xdist when it is installed), ``memcheck`` over the small workload
(one loss type), and ``benchmarks``: ``gspo-kernels bench --gpu`` within the step's time when that command
exists (``gspo_kernels.tools.bench_gpu``), else the two benchmark files at a quick size.

Test files that need a peer that is not installed (TRL and ``datasets`` for ``tests/integrations/test_trl_*.py``,
verl for ``tests/integrations/test_verl.py`` and one test of ``tests/objectives/test_objectives.py``) are left out of
the pytest steps, and the step's summary says which and why (:func:`left_out_test_files`): ``make test`` is where the parity tests run, and never skip.

Everything goes to ``<out>/gpu_check.json`` and ``<out>/gpu_check.md`` (rewritten after each step, so an
interrupted run still leaves what it measured), next to each step's own files (``h100_report.json``,
``gpu_tests.xml``, ``triton_tests.xml``, ``benchmarks.json``, ``bench_linear.jsonl``, ``memcheck.log``).

Without a CUDA device the command says so and exits with status 2 after writing a report whose steps are
all "not run". ``--static-only`` runs only what needs no GPU (``versions`` and ``h100-report``) on any
machine and exits 0 when they pass.

Exit status: 0 when every step that ran passed (steps skipped with a reason do not fail the check), 1 when
a step failed or timed out, 2 when there is no CUDA device (and ``--static-only`` was not given).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from gspo_kernels.tools import gpu_check_graphs  # the cuda-graphs step
from gspo_kernels.tools.gpu_check_report import BENCH_COLUMNS, StepResult, format_markdown, write_reports  # noqa: F401
from gspo_kernels.tools.memcheck_workload import workload

# The directory holding the gspo_kernels package (the repository root in a checkout).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_BUDGET_S = 20 * 60
QUICK_BUDGET_S = 4 * 60
QUICK_TIME = "about 2.5 minutes on an H200"  # measured (compilation included); the README says the same
QUICK_STEPS = ("versions", "verify", "gpu-tests", "memcheck", "benchmarks")
# --quick: each step's own limit (seconds); they add up to the budget.
# Measured on an H200 (docs/gpu-check.md): verify 34 s, gpu-tests 90 s (before test_vocab_sliced_backward.py joined them),
# memcheck 11 s; memcheck gave gpu-tests 15 of its seconds.
QUICK_LIMITS_S = {"versions": 20, "verify": 45, "gpu-tests": 110, "memcheck": 20, "benchmarks": 45}
# Test files (or single tests, ``file::name``) and the peers (importable modules) they need.
PEER_TEST_FILES = {
    "tests/integrations/test_trl_integration.py": ("trl", "datasets"),
    "tests/integrations/test_trl_objectives.py": ("trl", "datasets"),
    "tests/integrations/test_trl_training.py": ("trl", "datasets"),
    "tests/integrations/test_trl_distributed.py": ("trl", "datasets"),
    "tests/integrations/test_trl_compile.py": ("trl", "datasets"),
    "tests/integrations/test_verl.py": ("verl",),
    "tests/objectives/test_objectives.py::test_matches_verl_policy_losses": ("verl",),
}
# Where the ``suite`` step checks that pip can reach the package index (the ``network``-marked tests need it).
PACKAGE_INDEX = ("pypi.org", 443)
# The kernel test files of the quick selection (with every ``gpu``-marked test of the suite).
QUICK_TEST_FILES = ("tests/backends/triton/test_triton_logits.py", "tests/backends/triton/test_triton_logits_edges.py",
                    "tests/backends/triton/test_triton_linear.py", "tests/backends/triton/test_hidden_path_gemm.py",
                    "tests/backends/triton/test_vocab_sliced_backward.py")
# --quick: verify's paths (the two-pass head's kernels are checked against float64 by its test file above instead:
# the step's limit was set from a measured 26 s for these two paths)
QUICK_VERIFY_PATHS = ("logits", "linear")
_mode: Dict[str, bool] = {"quick": False}
STATIC_STEPS = ("versions", "h100-report")
ALL_STEPS = ("versions", "h100-report", "verify", "gpu-tests", "triton-tests", "memcheck", "benchmarks", "cuda-graphs",
             "suite")
# The steps that run the repository's test files (tests/, benchmarks/): they need a source tree (a checkout,
# or the unpacked sdist) found by :func:`find_test_tree`; the others run from the installed package alone.
TREE_STEPS = ("gpu-tests", "triton-tests", "benchmarks", "suite")
_tree: Dict[str, Optional[str]] = {"root": None}


@dataclass
class Step:
    """``run(out_dir, time_limit_s) -> StepResult``; ``limit_s``: this step's own time limit."""

    name: str
    run: Callable[[str, float], StepResult]
    limit_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="results", help="directory for gpu_check.json / gpu_check.md (results)")
    parser.add_argument("--steps", default=",".join(ALL_STEPS),
                        help=f"comma-separated steps to run, in order (default: all: {','.join(ALL_STEPS)})")
    parser.add_argument("--static-only", action="store_true",
                        help="run only the steps that need no GPU (versions, h100-report), on any machine")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"time budget of the whole check in seconds (default {DEFAULT_BUDGET_S}, "
                             f"{QUICK_BUDGET_S} with --quick)")
    parser.add_argument("--tests-dir", default=None,
                        help="a source tree holding tests/ and benchmarks/ (default: $GSPO_KERNELS_TESTS, the checkout "
                             "this package runs from, or the current directory)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_TIME}, compilation included: {', '.join(QUICK_STEPS)} on a selection of "
                             f"tests, one loss type under memcheck, the headline benchmarks (budget {QUICK_BUDGET_S} s "
                             f"unless --budget-s)")
    parser.add_argument("--workload", action="store_true",
                        help="internal: run the memcheck step's workload (every Triton launch at small shapes) only")
    parser.add_argument("--workload-quick", action="store_true",
                        help="internal: the same, one loss type (the --quick memcheck workload)")


def find_test_tree(explicit: Optional[str] = None) -> Optional[str]:
    """The first of ``explicit``, ``$GSPO_KERNELS_TESTS``, the directory above the package (a checkout) and the
    current directory that holds the library's test files; None for an installed package with no source tree."""
    for candidate in (explicit, os.environ.get("GSPO_KERNELS_TESTS"), ROOT, os.getcwd()):
        kernel_tests = os.path.join(candidate or "", "tests", "backends", "triton", "test_triton_logits.py")
        if candidate and os.path.exists(kernel_tests):
            return os.path.abspath(candidate)
    return None


def _needs_tree(name: str) -> Optional[StepResult]:
    """A skipped result naming what is missing when the step needs a source tree and none was found."""
    if _tree["root"] is None:
        return StepResult(name, "skipped", 0.0, "no source tree with tests/ and benchmarks/ (an installed package): "
                          "run from a checkout or the unpacked sdist, or pass --tests-dir")
    return None


def parse_steps(text: str) -> List[str]:
    """The step names of ``--steps``, checked against :data:`ALL_STEPS`."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ALL_STEPS]
    if unknown or not names:
        raise ValueError(f"--steps must name steps among {', '.join(ALL_STEPS)}; got {text!r}")
    return names


# --- the steps ---------------------------------------------------------------------------------------------


def _env() -> Dict[str, str]:
    """The environment of the subprocesses: no interpreter, this copy of the library first on the path."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def _tail(text: str, n: int = 4000) -> str:
    return text[-n:]


def _subprocess(name: str, argv: Sequence[str], limit_s: float, env: Optional[Dict[str, str]] = None,
                log_path: Optional[str] = None) -> StepResult:
    """Run ``argv`` from the source tree (else the current directory); ok on exit status 0, timeout past
    ``limit_s``."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(list(argv), cwd=_tree["root"] or os.getcwd(), env=env or _env(), capture_output=True, text=True,
                              timeout=max(limit_s, 1.0))
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return StepResult(name, "timeout", time.perf_counter() - start, f"killed after {limit_s:.0f} s",
                          output_tail=_tail(out))
    except FileNotFoundError as exc:
        return StepResult(name, "failed", time.perf_counter() - start, f"cannot run: {exc}")
    output = proc.stdout + proc.stderr
    if log_path:
        with open(log_path, "w") as f:
            f.write(output)
    status = "ok" if proc.returncode == 0 else "failed"
    return StepResult(name, status, time.perf_counter() - start, f"exit status {proc.returncode}",
                      data={"returncode": proc.returncode}, output_tail=_tail(output))


def step_versions(out_dir: str, limit_s: float) -> StepResult:
    start = time.perf_counter()
    import torch

    data: Dict[str, object] = {"python": platform.python_version(), "platform": platform.platform(),
                               "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                               "cuda_available": torch.cuda.is_available(), "library": ROOT}
    try:
        import triton

        data["triton"] = triton.__version__
    except Exception as exc:  # reported, not fatal: the report says what is missing
        data["triton"] = f"not importable: {exc}"
    if torch.cuda.is_available():
        data["devices"] = [
            {"index": i, "name": torch.cuda.get_device_name(i),
             "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(torch.cuda.device_count())
        ]
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            data["nvidia_smi"] = subprocess.run(
                [smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception as exc:
            data["nvidia_smi"] = f"failed: {exc}"
    try:
        data["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                            text=True, timeout=10).stdout.strip() or None
    except Exception:
        data["git_commit"] = None
    devices = ", ".join(d["name"] for d in data.get("devices", [])) or "no CUDA device"
    summary = f"torch {data['torch']} (CUDA {data['torch_cuda']}), triton {data['triton']}; {devices}"
    return StepResult("versions", "ok", time.perf_counter() - start, summary, data)


def step_h100_report(out_dir: str, limit_s: float) -> StepResult:
    path = os.path.join(out_dir, "h100_report.json")
    result = _subprocess("h100-report", [sys.executable, "-m", "gspo_kernels", "h100-report", "--json", path],
                         limit_s)
    if os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)
        from gspo_kernels.tools.h100_report import problems

        failing = {row["name"]: problems(row) for row in rows if problems(row)}
        result.data.update(configs=len(rows), failing=failing, file=path,
                           max_registers=max((row.get("registers") or 0) for row in rows) if rows else 0)
        result.summary = f"{len(rows)} configurations, {len(failing)} failing"
    return result


def _junit_counts(path: str) -> Dict[str, int]:
    import xml.etree.ElementTree as ET

    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def left_out_test_files(root: str) -> Dict[str, str]:
    """``{test file or file::test: why}`` for the entries of :data:`PEER_TEST_FILES` (present under ``root``) whose
    peers are not importable here: they would fail at import (a missing peer is an error in ``make test``, on
    purpose)."""
    import importlib.util

    out = {}
    for path, modules in PEER_TEST_FILES.items():
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing and os.path.exists(os.path.join(root, path.split("::")[0])):
            out[path] = f"{', '.join(missing)} not installed (a parity test: `make test` runs it)"
    return out


def package_index_reachable(timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to :data:`PACKAGE_INDEX` opens (the ``network``-marked tests install with pip)."""
    import socket

    try:
        socket.create_connection(PACKAGE_INDEX, timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _left_out_args(left_out: Dict[str, str]) -> List[str]:
    """pytest arguments leaving ``left_out`` out: ``--ignore`` for a file, ``--deselect`` for one test."""
    return [f"--deselect={p}" if "::" in p else f"--ignore={p}" for p in left_out]


def xdist_workers() -> int:
    """Worker processes for pytest-xdist (``-n``): up to 16, the CPU count less one; 0 without pytest-xdist."""
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        return 0
    return max(1, min(16, (os.cpu_count() or 2) - 1))


def _pytest_step(name: str, out_dir: str, limit_s: float, args: Sequence[str], xml_name: str,
                 parallel: bool = False) -> StepResult:
    xml = os.path.join(out_dir, xml_name)
    left_out = left_out_test_files(_tree["root"] or os.getcwd())
    extra = _left_out_args(left_out)
    if "-m" not in args and not package_index_reachable():
        args = [*args, "-m", "not network"]
        left_out["network-marked tests"] = f"{PACKAGE_INDEX[0]} unreachable (they build and install with pip)"
    workers = xdist_workers() if parallel else 0
    if workers:
        extra += ["-n", str(workers)]
    result = _subprocess(name, [sys.executable, "-m", "pytest", *args, *extra, "-q", "-rs", "-p",
                                "no:cacheprovider", f"--junitxml={xml}"], limit_s)
    result.data["left_out"] = left_out
    result.data["xdist_workers"] = workers
    if os.path.exists(xml):
        counts = _junit_counts(xml)
        result.data.update(counts, file=xml)
        result.summary = (f"{counts['passed']} passed, {counts['failures'] + counts['errors']} failed, "
                          f"{counts['skipped']} skipped")
        if result.status == "ok" and counts["tests"] == counts["skipped"]:
            result.status = "failed"  # nothing ran: a check that cannot fail is no check
            result.summary += " (every test skipped)"
    if workers:
        result.summary += f"; {workers} processes"
    if left_out:
        result.summary += "; left out: " + "; ".join(f"{os.path.basename(p)} ({why})" for p, why in left_out.items())
    return result


def step_verify(out_dir: str, limit_s: float) -> StepResult:
    """``gspo-kernels verify`` on the GPU: every backend against the float64 reference (ships with the package);
    with ``--quick``, its :data:`QUICK_VERIFY_PATHS`."""
    log = os.path.join(out_dir, "verify.log")
    paths = ["--paths", *QUICK_VERIFY_PATHS] if _mode["quick"] else []
    result = _subprocess("verify", [sys.executable, "-m", "gspo_kernels", "verify", *paths], limit_s, log_path=log)
    result.data["file"] = log
    return result


def step_gpu_tests(out_dir: str, limit_s: float) -> StepResult:
    """``pytest -m gpu tests``; with ``--quick`` also the Triton kernel files (:data:`QUICK_TEST_FILES`: every
    kernel against float64, compiled this time) without their static-report tests, in parallel processes."""
    missing = _needs_tree("gpu-tests")
    if missing:
        return missing
    if not _mode["quick"]:
        return _pytest_step("gpu-tests", out_dir, limit_s, ["-m", "gpu", "tests"], "gpu_tests.xml")
    files = [f for f in QUICK_TEST_FILES if os.path.exists(os.path.join(_tree["root"], f))]
    # -k matches marks and module names: the gpu-marked tests of every file (and tests named "gpu"), every test
    # of the kernel files; not the static report (it needs no GPU; `make test` and h100-report run it)
    modules = " or ".join(["gpu"] + [os.path.basename(f)[:-3] for f in files])
    return _pytest_step("gpu-tests", out_dir, limit_s, ["tests", "-k", f"({modules}) and not h100_static_report"],
                        "gpu_tests.xml", parallel=True)


def step_triton_tests(out_dir: str, limit_s: float) -> StepResult:
    missing = _needs_tree("triton-tests")
    if missing:
        return missing
    files = [f for f in ("tests/backends/triton/test_triton_logits.py", "tests/backends/triton/test_triton_logits_edges.py",
                         "tests/backends/triton/test_triton_linear.py", "tests/backends/triton/test_hidden_path_gemm.py")
             if os.path.exists(os.path.join(_tree["root"], f))]
    return _pytest_step("triton-tests", out_dir, limit_s, files, "triton_tests.xml")


def step_suite(out_dir: str, limit_s: float) -> StepResult:
    """``pytest tests``, the whole suite on this machine (the Triton tests on CUDA tensors, the interpreter off),
    in parallel processes; the parity tests whose peer is missing and, without the package index, the
    ``network``-marked tests are left out and named in the summary."""
    missing = _needs_tree("suite")
    if missing:
        return missing
    return _pytest_step("suite", out_dir, limit_s, ["tests"], "suite.xml", parallel=True)


def compute_sanitizer() -> Optional[str]:
    """Path of ``compute-sanitizer`` (PATH, then ``$CUDA_HOME/bin``, then ``/usr/local/cuda/bin``), or None."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "compute-sanitizer")):
            return os.path.join(home, "bin", "compute-sanitizer")
    return None


def step_memcheck(out_dir: str, limit_s: float) -> StepResult:
    sanitizer = compute_sanitizer()
    if sanitizer is None:
        return StepResult("memcheck", "skipped", 0.0, "compute-sanitizer not found (PATH, $CUDA_HOME/bin, "
                          "/usr/local/cuda/bin): install the CUDA toolkit to run it")
    env = _env()
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # every tensor its own allocation: overreads are caught
    log = os.path.join(out_dir, "memcheck.log")
    workload_flag = "--workload-quick" if _mode["quick"] else "--workload"
    result = _subprocess("memcheck", [sanitizer, "--tool", "memcheck", "--error-exitcode", "3",
                                      sys.executable, "-m", "gspo_kernels", "gpu-check", workload_flag],
                         limit_s, env=env, log_path=log)
    result.data["file"] = log
    if "ERROR SUMMARY" in result.output_tail:
        result.summary = result.output_tail[result.output_tail.rindex("ERROR SUMMARY"):].splitlines()[0]
    return result


def _benchmark_rows(out_dir: str) -> List[dict]:
    """Rows of both benchmark files: pytest-benchmark's JSON (logits) and the JSON lines of the linear one."""
    rows = []
    path = os.path.join(out_dir, "benchmarks.json")
    if os.path.exists(path):
        with open(path) as f:
            for bench in json.load(f).get("benchmarks", []):
                row = {"test": bench.get("name"), "median_ms": bench["stats"]["median"] * 1e3}
                row.update(bench.get("extra_info", {}))
                rows.append(row)
    path = os.path.join(out_dir, "bench_linear.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows


def has_bench_gpu() -> bool:
    """Whether ``gspo-kernels bench --gpu`` exists in this copy of the library (``gspo_kernels.tools.bench_gpu``)."""
    import importlib.util

    return importlib.util.find_spec("gspo_kernels.tools.bench_gpu") is not None


def step_bench_gpu(out_dir: str, limit_s: float) -> StepResult:
    """``gspo-kernels bench --gpu --out <out>/bench_gpu --budget-s <the step's time less a margin>``: its result
    rows (``results``) become the measurements table, its targets a second table."""
    prefix = os.path.join(out_dir, "bench_gpu")
    budget = max(10.0, limit_s - 15.0)  # the interpreter start and the report writing fit in the margin
    result = _subprocess("benchmarks", [sys.executable, "-m", "gspo_kernels", "bench", "--gpu", "--out", prefix,
                                        "--budget-s", f"{budget:.0f}"], limit_s,
                         log_path=os.path.join(out_dir, "bench_gpu.log"))
    rows: List[dict] = []
    targets: List[dict] = []
    if os.path.exists(prefix + ".json"):
        with open(prefix + ".json") as f:
            payload = json.load(f)
        rows = [row for row in payload.get("results", []) if isinstance(row, dict)]
        targets = [t for t in payload.get("targets", []) if isinstance(t, dict)]
    result.data.update(rows=rows, targets=targets, file=prefix + ".json", command="gspo-kernels bench --gpu")
    result.summary = (f"bench --gpu: {len(rows)} measurements" + ("" if result.status == "ok" else f"; {result.summary}"))
    if result.status == "ok" and not rows:
        result.status = "failed"
        result.summary += " (nothing measured)"
    return result


def step_benchmarks(out_dir: str, limit_s: float) -> StepResult:
    if _mode["quick"] and has_bench_gpu():
        return step_bench_gpu(out_dir, limit_s)
    missing = _needs_tree("benchmarks")
    if missing:
        return missing
    env = _env()
    env["GSPO_BENCH_JSON"] = os.path.join(out_dir, "bench_linear.jsonl")
    if os.path.exists(env["GSPO_BENCH_JSON"]):
        os.remove(env["GSPO_BENCH_JSON"])
    files = [f for f in ("benchmarks/test_gpu_logits.py", "benchmarks/test_gpu_linear.py")
             if os.path.exists(os.path.join(_tree["root"], f))]
    # --quick: the headline cases only (the logits loss at Qwen's vocabulary, the one-call hidden-state loss
    # against plain PyTorch), not the sweeps and the peers
    select = ["-k", "(test_triton_gspo_loss and not gpt2) or test_one_call_loss_against_plain_pytorch"] \
        if _mode["quick"] else []
    result = _subprocess("benchmarks", [sys.executable, "-m", "pytest", *files, *select, "-q", "-s", "-rs", "-p",
                                        "no:cacheprovider",
                                        f"--benchmark-json={os.path.join(out_dir, 'benchmarks.json')}"],
                         limit_s, env=env)
    rows = _benchmark_rows(out_dir)
    result.data["rows"] = rows
    result.summary = f"{len(rows)} measurements" + ("" if result.status == "ok" else f"; {result.summary}")
    if result.status == "ok" and not rows:
        result.status = "failed"  # every benchmark skipped: nothing was measured
        result.summary += " (every benchmark skipped)"
    return result


STEP_FUNCTIONS: Dict[str, Callable[[str, float], StepResult]] = {
    "versions": step_versions,
    "h100-report": step_h100_report,
    "verify": step_verify,
    "gpu-tests": step_gpu_tests,
    "triton-tests": step_triton_tests,
    "memcheck": step_memcheck,
    "benchmarks": step_benchmarks,
    "cuda-graphs": lambda out_dir, limit_s: gpu_check_graphs.step(out_dir, limit_s, _subprocess),
    "suite": step_suite,
}
STEP_LIMITS_S = {"versions": 60, "h100-report": 300, "verify": 300, "gpu-tests": 300, "triton-tests": 300, "memcheck": 300,
                 "benchmarks": 600, "cuda-graphs": 300, "suite": 600}


def make_steps(names: Sequence[str], quick: bool = False) -> List[Step]:
    limits = QUICK_LIMITS_S if quick else STEP_LIMITS_S
    return [Step(name, STEP_FUNCTIONS[name], limits.get(name, STEP_LIMITS_S[name])) for name in names]


# --- running and reporting ---------------------------------------------------------------------------------


def run_steps(steps: Sequence[Step], out_dir: str, budget_s: float = DEFAULT_BUDGET_S,
              header: Optional[Dict[str, object]] = None) -> List[StepResult]:
    """Run ``steps`` in order within ``budget_s``; rewrite the JSON and Markdown reports after each one.

    A step that raises is a failed step (the exception is its summary); a step with no time left is
    "not run".
    """
    os.makedirs(out_dir, exist_ok=True)
    results: List[StepResult] = []
    deadline = time.monotonic() + budget_s
    for step in steps:
        left = deadline - time.monotonic()
        if left <= 1:
            results.append(StepResult(step.name, "not run", 0.0, "the time budget was spent"))
        else:
            start = time.perf_counter()
            print(f"gpu-check: {step.name} (at most {min(step.limit_s, left):.0f} s) ...", flush=True)
            try:
                result = step.run(out_dir, min(step.limit_s, left))
            except Exception as exc:
                result = StepResult(step.name, "failed", time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
            print(f"gpu-check: {step.name}: {result.status} ({result.seconds:.0f} s) {result.summary}", flush=True)
            results.append(result)
        write_reports(results, out_dir, header)
    return results


def exit_status(results: Sequence[StepResult]) -> int:
    return 1 if any(r.status in ("failed", "timeout") for r in results) else 0


# --- the command -------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.workload or getattr(args, "workload_quick", False):
        workload(loss_types=("grpo",) if not args.workload else None, objectives=bool(args.workload))
        print("gpu-check workload: done")
        return 0
    import torch

    quick = bool(getattr(args, "quick", False))
    _mode["quick"] = quick
    if args.budget_s is None:
        args.budget_s = QUICK_BUDGET_S if quick else DEFAULT_BUDGET_S
    try:
        names = parse_steps(args.steps)
    except ValueError as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 2
    if quick and args.steps == ",".join(ALL_STEPS):  # --quick without --steps: its own list
        names = list(QUICK_STEPS)
    out_dir = args.out if os.path.isabs(args.out) else os.path.join(os.getcwd(), args.out)
    _tree["root"] = find_test_tree(getattr(args, "tests_dir", None))
    has_gpu = torch.cuda.is_available()
    header = {"command": f"gspo-kernels gpu-check --out {args.out} --steps {','.join(names)}"
                         + (" --static-only" if args.static_only else "") + (" --quick" if quick else ""),
              "cuda_available": has_gpu, "budget_s": args.budget_s}
    if args.static_only:
        names = [n for n in names if n in STATIC_STEPS]
        header["mode"] = "static only: no GPU step ran"
    elif not has_gpu:
        print(f"gpu-check: no CUDA device on this machine (torch {torch.__version__}, built with CUDA "
              f"{torch.version.cuda}): nothing was measured. Run it on a machine with a GPU, or run "
              f"'gspo-kernels gpu-check --static-only' for the parts that need none.", file=sys.stderr)
        header["mode"] = "no CUDA device: nothing measured"
        os.makedirs(out_dir, exist_ok=True)
        write_reports([StepResult(n, "not run", 0.0, "no CUDA device") for n in names], out_dir, header)
        return 2
    results = run_steps(make_steps(names, quick), out_dir, args.budget_s, header)
    print(format_markdown(results, header))
    print(f"gpu-check: wrote {os.path.join(out_dir, 'gpu_check.json')} and gpu_check.md")
    return exit_status(results)
