"""What the README and docs/*.md quote exists: every ``gspo_kernels.*`` dotted name (a module, or a name defined in
one: read from the source, nothing imported), every repository file path and every relative link; and every
option of every ``gspo-kernels`` subcommand is shown by its ``--help`` (no hidden options)."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
from functools import lru_cache
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

from gspo_kernels.tools.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]
DOTTED = re.compile(r"(?<![\w./-])gspo_kernels(?:\.[A-Za-z_]\w*)+")
# A path from the checkout's root: a top-level folder or file, then anything a path holds. Not inside a longer path
# (``~/.cache/gspo_kernels/...``) and not a generated result (``results/``).
PATH = re.compile(r"(?<![\w./~$-])((?:gspo_kernels|tests|benchmarks|examples|docs|csrc|constraints|\.ci)/[\w./*-]+"
                  r"|(?:Makefile|pyproject\.toml|setup\.py|CHANGELOG\.md|MANIFEST\.in)\b)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Paths that exist once installed, not in the checkout: setup.py maps the top-level csrc/ to gspo_kernels/csrc.
INSTALLED = {"gspo_kernels/csrc": "csrc"}


def documents() -> List[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@lru_cache(maxsize=None)
def _module_file(dotted: str) -> Optional[Path]:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _defines(body: list, name: str) -> bool:
    """Whether ``body`` (a module's or a class's statements) defines ``name`` (or star-imports, so may)."""
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" or (alias.asname or alias.name).split(".")[0] == name for alias in node.names):
                return True
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in targets:
                if any(isinstance(t, ast.Name) and t.id == name for t in ast.walk(target)):
                    return True
    return False


def dotted_name_problem(dotted: str) -> Optional[str]:
    """None when ``dotted`` names a module of the package or a name defined in one (a class's attribute too)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(".".join(parts[:cut]))
        if module is None:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        body = _tree(module).body
        if not _defines(body, rest[0]):
            return f"{'.'.join(parts[:cut])} ({module.relative_to(ROOT)}) defines no {rest[0]!r}"
        if len(rest) > 1:
            classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == rest[0]]
            if classes and not _defines(classes[0].body, rest[1]):
                return f"class {rest[0]} of {'.'.join(parts[:cut])} defines no {rest[1]!r}"
        return None
    return "no such module"


def _quoted(pattern: re.Pattern) -> List[Tuple[str, int, str]]:
    found = []
    for document in documents():
        for number, line in enumerate(document.read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                found.append((document.relative_to(ROOT).as_posix(), number, match.group(1 if pattern.groups else 0)))
    return found


def path_problem(text: str, document: Path = ROOT / "README.md") -> Optional[str]:
    """None when ``text`` (a path from the checkout's root, or a link relative to ``document``) exists."""
    text = text.split("::")[0].split("#")[0].rstrip(".,;:")
    if not text or "<" in text or "{" in text:
        return None
    base = ROOT if document is None else document.parent
    for installed, source in INSTALLED.items():
        text = re.sub(rf"^{re.escape(installed)}(?=/|$)", source, text) if document is None else text
    path = base / text
    module = re.fullmatch(r"(.+)\.([A-Za-z_]\w*)", text)  # tests/support.make_case: a name in a module
    if not path.exists() and module and (base / f"{module.group(1)}.py").is_file():
        found = _defines(_tree(base / f"{module.group(1)}.py").body, module.group(2))
        return None if found else f"{module.group(1)}.py defines no {module.group(2)!r}"
    if "*" in text:
        return None if list(base.glob(text)) else "no file matches"
    if not path.exists() and (base / f"{text}.json").is_file():
        return None  # an output prefix (`--out docs/scaling_cpu` writes docs/scaling_cpu.json and .png)
    return None if path.exists() else "does not exist"


def test_the_checks_catch_a_wrong_name_and_a_wrong_path():
    assert dotted_name_problem("gspo_kernels.testing.round_interpreter_bf16_casts") is None
    assert dotted_name_problem("gspo_kernels.tools.verify.round_interpreter_bf16_casts") is not None
    assert dotted_name_problem("gspo_kernels.no_such_module") is not None
    assert dotted_name_problem("gspo_kernels.distributed") is None
    assert path_problem("tests/repository/test_doc_references.py", None) is None
    assert path_problem("tests/distributed/test_trl_distributed.py", None) is not None
    assert path_problem("tests/support.make_case", None) is None
    assert path_problem("tests/support.no_such_helper", None) is not None
    assert path_problem("docs/scaling_cpu", None) is None  # an --out prefix of an existing record
    assert path_problem("docs/scaling_gpu", None) is not None


def test_every_quoted_gspo_kernels_name_exists():
    wrong = [f"{doc}:{line}: {name}: {problem}" for doc, line, name in _quoted(DOTTED)
             if (problem := dotted_name_problem(name))]
    assert not wrong, "\n".join(wrong)


def test_every_quoted_repository_path_exists():
    wrong = [f"{doc}:{line}: {path}: {problem}" for doc, line, path in _quoted(PATH)
             if (problem := path_problem(path, None))]
    assert not wrong, "\n".join(wrong)


def test_every_relative_link_points_to_a_file():
    wrong = []
    for doc, line, target in _quoted(LINK):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or an anchor in the same page
        if problem := path_problem(target, ROOT / doc):
            wrong.append(f"{doc}:{line}: {target}: {problem}")
    assert not wrong, "\n".join(wrong)


def _subcommand_parser(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"gspo-kernels {name}")
    importlib.import_module(SUBCOMMANDS[name][0]).add_arguments(parser)
    return parser


def hidden_options(parser: argparse.ArgumentParser) -> List[str]:
    """The options of ``parser`` that its ``--help`` does not show."""
    shown = parser.format_help()
    return [option for action in parser._actions for option in action.option_strings
            if action.help == argparse.SUPPRESS or not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", shown)]


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_option_of_a_subcommand_is_in_its_help(name):
    assert not hidden_options(_subcommand_parser(name)), name


def test_the_help_check_catches_a_hidden_option():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shown", help="in the help")
    parser.add_argument("--secret", help=argparse.SUPPRESS)
    assert hidden_options(parser) == ["--secret"]
