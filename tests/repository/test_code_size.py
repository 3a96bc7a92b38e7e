"""The code-health bounds of the package: no module over 600 lines, no function over 150 (a ``@triton.jit`` kernel
included: its steps are helpers of their own, inlined by the compiler), no function taking more than 8 positional
parameters (a plan object instead: a frozen dataclass of what a launch, a backward, a tile needs)."""

from __future__ import annotations

import ast
from pathlib import Path

import gspo_kernels

PACKAGE = Path(gspo_kernels.__file__).parent
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 150
MAX_POSITIONAL = 8
# Modules still over the bound, each with its length when it was listed: none may grow, and each leaves the list
# (the test says so) once it is split. Empty: every module is within the bound.
OVER_THE_BOUND: dict = {}
# Signatures over MAX_POSITIONAL, each with its count when listed: none may grow, nothing else may join them, and an
# entry no longer over the bound leaves the list (the test says so). Each takes the parameters of the framework
# function it replaces, which the framework calls positionally (OpenRLHF's PolicyLoss, NeMo-RL's two functions).
LONG_SIGNATURES = {
    "integrations/openrlhf.py:__init__": 9,
    "integrations/openrlhf.py:forward": 9,
    "integrations/megatron/nemo_rl.py:from_parallel_hidden_states_to_logprobs": 10,
    "integrations/megatron/nemo_rl.py:from_parallel_logits_to_logprobs": 9,
}


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


def _exempt_from_the_signature_bound(node: ast.FunctionDef, classes: dict) -> bool:
    """A ``@triton.jit`` kernel (its arguments are the launch's), a ``torch.library`` operator or fake (the operator's
    schema), and an autograd Function's ``forward`` / ``backward`` (one argument per input / output; the inputs are
    bounded by ``test_structure``)."""
    decorators = [ast.unparse(d) for d in node.decorator_list]
    if any("triton.jit" in d or "custom_op" in d or "register_fake" in d or "register_autograd" in d
           for d in decorators):
        return True
    owner = classes.get(id(node))
    return (owner is not None and node.name in ("forward", "backward", "setup_context")
            and any(ast.unparse(base).endswith("autograd.Function") for base in owner.bases))


def long_signatures(root: Path = PACKAGE, bound: int = MAX_POSITIONAL) -> dict:
    """``{"path:name": n}`` of every function (methods and nested functions included) taking more than ``bound``
    positional parameters (positional-only and positional-or-keyword, less ``self`` / ``cls`` / ``ctx``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        classes = {id(f): c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            names = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls", "ctx")]
            if len(names) > bound and not _exempt_from_the_signature_bound(node, classes):
                key = f"{path.relative_to(root)}:{node.name}"
                found[key] = max(found.get(key, 0), len(names))
    return found


def test_no_function_takes_more_than_8_positional_parameters():
    found = long_signatures()
    new = {key: n for key, n in found.items() if key not in LONG_SIGNATURES}
    assert not new, f"functions over {MAX_POSITIONAL} positional parameters (pass a plan object): {new}"
    grown = {key: (n, LONG_SIGNATURES[key]) for key, n in found.items() if n > LONG_SIGNATURES.get(key, n)}
    assert not grown, f"a signature over the bound grew (now, then): {grown}"
    done = [key for key in LONG_SIGNATURES if key not in found]
    assert not done, f"{done}: now within the bound; remove it from LONG_SIGNATURES"


def test_the_signature_bound_counts_positional_parameters_and_skips_kernels(tmp_path):
    (tmp_path / "m.py").write_text(
        "def nine(a, b, c, d, e, f, g, h, i, *, j=0):\n    pass\n"
        "def eight(a, b, c, d, e, f, g, h, *rest, j=0, **kw):\n    pass\n"
        "class K:\n    def method(self, a, b, c, d, e, f, g, h, i, /):\n        pass\n"
        "@triton.jit\ndef kernel(a, b, c, d, e, f, g, h, i):\n    pass\n"
        "class F(torch.autograd.Function):\n    @staticmethod\n    def backward(ctx, a, b, c, d, e, f, g, h, i):\n"
        "        pass\n"
    )
    assert long_signatures(tmp_path) == {"m.py:nine": 9, "m.py:method": 9}


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
