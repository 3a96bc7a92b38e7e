"""The tested floors: an older triton is refused by name (one warning, ``"auto"`` runs torch; an explicit
``backend="triton"`` raises), never with a compile error from inside a kernel. The old version is faked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import backends, versions

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, parsed", [("3.4.0", (3, 4, 0)), ("3.10.1+git5ab2", (3, 10, 1)), ("2.8.0+cu128", (2, 8, 0)),
                                          ("3.5", (3, 5)), ("3.6.0rc1", (3, 6, 0))])
def test_parse_reads_the_numeric_release(text, parsed):
    assert versions.parse(text) == parsed


def test_parse_refuses_a_string_without_a_version():
    with pytest.raises(ValueError, match="version"):
        versions.parse("unknown")


@pytest.mark.parametrize("installed", ["3.4.0", "3.4.1", "3.6.0", "3.10.0", "4.0.0+git1"])
def test_triton_at_or_above_the_floor_is_accepted(installed):
    assert versions.triton_problem(installed) is None
    versions.check_triton(installed)


@pytest.mark.parametrize("installed", ["3.3.1", "3.2.0", "2.3.1", "3.3.0+gitabc"])
def test_older_triton_is_refused_naming_both_versions(installed):
    problem = versions.triton_problem(installed)
    assert problem is not None and installed in problem and "triton>=3.4" in problem and "backend='torch'" in problem
    with pytest.raises(versions.UnsupportedVersion, match=r"triton>=3\.4"):
        versions.check_triton(installed)


def test_the_declared_torch_floor_is_the_floor_the_code_states():
    text = (ROOT / "pyproject.toml").read_text()
    floor = ".".join(map(str, versions.MIN_TORCH))
    assert f'"torch>={floor}"' in text


@pytest.fixture
def old_triton(monkeypatch):
    """A fresh backend registry with the imported triton claiming to be 3.3.1."""
    monkeypatch.setattr(triton, "__version__", "3.3.1")
    monkeypatch.setattr(backends, "_cache", {})
    monkeypatch.setattr(backends, "_errors", {})
    monkeypatch.setattr(backends, "_announced", set())
    return monkeypatch


def test_old_triton_makes_the_backend_unavailable_with_one_warning_and_auto_runs_torch(old_triton):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = backends.load("triton")
        again = backends.load("triton")
        names = gk.available_backends("cuda")
        chosen = backends.resolve("auto", torch.device("cuda"))
    assert first is None and again is None
    assert "triton" not in names and "torch" in names
    assert chosen.name == "torch"
    ours = [w for w in caught if "backend 'triton'" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    assert "3.3.1" in str(ours[0].message) and "triton>=3.4" in str(ours[0].message)


def test_old_triton_asked_for_by_name_raises_naming_both_versions(old_triton):
    with pytest.warns(RuntimeWarning, match="backend 'triton' is unavailable"):
        with pytest.raises(RuntimeError, match=r"triton 3\.3\.1 is installed.*triton>=3\.4"):
            backends.resolve("triton", torch.device("cuda"))


def test_current_triton_loads_without_a_warning(monkeypatch):
    monkeypatch.setattr(backends, "_cache", {})
    monkeypatch.setattr(backends, "_errors", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backends.load("triton") is not None
    assert not [w for w in caught if "backend 'triton'" in str(w.message)]


_PROBE = r"""
import json, sys, os
import triton
triton.__version__ = "3.2.0"
import torch
import gspo_kernels as gk
logits, labels = torch.randn(4, 9), torch.randint(0, 9, (4,))
out = {}
try:
    gk.token_logprobs(logits, labels, backend="triton")
    out["error"] = None
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
out["kernel_modules"] = sorted(m for m in sys.modules if m.startswith("gspo_kernels.backends.triton."))
print(json.dumps(out))
"""


def test_an_explicit_triton_call_on_an_old_triton_fails_before_any_kernel_module_is_imported():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["error"] is not None and out["error"].startswith("RuntimeError")
    assert "triton 3.2.0 is installed" in out["error"] and "triton>=3.4" in out["error"]
    assert out["kernel_modules"] == [], out["kernel_modules"]
