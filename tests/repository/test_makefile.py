"""The README's two commands, as the Makefile spells them (``make -n``: the commands, none run): ``make demo``
installs only what the demo runs and ends by naming its results; ``make test`` installs the test peers too."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEST_PEERS = ("trl", "liger", "cut-cross-entropy", "megatron-core", "verl", "ray", "hydra")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _commands(target: str, venv: Path) -> str:
    """What ``make target`` would run for a virtual environment not built yet."""
    # --no-print-directory: under `make test` (MAKELEVEL set) a sub-make would add "Entering / Leaving directory"
    return subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={venv}"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout


def test_make_demo_installs_no_test_peer_and_says_where_its_results_are(tmp_path):
    demo = _commands("demo", tmp_path / "venv")
    installs = [line for line in demo.splitlines() if "pip install" in line and not line.startswith("echo")]
    assert len(installs) >= 4, demo
    for line in installs:
        assert not [peer for peer in TEST_PEERS if peer in line], line
        assert line.rstrip().endswith('|| true; }') and "is ignored" in line, line  # pip's location notes left out
    assert "gspo-kernels verify" in demo and "gspo-kernels bench --quick" in demo
    assert "results/bench.json" in demo.splitlines()[-3] + demo.splitlines()[-2]  # its last words name its results


def test_make_test_still_installs_every_test_peer(tmp_path):
    test = _commands("test", tmp_path / "venv")
    installs = " ".join(line for line in test.splitlines() if "pip install" in line)
    assert not [peer for peer in TEST_PEERS if peer not in installs], installs
