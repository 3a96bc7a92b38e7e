"""gpu-check's record of a run: one :class:`StepResult` per step, written to ``gpu_check.json`` and ``gpu_check.md``."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional, Sequence


@dataclass
class StepResult:
    """The outcome of one step: ``status`` is ok, failed, timeout, skipped or not run."""

    name: str
    status: str
    seconds: float = 0.0
    summary: str = ""
    data: Dict[str, object] = field(default_factory=dict)
    output_tail: str = ""


def write_reports(results: Sequence[StepResult], out_dir: str, header: Optional[Dict[str, object]] = None) -> None:
    """``gpu_check.json`` (everything) and ``gpu_check.md`` (one table of steps, one of measurements)."""
    header = dict(header or {})
    header.setdefault("written_utc", time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump({"header": header, "steps": [asdict(r) for r in results]}, f, indent=1, default=str)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(format_markdown(results, header))


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value).replace("|", "/").replace("\n", " ")


BENCH_COLUMNS = ("case", "impl", "test", "active_share", "median_ms", "ms", "fwd_ms", "bwd_ms", "GB_s",
                 "fraction_of_hbm_peak", "tflops_8nhv", "bwd_tflops_6nhv", "bwd_tflops_6nhv_active",
                 "share_of_790", "device")


def format_markdown(results: Sequence[StepResult], header: Optional[Dict[str, object]] = None) -> str:
    lines = ["# gspo-kernels gpu-check", ""]
    for key, value in (header or {}).items():
        lines.append(f"- {key}: {_cell(value)}")
    lines += ["", "| step | status | seconds | summary |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.0f} | {_cell(r.summary)} |")
    rows = [row for r in results if r.name == "benchmarks" for row in r.data.get("rows", [])]
    if rows:
        columns = [c for c in BENCH_COLUMNS if any(c in row for row in rows)]
        lines += ["", "## Measurements", "", "| " + " | ".join(columns) + " |",
                  "|" + "---|" * len(columns)]
        for row in rows:
            lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
    targets = [t for r in results if r.name == "benchmarks" for t in r.data.get("targets", [])]
    if targets:
        lines += ["", "## Targets (bench --gpu)", "", "| target | value | limit | status |", "|---|---|---|---|"]
        for t in targets:
            lines.append(f"| {_cell(t.get('target', ''))} | {_cell(t.get('value', ''))} | {_cell(t.get('limit', ''))} "
                         f"| {_cell(t.get('status', ''))} |")
    failing = [r for r in results if r.status in ("failed", "timeout") and r.output_tail]
    for r in failing:
        lines += ["", f"## {r.name}: last output", "", "```", r.output_tail[-2000:], "```"]
    return "\n".join(lines) + "\n"
