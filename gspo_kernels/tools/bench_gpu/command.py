"""The subcommand ``gspo-kernels bench --gpu`` (its flags live in bench.py's parser)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Dict, List

from .driver import run_section, run_trl_step
from .plan import DEFAULT_BUDGET_S, PEERS, SECTION_LIMIT_S, SECTION_MIN_S, SECTIONS
from .report import add_ratios, evaluate_targets, table_lines, target_lines, write_outputs
from .sections import SECTION_FUNCS

# ---------------------------------------------------------------------------------------------------------
# The subcommand (``gspo-kernels bench --gpu``; the flags live in bench.py's parser).
# ---------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bench --gpu`` (``--gpu``, ``--device`` and ``--out`` are bench's)."""
    parser.add_argument("--tiny", action="store_true", help="with --gpu: tiny shapes (a smoke run, no targets judged)")
    parser.add_argument("--sections", default=None,
                        help=f"with --gpu: comma-separated sections to run (default: all: {','.join(SECTIONS)})")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"with --gpu: the run's time budget in seconds (default {DEFAULT_BUDGET_S:g})")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"with --gpu: comma-separated optional peers to time (default: {','.join(PEERS)})")


def run(args: argparse.Namespace) -> int:
    device = getattr(args, "device", None) or "cuda"
    tiny = bool(getattr(args, "tiny", False))
    out = getattr(args, "out", None) or "results/bench_gpu"
    if out == "results/bench":  # bench's own default
        out = "results/bench_gpu"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gspo-kernels bench --gpu: no CUDA device here (torch.cuda.is_available() is False); nothing "
                  "measured. Run it on a GPU machine.", file=sys.stderr)
            return 2
    elif device != "cpu" or not tiny:
        print(f"gspo-kernels bench --gpu: measures on CUDA; --device {device} is accepted only as '--device cpu "
              "--tiny' (a smoke test of the code paths)", file=sys.stderr)
        return 2
    sections = SECTIONS
    if getattr(args, "sections", None):
        sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
        unknown = [s for s in sections if s not in SECTIONS]
        if unknown:
            print(f"--sections: unknown {unknown}; choose among {list(SECTIONS)}", file=sys.stderr)
            return 2
    peers = tuple(p.strip() for p in str(getattr(args, "peers", ",".join(PEERS))).split(",") if p.strip())
    if any(p not in PEERS for p in peers):
        print(f"--peers: choose among {list(PEERS)}; got {list(peers)}", file=sys.stderr)
        return 2
    budget = float(getattr(args, "budget_s", DEFAULT_BUDGET_S))
    start = time.time()
    command = "gspo-kernels " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "gspo-kernels bench --gpu"
    print(f"gspo-kernels bench --gpu: device {device}{' (tiny smoke run: not a measurement)' if tiny else ''}, "
          f"sections {', '.join(sections)}, budget {budget:.0f} s", flush=True)
    runs: List[Dict] = []
    rows: List[Dict] = []
    payload: Dict = {}

    def save() -> None:
        env = next((r.get("environment") for r in rows if r.get("case") == "environment"), None)
        data = [r for r in rows if r.get("case") != "environment"]
        add_ratios(data)
        payload.clear()
        payload.update(command=command, device=device, tiny=tiny, environment=env, elapsed_s=time.time() - start,
                       budget_s=budget, sections=[{k: v for k, v in s.items() if k != "rows"} for s in runs],
                       method=dict(timing="CUDA events; median of 5 after 2 warm-ups unless a row says otherwise",
                                   peak="torch.cuda.max_memory_allocated above the allocation at the step's start",
                                   flops="6*N*H*V per fwd+bwd step", floor="3*N*V*itemsize bytes at the copy bandwidth",
                                   host="issue time of one call with the GPU held busy by a spin kernel"),
                       results=data, targets=evaluate_targets(data))
        write_outputs(out, payload)

    # A --tiny smoke run groups the in-process sections into one subprocess (interpreter starts are most of it).
    grouped = [s for s in sections if s in SECTION_FUNCS] if tiny else []
    for section in sections:
        if section in grouped[1:]:
            continue
        left = budget - (time.time() - start)
        limit = SECTION_LIMIT_S[section] if not tiny else 120.0
        if left < (SECTION_MIN_S[section] if not tiny else 5.0):
            runs.append(dict(section=section, status=f"skipped: {left:.0f} s of the budget left", seconds=0.0))
            rows.append(dict(section=section, case="(section)", status="skipped", reason="time budget"))
            print(f"[{section}] skipped: {left:.0f} s of the budget left", flush=True)
            continue
        limit = min(limit, left)
        print(f"[{section}] (limit {limit:.0f} s)", flush=True)
        if section == "trl-step":
            result = run_trl_step(device, tiny, limit)
        else:
            result = run_section(section, device, tiny, limit, group=grouped[1:] if section in grouped else (),
                                 peers=peers)
        runs.append(result)
        rows.extend(result["rows"])
        print(f"[{section}] {result['status']} in {result['seconds']:.0f} s", flush=True)
        save()
    save()
    print("\n".join(table_lines(payload["results"], markdown=False)))
    print("\n".join(target_lines(payload["targets"], markdown=False)))
    print(f"\nwrote {out}.json and {out}.md ({payload['elapsed_s']:.0f} s)")
    failed = any(r.get("status") == "error" for r in payload["results"]) or any(
        not str(s.get("status", "")).startswith(("ok", "skipped")) for s in runs)
    return 1 if failed else 0
