"""The code-health bounds of the package: no module over 600 lines, no function over 150 (a ``@triton.jit`` kernel
included: its steps are helpers of their own, inlined by the compiler)."""

from __future__ import annotations

import ast
from pathlib import Path

import gspo_kernels

PACKAGE = Path(gspo_kernels.__file__).parent
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 150
# Modules still over the bound, each with its length when it was listed: none may grow, and each leaves the list
# (the test says so) once it is split. Empty: every module is within the bound.
OVER_THE_BOUND: dict = {}


def module_lengths(root: Path = PACKAGE) -> dict:
    return {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))}


def long_functions(root: Path = PACKAGE, bound: int = MAX_FUNCTION_LINES) -> list:
    """``path:name (n lines)`` of every function (methods and nested functions included) longer than ``bound``,
    from its first decorator to its last line."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - first + 1
                if length > bound:
                    found.append(f"{path.relative_to(root)}:{node.name} ({length} lines)")
    return found


def test_no_module_over_600_lines():
    lengths = module_lengths()
    over = {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES and path not in OVER_THE_BOUND}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them where the code has a seam): {over}"
    grown = {path: (lengths.get(path), n) for path, n in OVER_THE_BOUND.items() if lengths.get(path, 0) > n}
    assert not grown, f"a module over the bound grew (now, then): {grown}"
    done = [path for path in OVER_THE_BOUND if lengths.get(path, 0) <= MAX_MODULE_LINES]
    assert not done, f"{done}: now within the bound; remove it from OVER_THE_BOUND"


def test_no_function_over_150_lines():
    assert not long_functions(), f"functions over {MAX_FUNCTION_LINES} lines: {long_functions()}"


def test_the_bounds_catch_a_long_module_and_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"@decorator\ndef long():\n{body}\n")
    (tmp_path / "short.py").write_text("def short():\n    return 1\n")
    assert long_functions(tmp_path) == [f"long.py:long ({MAX_FUNCTION_LINES + 2} lines)"]
    assert module_lengths(tmp_path) == {"long.py": MAX_FUNCTION_LINES + 2, "short.py": 2}
