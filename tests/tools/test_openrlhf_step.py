"""``benchmarks/openrlhf_step.py``'s GPU prediction: made where triton is installed, and where it is not, one line
saying so (the script still ends with status 0 after its measured table) instead of a ModuleNotFoundError."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.openrlhf_step import prediction_lines

ROOT = Path(__file__).resolve().parents[2]
# triton unimportable in a fresh interpreter: ``import triton`` raises ImportError.
WITHOUT_TRITON = ("import sys; sys.modules['triton'] = None\n"
                  "from benchmarks.openrlhf_step import prediction_lines\n"
                  "print('\\n'.join(prediction_lines()))\n")


def test_without_triton_the_prediction_says_it_is_not_made_and_exits_0():
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("PREDICTED on a GPU: not made here") and "triton" in lines[0], lines


def test_with_triton_the_prediction_names_both_sides_in_gib():
    lines = prediction_lines()
    heads = [line for line in lines if line.startswith("PREDICTED on a GPU, ")]
    assert [h.split(",")[1].split(":")[0].strip() for h in heads] == ["openrlhf", "gspo_kernels"], lines
    assert all(float(h.rsplit(" ", 2)[1]) > 0 for h in heads), heads
