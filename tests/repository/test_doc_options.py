"""Every option the README and docs/*.md quote after ``gspo-kernels <subcommand>`` is one that subcommand's parser
has (its ``--help`` shows every option: tests/repository/test_doc_references.py), so a renamed or removed option
cannot stay in the docs."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path
from typing import List, Optional, Tuple

from gspo_kernels.tools.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]
# ``gspo-kernels <subcommand>`` and what follows it on the line, up to the end of a code span, a comment or a cell.
QUOTED = re.compile(r"gspo-kernels (?P<sub>[a-z0-9-]+)(?P<rest>[^`#|\n]*)")
OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
TOP_LEVEL = {"--version", "-v", "--verbose", "--help", "-h"}


def _options(name: str) -> set:
    parser = argparse.ArgumentParser(prog=f"gspo-kernels {name}")
    importlib.import_module(SUBCOMMANDS[name][0]).add_arguments(parser)
    return {option for action in parser._actions for option in action.option_strings}


def unknown_options(text: str) -> List[Tuple[int, str, str]]:
    """(line, subcommand, option) for each option quoted after ``gspo-kernels <subcommand>`` that the subcommand's
    parser lacks; a word after ``gspo-kernels`` that is no subcommand (prose, ``--version``) is not checked."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in QUOTED.finditer(line):
            sub = match["sub"]
            if sub not in SUBCOMMANDS:
                continue
            known = _options(sub)
            for option in OPTION.findall(match["rest"]):
                if option not in known and option not in TOP_LEVEL:
                    found.append((number, sub, option))
    return found


def _documents() -> List[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _first_problem(document: Path) -> Optional[str]:
    wrong = unknown_options(document.read_text())
    return None if not wrong else "; ".join(f"line {n}: gspo-kernels {s} {o}" for n, s, o in wrong)


def test_every_quoted_option_of_a_subcommand_exists():
    wrong = [f"{d.relative_to(ROOT)}: {p}" for d in _documents() if (p := _first_problem(d))]
    assert not wrong, "options the docs quote that the command lacks:\n" + "\n".join(wrong)


def test_the_docs_quote_options_at_all():
    """The scan sees the quoted commands (a pattern that matched nothing would pass every document)."""
    text = "\n".join(d.read_text() for d in _documents())
    quoted = {(m["sub"], o) for m in QUOTED.finditer(text) for o in OPTION.findall(m["rest"])}
    assert {("bench", "--gpu"), ("bench", "--sections"), ("gpu-check", "--quick"), ("train", "--task")} <= quoted


def test_the_check_catches_a_misspelt_option():
    assert unknown_options("run `gspo-kernels bench --gpu --section hidden` first") == [(1, "bench", "--section")]
    assert unknown_options("`gspo-kernels verify --quik`; `gspo-kernels verify --quick`") == [(1, "verify", "--quik")]
    assert unknown_options("gspo-kernels bench --gpu --sections hidden  # --not-an-option in a comment") == []
