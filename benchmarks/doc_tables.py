"""The measured tables of README.md and docs/*.md, rendered from their recorded results (docs/records/*.json and the
records the bench commands write), each under a line naming its machine, date and command.

A table the docs quote sits in a marked region of the Markdown::

    <!-- table: docs/records/h200_2026-11-26.json#hidden_summary rows=1-6 -->
    ...what this module renders from that record (the provenance line, the table)...
    <!-- end table -->

``rows=a-b`` (optional, 0-based, inclusive) keeps a slice of the table's rows (the README quotes a part of a table).

A record is one JSON file, either

- written by a command: ``gspo-kernels bench --out`` (``results``: one row per case and implementation; rendered as
  ``#<case>``), ``gspo-kernels bench --scaling`` (``records``; rendered as ``#slopes``) or ``gspo-kernels bench
  --gpu`` (``results`` with a ``section`` each; rendered as ``#<section>``, the columns of its own report). Its
  command, date (``environment.time_utc`` or ``time_utc``), device and versions are the command's own; the label of
  the machine (docs/machines.md) is added when it is recorded (``record`` below); or
- transcribed once from a run whose raw output is gone: ``machine``, ``device``, ``date``, ``command``, ``versions``,
  ``transcribed_from`` (what the figures were copied from) and ``tables`` (``{name: {columns, rows}}``: every cell as
  the run's report wrote it; a table's own ``command`` / ``date`` / ``note`` override the record's).

Commands (from the checkout's root)::

    python benchmarks/doc_tables.py            # rewrite every marked region of README.md and docs/*.md
    python benchmarks/doc_tables.py --check    # list the regions that differ from their records (exit 1), write nothing
    python benchmarks/doc_tables.py record results/bench.json docs/records/cpu-e_2026-12-06_bench_quick.json \\
        --machine CPU-E                        # copy a command's record into the docs, with its machine's label

``make doc-tables`` runs the first. tests/repository/test_doc_tables.py holds every region equal to its record.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
BEGIN = re.compile(r"^<!-- table: (?P<path>[^#\s]+)#(?P<table>[\w-]+)(?: rows=(?P<a>\d+)-(?P<b>\d+))? -->$")
END = "<!-- end table -->"
MACHINES = "docs/machines.md"


class RecordError(ValueError):
    """A record that lacks what a table or its provenance needs, or a region that names no record / table."""


def documents(root: Path = ROOT) -> List[Path]:
    """The files whose regions are rendered: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def machine_labels(root: Path = ROOT) -> List[str]:
    """The labels of the machines' table of docs/machines.md (its first column)."""
    labels = []
    for line in (root / MACHINES).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("label", "") and not set(cells[0]) <= set("-"):
            labels.append(cells[0])
    return labels


def load(path: str, root: Path = ROOT) -> Dict:
    file = root / path
    if not file.is_file():
        raise RecordError(f"{path}: no such record")
    return json.loads(file.read_text())


# ---------------------------------------------------------------------------------------------------------------
# Provenance: machine, device, date, command, versions.
# ---------------------------------------------------------------------------------------------------------------


def provenance(record: Dict) -> Dict:
    """``machine`` (label of docs/machines.md), ``device``, ``date`` (YYYY-MM-DD), ``command``, ``versions`` (dict)
    and ``transcribed_from`` (None for a command's own record) of a record; a missing one is None."""
    env = record.get("environment") or {}
    stamp = record.get("date") or env.get("time_utc") or record.get("time_utc")
    return dict(machine=record.get("machine"), device=record.get("device") or env.get("device_name"),
                date=str(stamp)[:10] if stamp else None, command=record.get("command"),
                versions=record.get("versions") or env.get("versions") or {},
                transcribed_from=record.get("transcribed_from"))


def provenance_problems(record: Dict, labels: Sequence[str]) -> List[str]:
    """What a record lacks: a machine labelled in docs/machines.md, a date, a command, a device."""
    prov, problems = provenance(record), []
    for key in ("machine", "date", "command", "device"):
        if not prov[key]:
            problems.append(f"no {key}")
    if prov["machine"] and prov["machine"] not in labels:
        problems.append(f"machine {prov['machine']!r} is not a label of {MACHINES} ({', '.join(labels)})")
    if prov["date"] and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", prov["date"]):
        problems.append(f"date {prov['date']!r} is not YYYY-MM-DD")
    return problems


def provenance_line(record: Dict, path: str, table: Dict) -> str:
    """The line above a table: ``Measured on <machine> of docs/machines.md (<device>; <versions>), <date>:
    `<command>`; <note>. Record: <path>[, transcribed from ...].``"""
    prov = provenance(record)
    versions = prov["versions"]
    gpu = "cuda" in str(versions.get("torch", "")) or "NVIDIA" in str(prov["device"])
    shown = [f"{name} {versions[name]}" for name in (("torch", "triton") if gpu else ("torch",)) if versions.get(name)]
    device = "; ".join([str(prov["device"]), ", ".join(shown)] if shown else [str(prov["device"])])
    command = table.get("command") or prov["command"]
    date = table.get("date") or prov["date"]
    note = f"; {table['note']}" if table.get("note") else ""
    source = f", transcribed from {prov['transcribed_from']}" if prov["transcribed_from"] else ""
    return (f"Measured on {prov['machine']} of {MACHINES} ({device}), {date}: `{command}`{note}. "
            f"Record: {path}{source}.")


# ---------------------------------------------------------------------------------------------------------------
# Tables: (columns, rows of cell strings) from each kind of record.
# ---------------------------------------------------------------------------------------------------------------


def _num(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _bench_table(record: Dict, case: str) -> Dict:
    """``gspo-kernels bench``'s rows of one case: ms (fwd, bwd, total: the medians), peak extra MB, x plain."""
    rows = [r for r in record["results"] if r.get("case") == case]
    if not rows:
        raise RecordError(f"no case {case!r} (cases: {sorted({r.get('case') for r in record['results']})})")
    plain = next((r for r in rows if r["impl"] == "plain-torch" and r.get("status") == "ok"), None)
    cells = []
    for r in rows:
        if r.get("status") != "ok":
            cells.append([r["impl"], "-", "-", "-", "-", f"{r.get('status')}: {r.get('reason')}"])
            continue
        peak = None if r.get("peak_extra_bytes") is None else r["peak_extra_bytes"] / 2**20
        ratio = _num(r["total_ms"] / plain["total_ms"], ".2f") if plain else "-"
        cells.append([r["impl"], _num(r["fwd_ms"], ".0f"), _num(r["bwd_ms"], ".0f"), _num(r["total_ms"], ".0f"),
                      _num(peak, ".0f"), ratio])
    spec = rows[0].get("case_spec") or {}
    shape = ", ".join(f"{k} = {v}" for k, v in spec.items() if k != "path")
    return dict(columns=["implementation", "fwd ms", "bwd ms", "total ms", "peak extra MB", "x plain"], rows=cells,
                note=f"case `{case}` ({spec.get('path')} path, {shape}), medians of {record.get('repeats')} timed steps")


def _scaling_table(record: Dict, name: str) -> Dict:
    """``bench --scaling``'s ``#slopes``: per implementation and path, the log-log slope of peak memory against
    tokens and the peak / time at the largest token count of the series at the fixed vocabulary."""
    if name != "slopes":
        raise RecordError(f"a bench --scaling record renders #slopes, not #{name}")
    plan, cells = record["plan"], []
    top = max(plan["tokens"])
    for path, slopes in record["slopes_peak_vs_tokens"].items():
        for impl, slope in slopes.items():
            r = next((r for r in record["records"] if r["impl"] == impl and r["path"] == path and r["tokens"] == top
                      and r["vocab"] == plan["vocab_fixed"]), None)
            ok = r is not None and r.get("status") == "ok"
            cells.append([impl, path, _num(slope, ".2f"), _num(r["peak_mb"], ".0f") if ok else "-",
                          _num(r["ms"], ".0f") if ok else "-"])
    return dict(columns=["implementation", "path", "slope of peak memory against N",
                         f"peak MB at N = {top}", f"ms at N = {top}"], rows=cells,
                note=f"V = {plan['vocab_fixed']}, H = {plan['hidden']}, {plan['dtype']}, N = "
                     + " -> ".join(str(n) for n in plan["tokens"]))


def _bench_gpu_table(record: Dict, section: str) -> Dict:
    """``bench --gpu``'s rows of one section, with the columns and notes of its own report."""
    from gspo_kernels.tools.bench_gpu.report import COLUMNS, table_lines

    rows = [r for r in record["results"] if r.get("section") == section]
    if not rows:
        raise RecordError(f"no section {section!r}")
    lines = [line for line in table_lines(rows, markdown=True) if line.startswith("| ")][1:]  # less the titles
    cells = [[c.strip() for c in line.strip()[2:-2].split(" | ")] for line in lines]
    return dict(columns=["case", *(c[1] for c in COLUMNS), "notes"], rows=cells)


def table_of(record: Dict, name: str) -> Dict:
    """The table ``name`` of ``record``: ``{columns, rows, note?, command?, date?}``."""
    if "tables" in record:
        if name not in record["tables"]:
            raise RecordError(f"no table {name!r} (tables: {sorted(record['tables'])})")
        return record["tables"][name]
    if "slopes_peak_vs_tokens" in record:
        return _scaling_table(record, name)
    if "work_formulas" in record:
        return _bench_table(record, name)
    if "sections" in record and "results" in record:
        return _bench_gpu_table(record, name)
    raise RecordError("not a record this module knows (no tables, results or slopes)")


def render(path: str, name: str, rows: Optional[Tuple[int, int]] = None, root: Path = ROOT) -> List[str]:
    """The lines of one region's body: the provenance line, a blank line, the table, a blank line (so that no
    Markdown renderer reads the end marker as one more row)."""
    record = load(path, root)
    missing = [key for key in ("machine", "date", "command", "device") if not provenance(record)[key]]
    if missing:
        raise RecordError(f"{path}: the record names no {', '.join(missing)}")
    table = table_of(record, name)
    body = table["rows"] if rows is None else table["rows"][rows[0]: rows[1] + 1]
    if not body:
        raise RecordError(f"{path}#{name}: no rows{'' if rows is None else f' in {rows[0]}-{rows[1]}'}")
    for row in body:
        if len(row) != len(table["columns"]):
            raise RecordError(f"{path}#{name}: a row of {len(row)} cells for {len(table['columns'])} columns: {row}")
    lines = [provenance_line(record, path, table), "", "| " + " | ".join(table["columns"]) + " |",
             "|---" * len(table["columns"]) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in body] + [""]


# ---------------------------------------------------------------------------------------------------------------
# Regions of a Markdown text.
# ---------------------------------------------------------------------------------------------------------------


def regions(text: str) -> List[Dict]:
    """Each marked region: ``path``, ``table``, ``rows`` (or None), ``start`` (the marker's line index), ``end`` (the
    end marker's line index); an unclosed or nested marker raises RecordError."""
    found, lines, open_at = [], text.splitlines(), None
    for i, line in enumerate(lines):
        match = BEGIN.match(line.strip())
        if match:
            if open_at is not None:
                raise RecordError(f"line {i + 1}: a table region opens inside the one of line {open_at + 1}")
            open_at = i
            rows = (int(match["a"]), int(match["b"])) if match["a"] else None
            found.append(dict(path=match["path"], table=match["table"], rows=rows, start=i))
        elif line.strip() == END:
            if open_at is None:
                raise RecordError(f"line {i + 1}: '{END}' without its opening marker")
            found[-1]["end"], open_at = i, None
        elif line.strip().startswith("<!-- table:"):
            raise RecordError(f"line {i + 1}: a malformed marker: {line.strip()}")
    if open_at is not None:
        raise RecordError(f"line {open_at + 1}: a table region without '{END}'")
    return found


def rewrite(text: str, root: Path = ROOT) -> str:
    """``text`` with every region's body rendered from its record now."""
    lines, out, last = text.splitlines(), [], 0
    for region in regions(text):
        out += lines[last: region["start"] + 1]
        out += render(region["path"], region["table"], region["rows"], root)
        last = region["end"]
    out += lines[last:]
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def stale(text: str, root: Path = ROOT) -> List[str]:
    """The regions of ``text`` whose body differs from its rendering, as ``line N: path#table: first difference``."""
    lines, problems = text.splitlines(), []
    for region in regions(text):
        where = f"line {region['start'] + 1}: {region['path']}#{region['table']}"
        try:
            want = render(region["path"], region["table"], region["rows"], root)
        except (RecordError, KeyError) as exc:
            problems.append(f"{where}: {exc}")
            continue
        have = lines[region["start"] + 1: region["end"]]
        if have != want:
            diff = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
            got = have[diff] if diff < len(have) else "(missing)"
            problems.append(f"{where}: line {region['start'] + 2 + diff} is {got!r}, the record gives "
                            f"{want[diff] if diff < len(want) else '(nothing)'!r}")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# The command.
# ---------------------------------------------------------------------------------------------------------------


def record_run(source: Path, dest: Path, machine: str, root: Path = ROOT) -> List[str]:
    """Copy a command's JSON ``source`` to ``dest`` with ``machine`` (a label of docs/machines.md) added; returns
    the provenance problems (then nothing is written)."""
    record = json.loads(source.read_text())
    record["machine"] = machine
    problems = provenance_problems(record, machine_labels(root))
    if not problems:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(record, indent=1) + "\n")
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/doc_tables.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="list the regions that differ from their records and "
                        "exit 1 if any; write nothing")
    sub = parser.add_subparsers(dest="command")
    rec = sub.add_parser("record", help="copy a command's JSON into docs/records with its machine's label")
    rec.add_argument("source", type=Path, help="the JSON a bench command wrote (e.g. results/bench.json)")
    rec.add_argument("dest", type=Path, help="the record's path (e.g. docs/records/cpu-e_2026-12-06_bench.json)")
    rec.add_argument("--machine", required=True, help=f"the machine's label in {MACHINES}")
    args = parser.parse_args(argv)
    if args.command == "record":
        problems = record_run(args.source, args.dest, args.machine)
        print("\n".join(f"{args.source}: {p}" for p in problems) or f"wrote {args.dest}")
        return 1 if problems else 0
    problems, rewritten = [], []
    for document in documents():
        text = document.read_text()
        name = document.relative_to(ROOT).as_posix()
        if args.check:
            problems += [f"{name}: {p}" for p in stale(text)]
            continue
        new = rewrite(text)
        if new != text:
            document.write_text(new)
            rewritten.append(name)
    done = f"rewrote {', '.join(rewritten)}" if rewritten else "every table region matches its record"
    print("\n".join(problems) or done)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
