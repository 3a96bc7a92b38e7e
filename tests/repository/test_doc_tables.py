"""The measured tables of README.md and docs/*.md are what benchmarks/doc_tables.py renders from their records now
(a hand edit, a typo or a table left behind by a new record fails), and every record names its machine (a label of
docs/machines.md), device, date and command."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "benchmarks" / "doc_tables.py")
dt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dt)

README_ROW = "| **`fused_linear_gspo_loss`** (one pass, default budget) | **98.9** | **0.86** | **618** | **5.3** |"


def _quoted_records() -> set:
    return {r["path"] for d in dt.documents() for r in dt.regions(d.read_text())}


@pytest.mark.parametrize("document", dt.documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_table_region_is_what_its_record_renders(document):
    problems = dt.stale(document.read_text())
    assert not problems, ("tables that differ from their records (python benchmarks/doc_tables.py rewrites "
                          "them from the records):\n" + "\n".join(problems))


def test_the_docs_have_regions_in_the_readme_and_the_results_pages():
    quoting = {d.name for d in dt.documents() if dt.regions(d.read_text())}
    assert {"README.md", "gpu_results.md", "cpu_results.md", "scaling.md"} <= quoting


@pytest.mark.parametrize("path", sorted({*_quoted_records(),
                                         *(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs/records").glob("*.json"))}))
def test_every_record_names_its_machine_device_date_and_command(path):
    assert not dt.provenance_problems(dt.load(path), dt.machine_labels()), path


def test_every_record_of_docs_results_is_quoted_somewhere():
    unquoted = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs/records").glob("*.json")} - _quoted_records()
    assert not unquoted, f"records no document renders: {sorted(unquoted)}"


def test_a_one_digit_edit_in_a_table_fails_and_the_rewrite_restores_it():
    text = (ROOT / "README.md").read_text()
    assert README_ROW in text
    edited = text.replace(README_ROW, README_ROW.replace("98.9", "98.8"))
    problems = dt.stale(edited)
    assert len(problems) == 1 and "98.8" in problems[0] and "98.9" in problems[0], problems
    assert dt.rewrite(edited) == text


def test_an_edited_provenance_line_or_a_dropped_row_fails():
    text = (ROOT / "docs/gpu_results.md").read_text()
    assert dt.stale(text.replace("2026-11-26: `gspo-kernels bench --gpu", "2026-11-25: `gspo-kernels bench --gpu", 1))
    row = next(line for line in text.splitlines() if line.startswith("| plain PyTorch, V=50257"))
    assert dt.stale(text.replace(row + "\n", "", 1))


def test_a_record_without_machine_or_date_or_with_an_unknown_machine_is_refused():
    labels = dt.machine_labels()
    assert {"CPU-A", "CPU-B", "CPU-E", "H200"} <= set(labels)
    assert set(dt.provenance_problems({"command": "gspo-kernels bench"}, labels)) == {
        "no machine", "no date", "no device"}
    record = dict(machine="H100", device="NVIDIA H100", date="2026-12-06", command="gspo-kernels bench --gpu")
    assert dt.provenance_problems(record, labels) == [
        f"machine 'H100' is not a label of docs/machines.md ({', '.join(labels)})"]


def test_a_region_naming_a_missing_table_or_left_open_fails():
    assert "no table 'nope'" in dt.stale("<!-- table: docs/records/h200_2026-11-26.json#nope -->\n<!-- end table -->")[0]
    with pytest.raises(dt.RecordError, match="without"):
        dt.regions("<!-- table: docs/records/h200_2026-11-26.json#hidden -->\n| a |\n")


def _bench_record(tmp_path: Path) -> str:
    """A record as ``gspo-kernels bench --out`` writes it (the fields the renderer reads), then ``record``-ed."""
    rows = [dict(case="logits", impl="plain-torch", status="ok", fwd_ms=1890.0, bwd_ms=6290.0, total_ms=8180.0,
                 peak_extra_bytes=7122 * 2**20, case_spec=dict(path="logits", B=16, T=256, V=151936, dtype="fp32")),
            dict(case="logits", impl="gspo-cpu", status="ok", fwd_ms=440.0, bwd_ms=250.0, total_ms=690.0,
                 peak_extra_bytes=2374 * 2**20, case_spec=dict(path="logits", B=16, T=256, V=151936, dtype="fp32")),
            dict(case="logits", impl="liger", status="skipped", reason="not installed")]
    payload = dict(command="gspo-kernels bench --cases logits", repeats=3, work_formulas={}, results=rows,
                   environment=dict(device="cpu", device_name="AMD EPYC", time_utc="2026-12-06T20:00:00Z",
                                    versions={"torch": "2.13.0+cpu"}))
    (tmp_path / "results").mkdir()
    (tmp_path / "results/bench.json").write_text(json.dumps(payload))
    assert dt.record_run(tmp_path / "results/bench.json", tmp_path / "docs/records/x.json", "CPU-E") == []
    assert dt.record_run(tmp_path / "results/bench.json", tmp_path / "docs/records/y.json", "laptop")
    assert not (tmp_path / "docs/records/y.json").exists()
    return "docs/records/x.json"


def test_a_bench_record_renders_its_case_with_its_provenance(tmp_path):
    path = _bench_record(tmp_path)
    lines = dt.render(path, "logits", root=tmp_path)
    assert lines[0].startswith("Measured on CPU-E of docs/machines.md (AMD EPYC; torch 2.13.0+cpu), 2026-12-06: "
                               "`gspo-kernels bench --cases logits`; case `logits`")
    assert lines[4:] == ["| plain-torch | 1890 | 6290 | 8180 | 7122 | 1.00 |",
                         "| gspo-cpu | 440 | 250 | 690 | 2374 | 0.08 |",
                         "| liger | - | - | - | - | skipped: not installed |", ""]


def test_a_bench_gpu_record_renders_a_section_with_its_reports_columns(tmp_path):
    rows = [dict(section="torch-backend", case="plain PyTorch, logits [8, 1025, 151936]", status="ok", ms=20.42,
                 peak_extra_gib=13.91, shape="logits [8, 1025, 151936]"),
            dict(section="torch-backend", case="ours backend='torch', logits [8, 1025, 151936]", status="ok",
                 ms=32.90, peak_extra_gib=2.99, shape="logits [8, 1025, 151936]")]
    from gspo_kernels.tools.bench_gpu.report import add_ratios

    add_ratios(rows)
    record = dict(command="gspo-kernels bench --gpu --sections torch-backend", machine="H200", sections=[],
                  results=rows, time_utc="2026-12-06T20:00:00Z",
                  environment=dict(device_name="NVIDIA H200", versions={"torch": "2.11.0+cu130", "triton": "3.6.0"}))
    (tmp_path / "r.json").write_text(json.dumps(record))
    lines = dt.render("r.json", "torch-backend", root=tmp_path)
    assert "(NVIDIA H200; torch 2.11.0+cu130, triton 3.6.0), 2026-12-06" in lines[0]
    assert lines[5] == "| ours backend='torch', logits [8, 1025, 151936] | 32.90 | 1.611 | - | - | 2.99 | - | - | - |  |"


def test_bench_gpus_json_carries_its_date_and_commit_so_it_can_be_recorded(tmp_path):
    """``bench --gpu`` writes its JSON through ``report.write_outputs``, which adds the date and commit its
    environment row lacks: the file is then a record as it comes (only the machine's label is added)."""
    from gspo_kernels.tools.bench_gpu.report import write_outputs

    payload = dict(command="gspo-kernels bench --gpu --sections torch-backend", device="cuda", tiny=False,
                   elapsed_s=1.0, sections=[], results=[], targets=[],
                   environment=dict(device_name="NVIDIA H200", versions={"torch": "2.11.0+cu130"}))
    write_outputs(str(tmp_path / "bench_gpu"), payload)
    written = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert written["time_utc"][:4].isdigit() and "git_commit" in written
    assert "no date" not in dt.provenance_problems(written, ["H200"])
    assert dt.provenance_problems(dict(written, machine="H200"), ["H200"]) == []


# The README's measured sections quote figures in their prose too: each time or size there must be a cell of a
# recorded table (any record rendered in the docs), so a typo in the prose fails as one in a table does.
MEASURED_SECTIONS = ("## Measured on 2-core CPUs (no GPU)", "## On a GPU")
UNIT = r"\d+(?:\.\d+)? ?(?:ms|s|MB|GiB)\b"
# a number with its unit, or the first of "a against b unit"
FIGURE = re.compile(rf"(?<![\w.^])(\d+(?:\.\d+)?)(?: ?(?:ms|s|MB|GiB)\b| against (?={UNIT}))")


def _section(text: str, title: str) -> str:
    body = text.split(title + "\n", 1)[1].split("\n## ", 1)[0]
    body = re.sub(r"```.*?```", "", body, flags=re.S)  # commands, not figures
    return re.sub(r"<!-- table: .*?<!-- end table -->", "", body, flags=re.S)  # checked against their records


def _recorded_numbers() -> set:
    numbers = set()
    for path in _quoted_records():
        record = dt.load(path)
        names = record["tables"] if "tables" in record else [r["table"] for d in dt.documents()
                                                            for r in dt.regions(d.read_text()) if r["path"] == path]
        for name in names:
            for row in dt.table_of(record, name)["rows"]:
                numbers |= set(re.findall(r"\d+(?:\.\d+)?", " ".join(map(str, row))))
    return numbers


def unrecorded_figures(text: str, numbers: set) -> list:
    return [m.group(0) for title in MEASURED_SECTIONS for m in FIGURE.finditer(_section(text, title))
            if m.group(1) not in numbers]


def test_every_time_and_size_in_the_readmes_measured_prose_is_a_recorded_figure():
    text = (ROOT / "README.md").read_text()
    numbers = _recorded_numbers()
    assert len(FIGURE.findall(_section(text, MEASURED_SECTIONS[0]))) >= 6  # the check sees the CPU figures
    assert not unrecorded_figures(text, numbers)
    assert unrecorded_figures(text.replace("took 1.98 s and 1162 MB", "took 1.98 s and 1163 MB"), numbers) == [
        "1163 MB"]
