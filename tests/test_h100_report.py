"""The static H100 report: every Triton kernel of the library compiles for sm_90a without spilling.

No GPU is needed (``triton.compile`` targets ``GPUTarget("cuda", 90, 32)`` on the CPU). The report runs
in a subprocess with the interpreter off, exactly as ``gspo-kernels h100-report`` does.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from gspo_kernels.tools import h100_report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_kernel(obj) -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return isinstance(obj, (JITFunction, InterpretedFunction))


def _kernel_modules():
    import gspo_kernels.backends.triton as package

    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"gspo_kernels.backends.triton.{info.name}")
        kernels = {name for name, obj in vars(module).items()
                   if _is_kernel(obj) and obj.fn.__module__ == module.__name__}
        if any(k.endswith("_kernel") for k in kernels):  # launched kernels, not only @jit helpers (addressing)
            yield module, kernels


def test_every_kernel_module_declares_its_launch_configs():
    """A module that defines ``@triton.jit`` kernels lists each launched kernel in ``H100_CONFIGS``."""
    seen = 0
    for module, kernels in _kernel_modules():
        configs = getattr(module, "H100_CONFIGS", None)
        assert configs, f"{module.__name__} defines Triton kernels but no H100_CONFIGS"
        covered = {config["fn"].__name__ for config in configs}
        top_level = {k for k in kernels if k.endswith("_kernel")}  # launched kernels, not @jit helpers
        assert top_level <= covered, f"{module.__name__}: kernels missing from H100_CONFIGS: {top_level - covered}"
        for config in configs:
            assert {"name", "fn", "signature", "constexprs", "num_warps", "num_stages"} <= set(config)
        seen += 1
    assert seen >= 3  # logprobs, logprobs_backward, sequence (and the hidden-state path's modules)


def test_failure_rules():
    ok = {"error": None, "local_bytes": 0, "uses_dot": True, "hgmma": True, "hmma": True, "vector_loads": True,
          "loads_128": True}
    assert h100_report.problems(ok) == []
    assert h100_report.problems(dict(ok, local_bytes=8))
    assert h100_report.problems(dict(ok, hgmma=False))
    assert h100_report.problems(dict(ok, loads_128=False))
    assert h100_report.problems(dict(ok, error="CompilationError: x"))
    usage = h100_report._resource_usage("Function k:\nREG:80 STACK:0 SHARED:1024 LOCAL:24 CONSTANT[0]:632\n")
    assert usage["REG"] == 80 and usage["LOCAL"] == 24


def test_h100_report_compiles_every_kernel_without_spills(tmp_path):
    if not os.path.exists(h100_report._cuobjdump()):
        pytest.skip("triton's bundled cuobjdump is missing")
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "gspo_kernels", "h100-report", "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    names = {row["name"] for row in rows}
    assert any(n.startswith("logprobs_fwd") for n in names) and any(n.startswith("logprobs_bwd") for n in names)
    assert any(n.startswith("gspo_sequence") for n in names) and any(n.startswith("gspo_reduce") for n in names)
    for row in rows:
        assert row["error"] is None, row
        assert row["local_bytes"] == 0, f"{row['name']} spills {row['local_bytes']} bytes"
        assert 0 < row["registers"] <= 255
        assert row["shared_bytes"] <= 227 * 1024
        if row["uses_dot"]:
            assert row["hgmma"], f"{row['name']} has no HGMMA"
        if row["vector_loads"]:
            assert row["loads_128"], f"{row['name']} has no 128-bit loads"
