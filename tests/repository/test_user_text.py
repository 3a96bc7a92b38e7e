"""Text is written for users: no tracker numbers ("issue 26", "(#12)") in the package's code, the CLI's help,
README.md, CHANGELOG.md, docs/, benchmarks/ or the tests. A reader has never seen the tracker; say what a
change does or what a figure measures instead. Citations of other projects' pull requests ("Liger PR #1356",
"owner/repo#12") stay."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from gspo_kernels.tools.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]
# "issue 26", "Issues 12 and 13", "issue #27"; "(#12)" or "#12" not preceded by "PR " or "owner/repo".
TRACKER = re.compile(r"\bissues?\s*#?\s*\d+|(?<!PR )(?<![\w/.-])#\d{1,5}\b", re.IGNORECASE)


def tracker_numbers(text: str) -> list:
    """``(line number, line)`` of each line of ``text`` naming a tracker number."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if TRACKER.search(line)]


def _files() -> list:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    for folder in ("gspo_kernels", "benchmarks", "tests", "examples"):
        for pattern in ("*.py", "*.sh", "*.md", "*.cpp", "*.h"):
            files += sorted((ROOT / folder).rglob(pattern))
    return [f for f in files if f.is_file() and f != Path(__file__).resolve()]


def test_the_pattern_finds_tracker_numbers():
    for text in ("the GPU measurements of issue 26", "Issues 12 and 13", "see issue #27", "fixed (#12)",
                 "issue 22, item 6", "#3 in the tracker"):
        assert tracker_numbers(text), text
    for text in ("Liger PR #1356", "linkedin/Liger-Kernel#1356", "an SM issues up to 4 warp instructions",
                 "the host issue time", "[below](#gspotrainer-any-hugging-face-causal-lm)", "x[:, 1]"):
        assert not tracker_numbers(text), text


def test_no_file_names_a_tracker_number():
    found = {str(f.relative_to(ROOT)): hits for f in _files() if (hits := tracker_numbers(f.read_text()))}
    assert not found, found


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_no_help_text_names_a_tracker_number(name):
    parser = argparse.ArgumentParser(prog=f"gspo-kernels {name}", description=SUBCOMMANDS[name][1])
    importlib.import_module(SUBCOMMANDS[name][0]).add_arguments(parser)
    texts = [parser.format_help()] + [a.help for a in parser._actions if isinstance(a.help, str)]
    hits = [hit for text in texts for hit in tracker_numbers(text)]
    assert not hits, hits


def _help_texts() -> list:
    """The top-level help and every subcommand's, as ``gspo-kernels [SUBCOMMAND] --help`` prints them."""
    from gspo_kernels.tools import cli

    texts = []
    for argv in [[]] + [[name] for name in sorted(SUBCOMMANDS)]:
        parser_help = []

        def capture(self, file=None, _out=parser_help):
            _out.append(self.format_help())
            raise SystemExit(0)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(argparse.ArgumentParser, "print_help", capture)
            with pytest.raises(SystemExit):
                cli.main(argv + ["--help"])
        texts += parser_help
    return texts


def test_help_is_plain_text_without_rest_markup():
    texts = _help_texts()
    assert len(texts) == 1 + len(SUBCOMMANDS)
    for text in texts:
        for markup in ("``", ":func:", ":class:", ":mod:", ":data:"):
            assert markup not in text, (markup, text)
