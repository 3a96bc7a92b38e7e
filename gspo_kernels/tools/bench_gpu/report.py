"""The run's ratios, its targets (met / MISSED), the tables and the JSON / Markdown outputs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from typing import Dict, List, Optional

from gspo_kernels.tools.table import Column, markdown_header, markdown_row, text_header, text_row

from .plan import SECTIONS, TARGETS


def _find(rows: List[Dict], section: str, prefix: str) -> Optional[Dict]:
    for r in rows:
        if r.get("section") == section and str(r.get("case", "")).startswith(prefix) and r.get("status") == "ok":
            return r
    return None


def _ratio(a: Optional[Dict], b: Optional[Dict], key: str = "ms") -> Optional[float]:
    if a is None or b is None or a.get(key) is None or not b.get(key):
        return None
    return a[key] / b[key]


def add_ratios(rows: List[Dict]) -> None:
    """Each row's ``x_plain`` (ms over the plain PyTorch row of its group) in place."""
    groups = {
        "hidden": ("plain PyTorch, all rows", lambda c: "half zero advantage" not in c),
        "hidden-half": ("plain PyTorch, half zero advantage", lambda c: "half zero advantage" in c),
    }
    for r in rows:
        if r.get("status") != "ok" or "ms" not in r or r["case"].startswith(("ceiling", "forward")):
            continue
        section, case = r["section"], r["case"]
        if section == "hidden":
            key = "hidden-half" if groups["hidden-half"][1](case) else "hidden"
            base = _find(rows, "hidden", groups[key][0])
        elif section == "logits":
            base = _find(rows, "logits", f"plain PyTorch, V={r.get('V')}")
        elif section == "torch-backend":
            base = _find(rows, "torch-backend", f"plain PyTorch, {r.get('shape')}")
        elif section == "trl-step":
            base = _find(rows, "trl-step", "stock")
        else:
            base = None
        r["x_plain"] = _ratio(r, base)
    fwd_ours = _find(rows, "hidden", "forward: ours")
    fwd_trl = _find(rows, "hidden", "forward: TRL")
    if fwd_ours:
        fwd_ours["x_trl_forward"] = _ratio(fwd_ours, fwd_trl)


def evaluate_targets(rows: List[Dict]) -> List[Dict]:
    """The targets (``plan.TARGETS``) as (value, limit, met); a target whose rows are missing is 'not measured'."""
    f = lambda section, prefix: _find(rows, section, prefix)  # noqa: E731
    ours_all, ours_half = f("hidden", "ours fused_linear_gspo_loss, all"), f("hidden", "ours fused_linear_gspo_loss, half")
    plain_all, plain_half = f("hidden", "plain PyTorch, all"), f("hidden", "plain PyTorch, half")
    peaks = [r["peak_extra_gib"] for r in (ours_all, ours_half) if r and r.get("peak_extra_gib") is not None]
    trl_stock, trl_ours = f("trl-step", "stock"), f("trl-step", "drop-in")
    logits = {}
    for r in rows:
        if r.get("section") == "logits" and r.get("status") == "ok" and str(r["case"]).startswith("ours"):
            logits[r["V"]] = r
    big = logits.get(max(logits)) if logits else None
    small = logits.get(min(logits)) if len(logits) > 1 else None

    def host(r):
        if r is None or r.get("issue_ms") is None:
            return None
        return r["issue_ms"]

    def floor_share(r, need):
        return need / r["of_floor"] if r is not None and r.get("of_floor") else None

    values = {
        "hidden_all": _ratio(ours_all, plain_all),
        "hidden_half": _ratio(ours_half, plain_half),
        "hidden_peak": max(peaks) if peaks else None,
        "two_pass_fwd": _ratio(f("hidden", "forward: ours"), f("hidden", "forward: TRL")),
        "trl_time": _ratio(trl_ours, trl_stock),
        "trl_peak": _ratio(trl_ours, trl_stock, "peak_extra_gib"),
        "logits_host": host(big),
        "logits_host_small": host(small),
        "logits_floor": floor_share(big, 0.85),
        "logits_floor_small": floor_share(small, 0.75),
        "torch_logits": _ratio(f("torch-backend", "ours backend='torch', logits"),
                               f("torch-backend", "plain PyTorch, logits")),
        "torch_hidden": _ratio(f("torch-backend", "ours backend='torch', hidden"),
                               f("torch-backend", "plain PyTorch, hidden")),
    }
    out = []
    for key, text, limit in TARGETS:
        value = values.get(key)
        status = "not measured" if value is None else ("met" if value <= limit else "MISSED")
        note = None
        if key.startswith("logits_host") and (big if key == "logits_host" else small) is not None:
            r = big if key == "logits_host" else small
            if r.get("waited_on_device"):
                note = "issued from an idle GPU: the call's one host read waits for a busy GPU"
        out.append(dict(key=key, target=text, value=value, limit=limit, status=status, note=note))
    return out


def _fmt(x, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else str(x)


COLUMNS = (("ms", "ms", ".2f"), ("x_plain", "x plain", ".3f"), ("tflops", "TFLOP/s", ".0f"),
           ("of_floor", "of floor", ".2f"), ("peak_extra_gib", "peak extra GiB", ".2f"),
           ("kernel_ms", "kernel ms", ".2f"), ("issue_ms", "host issue ms", ".3f"),
           ("sync_ops_per_call", "sync ops", "d"))
# The text table: the case (cut to 58 characters), then the columns above, each 14 wide.
TEXT_COLUMNS = (Column("case", 58, "<", clip=True), *(Column(title, 14) for _, title, _ in COLUMNS))


# The notes of a row, in order: (field, the note shown when the row has the field (not None or False), formatted
# from the row).
NOTES = (
    ("dh_rel_err_vs_plain", "dH/dW rel err vs plain {dh_rel_err_vs_plain:.1e}/{dw_rel_err_vs_plain:.1e}"),
    ("of_gemm_ceiling", "{of_gemm_ceiling:.2f} of the GEMM ceiling"),
    ("wall_minus_kernel_ms", "wall - kernels {wall_minus_kernel_ms:.2f} ms"),
    ("profiled_wall_ms", "profiled step: wall {profiled_wall_ms:.2f} ms"),
    ("before_first_op_ms", "{before_first_op_ms:.2f} ms to its first device op, "
                           "{idle_after_first_op_ms:.2f} ms idle after it"),
    ("waited_on_device", "host issue from an idle GPU (its host read waits behind a busy GPU)"),
    ("x_trl_forward", "{x_trl_forward:.3f}x TRL's forward"),
    ("tb_s", "{tb_s:.2f} TB/s"),
    ("old_ms", "old-log-prob pass {old_ms:.1f} ms; loss {loss:.6f}"),
)


def table_lines(rows: List[Dict], markdown: bool) -> List[str]:
    lines: List[str] = []
    sections = [s for s in SECTIONS if any(r.get("section") == s for r in rows)]
    for section in sections:
        srows = [r for r in rows if r.get("section") == section and r.get("status") != "info"]
        if markdown:
            lines += [f"### {section}", "", *markdown_header(["case", *(c[1] for c in COLUMNS), "notes"])]
        else:
            lines += ["", f"== {section}", text_header(TEXT_COLUMNS)]
        for r in srows:
            if r.get("status") != "ok":
                cells, notes = ["-"] * len(COLUMNS), f"{r.get('status')}: {r.get('reason', '')}"
            else:
                cells = [_fmt(r.get(k), spec) for k, _, spec in COLUMNS]
                extra = [note.format_map(r) for key, note in NOTES if r.get(key) is not None and r.get(key) is not False]
                if r.get("note"):
                    extra.append(r["note"])
                notes = "; ".join(extra)
            if markdown:
                lines.append(markdown_row([r["case"], *cells, notes]))
            else:
                lines.append(text_row(TEXT_COLUMNS, [r["case"], *cells], tail=notes))
        if markdown:
            lines.append("")
    return lines


def target_lines(targets: List[Dict], markdown: bool) -> List[str]:
    lines = ["", "### targets (this run)" if markdown else "targets (this run):", ""]
    if markdown:
        lines += markdown_header(["target", "value", "limit", "status"])
    for t in targets:
        value = _fmt(t["value"], ".3f")
        note = f" ({t['note']})" if t.get("note") else ""
        if markdown:
            lines.append(markdown_row([t["target"], value, t["limit"], f"{t['status']}{note}"]))
        else:
            lines.append(f"  [{t['status']:>12}] {t['target']}: {value}{note}")
    return lines


def _git_commit() -> Optional[str]:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=20,
                              cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def write_outputs(out: str, payload: Dict) -> None:
    """``out``.json (the payload, with ``time_utc``, when it was written, and ``git_commit``, the checkout's commit,
    added where missing: a record's date and code) and ``out``.md."""
    payload.setdefault("time_utc", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    payload.setdefault("git_commit", _git_commit())
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(payload, f, indent=1, default=float)
    env = payload.get("environment") or {}
    md = [f"# gspo-kernels bench --gpu: {env.get('device_name', payload.get('device'))}", "",
          f"Command: `{payload['command']}`; {payload['time_utc']}, commit {payload['git_commit']}; "
          f"{payload['elapsed_s']:.0f} s. Versions: "
          + ", ".join(f"{k} {v}" for k, v in (env.get("versions") or {}).items() if v) + ".", "",
          "Method: CUDA events, median of 5 after 2 warm-ups (fewer where the JSON says), gradients set to None "
          "before each step; peak extra = max allocated above the step's start; TFLOP/s on 6NHV.", ""]
    if payload.get("tiny"):
        md.insert(1, "**--tiny smoke run: not a measurement.**\n")
    md += table_lines(payload["results"], markdown=True)
    md += target_lines(payload["targets"], markdown=True)
    with open(out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
