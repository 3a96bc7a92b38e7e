"""The driver (the parent process: never touches the GPU itself): each section in a fresh subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Sequence

from .measure import _brief
from .plan import PEERS, RESULT, ROOT

# ---------------------------------------------------------------------------------------------------------
# The driver (the parent process: never touches the GPU itself).
# ---------------------------------------------------------------------------------------------------------


def _env_for_children() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _parse_rows(stdout) -> List[Dict]:
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    rows = []
    for line in (stdout or "").splitlines():
        if line.startswith(RESULT):
            try:
                rows.append(json.loads(line[len(RESULT):]))
            except json.JSONDecodeError:
                pass
    return rows


def run_section(section: str, device: str, tiny: bool, limit_s: float, group: Sequence[str] = (),
                peers: Sequence[str] = PEERS) -> Dict:
    """``section`` (and the sections of ``group`` after it) in a fresh process: the rows, the exit status
    and the seconds (on a timeout, the rows streamed so far)."""
    spec = json.dumps(dict(sections=[section, *group], device=device, tiny=tiny, peers=list(peers),
                           deadline=time.time() + limit_s - 5.0))
    cmd = [sys.executable, "-c", "from gspo_kernels.tools.bench_gpu.sections import _section_main; _section_main()"]
    start = time.time()
    try:
        proc = subprocess.run(cmd, input=spec, stdout=subprocess.PIPE, stderr=None, text=True, timeout=limit_s,
                              env=_env_for_children())
        rows, status = _parse_rows(proc.stdout), ("ok" if proc.returncode == 0 else f"exit {proc.returncode}")
    except subprocess.TimeoutExpired as exc:
        rows, status = _parse_rows(exc.stdout), f"timed out after {limit_s:.0f} s"
    return dict(section=section, status=status, seconds=time.time() - start, rows=rows)


def run_trl_step(device: str, tiny: bool, limit_s: float) -> Dict:
    """benchmarks/trl_step.py for stock TRL then the drop-in, each in a fresh process."""
    start = time.time()
    script = os.path.join(ROOT, "benchmarks", "trl_step.py")
    rows: List[Dict] = []
    reason = None
    try:
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            reason = "trl not installed"
    except Exception as exc:  # a broken trl install
        reason = f"trl not importable ({exc})"
    if reason is None and not os.path.exists(script):
        reason = f"{script} not found (needs a source checkout)"
    if reason is not None:
        rows.append(dict(section="trl-step", case="stock TRL vs drop-in", status="skipped", reason=reason))
        sys.stderr.write(f"  trl-step: skipped: {reason}\n")
        return dict(section="trl-step", status="skipped", seconds=0.0, rows=rows)
    precision = "bf16" if device == "cuda" else "fp32"
    status = "ok"
    # the drop-in as it comes, then with gspo_one_pass=True (the loss inside the forward: the check on the default)
    cases = (("trl", "stock trl.GRPOTrainer", []), ("gspo", "drop-in integrations.trl.GRPOTrainer", []),
             ("gspo", "drop-in, gspo_one_pass=True", ["--one-pass"]))
    for case, name, options in cases:
        left = limit_s - (time.time() - start)
        if left < 10:
            rows.append(dict(section="trl-step", case=name, status="skipped", reason="time budget"))
            continue
        cmd = [sys.executable, script, "--case", case, "--precision", precision, "--device", device,
               "--shape", "tiny" if tiny else "client", "--repeats", "3", *options]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=_env_for_children())
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode == 0 and lines:
                figures = json.loads(lines[-1])
                figures["trainer"] = figures.pop("case")
                row = dict(section="trl-step", case=name, status="ok", **figures)
                row["ms"] = row["step_s"] * 1e3
                row["old_ms"] = row["old_s"] * 1e3
                row["peak_extra_gib"] = row["peak_mb"] / 1024
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                row = dict(section="trl-step", case=name, status="error",
                           reason=f"exit {proc.returncode}: {' | '.join(tail)[:400]}")
                status = "error"
        except subprocess.TimeoutExpired:
            row = dict(section="trl-step", case=name, status="error", reason=f"timed out after {left:.0f} s")
            status = "error"
        rows.append(row)
        sys.stderr.write(f"  trl-step / {name}: {_brief(row)}\n")
    return dict(section="trl-step", status=status, seconds=time.time() - start, rows=rows)

