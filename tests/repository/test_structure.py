"""The package's structure: no import cycles between its modules (type-only imports included), one
definition of the pipeline's parts, and the public names all importable."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import gspo_kernels

PACKAGE = Path(gspo_kernels.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, is_package: bool) -> set:
    """Every ``gspo_kernels`` module named in an import statement of the file (anywhere: function bodies
    and ``if TYPE_CHECKING:`` blocks count), resolved to the deepest existing module."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from a import b``: the submodule a.b when it exists, else a name defined in a
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("gspo_kernels."):
            # a module named by a string (``importlib.import_module``, a registry's module path): an edge too
            if node.value.replace(".", "").replace("_", "").isalnum():
                found.add(node.value)
    return {m for m in found if m == "gspo_kernels" or m.startswith("gspo_kernels.")}


def import_graph() -> dict:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        targets = set()
        for target in _imports(path, name, path.name == "__init__.py"):
            while target not in files and "." in target:
                target = target.rsplit(".", 1)[0]
            # importing a package's submodule runs the package's __init__ first, but that edge is the
            # package's own choice; count the module actually named
            if target in files and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def find_cycle(graph: dict):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_import_graph_is_acyclic():
    graph = import_graph()
    assert "gspo_kernels.loss" in graph and "gspo_kernels.checks" in graph["gspo_kernels.loss"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def unit(module: str) -> str:
    """The unit of the package-level graph a module belongs to: its subpackage of ``gspo_kernels``
    (``gspo_kernels.backends`` for every module under ``backends/``), or the top-level module itself."""
    parts = module.split(".")
    if len(parts) >= 2 and (PACKAGE / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def test_packages_depend_one_way():
    """At package granularity (each subpackage one unit, each top-level module one): no two units import each
    other, directly or through a third, counting imports inside functions, type-only imports and modules named
    by a string (``importlib``). E.g. backends -> objectives -> config, never back."""
    graph = {}
    for module, targets in import_graph().items():
        graph.setdefault(unit(module), set()).update(unit(t) for t in targets if unit(t) != unit(module))
    assert "gspo_kernels.objectives" in graph["gspo_kernels.backends"]
    assert "gspo_kernels.config" in graph["gspo_kernels.objectives"]
    assert "gspo_kernels.objectives" not in graph["gspo_kernels.config"], "the config imports no objective"
    assert "gspo_kernels.backends.torch" in import_graph()["gspo_kernels.backends"], "registry strings are edges"
    cycle = find_cycle(graph)
    assert cycle is None, "packages that import each other: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_config_and_checks_do_not_import_each_other():
    graph = import_graph()
    assert "gspo_kernels.config" not in graph["gspo_kernels.checks"]
    assert "gspo_kernels.config" not in graph["gspo_kernels.layout"]
    assert graph["gspo_kernels.checks"] == set(), "checks.py is the bottom of the graph"


def test_every_public_name_is_importable():
    for name in gspo_kernels.__all__:
        assert getattr(gspo_kernels, name) is not None, name


def test_one_definition_of_each_pipeline_part():
    """The orchestration, the precision decision and the objective are each defined once in the package."""
    counts = {"def _run(": 0, "def operand_dtype(": 0, "def gspo_objective(": 0, "def prepare_loss_inputs(": 0,
              "def _operand_dtype(": 0}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for key in counts:
            counts[key] += text.count(key)
    assert counts == {"def _run(": 1, "def operand_dtype(": 1, "def gspo_objective(": 1, "def prepare_loss_inputs(": 1,
                      "def _operand_dtype(": 0}, counts


def _slot_numbers(tree: ast.Module, prefix: str) -> dict:
    """``{name: n}`` of the module-level ``NAME = tl.constexpr(n)`` assignments (a literal int) whose name starts
    with ``prefix``."""
    found = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.startswith(prefix) and isinstance(node.value, ast.Call)
                and node.value.args and isinstance(node.value.args[0], ast.Constant)):
            found[node.targets[0].id] = node.value.args[0].value
    return found


def test_metric_slots_are_one_table():
    """The sequence kernels' partials columns (``P_*``) and output slots (``O_*``) are numbered 0, 1, ... once
    each, without a gap; every metric's slot is named in ``METRICS`` and only there (no ``out[7]``)."""
    path = PACKAGE / "backends" / "triton" / "sequence_slots.py"
    text = path.read_text()
    tree = ast.parse(text)
    for prefix in ("P_", "O_"):
        numbers = _slot_numbers(tree, prefix)
        assert sorted(numbers.values()) == list(range(len(numbers))), (prefix, numbers)
    metrics = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                   and getattr(node.targets[0], "id", None) == "METRICS")
    slots = {row.elts[1].id for row in metrics.elts}
    assert slots <= set(_slot_numbers(tree, "O_")), slots
    for name in ("\"rollout/kl\"", "\"importance_weight/mean\""):
        assert text.count(name) == 1, name
    # an objective's own metrics are its rows (Objective.metrics), their slots among OBJECTIVE_SLOTS
    from gspo_kernels import objectives

    slot_names = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                      and getattr(node.targets[0], "id", None) == "OBJECTIVE_SLOTS")
    allowed = {key.value for key in slot_names.keys}
    for objective in objectives.objectives():
        assert {slot for _, slot in objective.metrics} <= allowed, objective.name


def test_autograd_functions_take_the_options_as_one_object():
    """Every ``torch.autograd.Function`` of the package: at most 7 inputs to its ``forward`` (after ``ctx``), and no
    call option restated as a loose argument (the call's ``CallOptions`` travels as one object down to it)."""
    options = {"temperature", "softcap", "return_entropy", "inplace_backward", "memory_budget", "batch_invariant",
               "fp32_head", "check_finite", "logprobs_out"}
    found, bad = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            if not any(ast.unparse(base).endswith("autograd.Function") for base in node.bases):
                continue
            forward = next(f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "forward")
            names = [a.arg for a in forward.args.args[1:]]  # after ctx
            found.append(f"{path.name}:{node.name}")
            if len(names) > 7 or options & set(names):
                bad.append(f"{path.relative_to(PACKAGE)}:{node.name}{tuple(names)}")
    assert len(found) >= 8, found
    assert not bad, f"autograd Functions with loose options or more than 7 inputs: {bad}"


def test_one_meaning_per_name_at_the_top_level():
    """At most 13 top-level modules; the float64 oracle one package (``import gspo_kernels.reference``), the PyTorch
    sequence stage inside ``objectives/`` (no ``objective.py`` beside ``objectives/``)."""
    import gspo_kernels.reference

    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 13, modules
    assert not (PACKAGE / "objective.py").exists() and not (PACKAGE / "reference_objectives.py").exists()
    assert (PACKAGE / "reference" / "__init__.py").exists() and callable(gspo_kernels.reference.gspo_loss)


# --- docs/architecture.md against the code -----------------------------------------------------------------

ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _modules_of_files() -> dict:
    """``{dotted module name: path}`` of every module of the package (a package by its ``__init__.py``)."""
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def map_rows(text: str) -> list:
    """``[(first cell, imports cell)]`` of the table under "## What each module owns"."""
    section = text.split("## What each module owns", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows.append((cells[0], cells[-1]))
    return rows


def _resolve(token: str, base: str, files: dict):
    """A backticked name of the map as a module of the package, or None (a class, a function, prose). ``x/`` is
    looked up under the row's package ``base`` first, ``x`` in the package root first."""
    name = token.strip().removesuffix(".py").removesuffix("__init__")
    relative_first = name.endswith("/")
    name = name.rstrip("/").replace("/", ".")
    if name in ("gspo_kernels", ""):  # the package itself (its ``__init__.py``)
        return "gspo_kernels"
    candidates = [f"{base}.{name}", f"gspo_kernels.{name}"] if relative_first else [f"gspo_kernels.{name}",
                                                                                     f"{base}.{name}"]
    return next((c for c in candidates if c in files), None)


def _covers(claim: str, module: str) -> bool:
    return module == claim or (claim != "gspo_kernels" and module.startswith(claim + "."))


def map_problems(text: str) -> list:
    """What the import table of ``text`` (docs/architecture.md) says wrong about the code, one line each, each saying
    what to change. A row's first cell names one module (``x/y.py``) or one package (``x/``: all its modules); its
    last cell names (in backticks) every module the row's modules import from outside the row, and nothing they do
    not import (``nothing``: none). Type-only and function-level imports count, as in :func:`import_graph`."""
    files, graph = _modules_of_files(), import_graph()
    problems, covered = [], set()
    for first, imports in map_rows(text):
        named = re.findall(r"`([^`]+)`", first)
        if len(named) != 1:
            problems.append(f"row {first!r}: its first cell must name one module or one package in backticks")
            continue
        path = named[0]
        module = _resolve(path if path.endswith("/") else path, "gspo_kernels", files)
        if module is None:
            problems.append(f"row `{path}`: no such module in gspo_kernels/: remove the row or fix its path")
            continue
        is_package = path.endswith("/")
        members = {m for m in files if m == module or (path.endswith("/") and m.startswith(module + "."))}
        covered |= members
        base = module if path.endswith("/") else module.rsplit(".", 1)[0]
        claims = {c for c in (_resolve(t, base, files) for t in re.findall(r"`([^`]+)`", imports)) if c}
        actual = {t for m in members for t in graph[m]} - members
        outside = {t for t in actual if not (is_package and t.startswith(module + "."))}
        missing = sorted(t for t in outside if not any(_covers(c, t) for c in claims))
        # a row may name its own modules (what reads what inside a package); a name outside must be imported
        inside = {t for m in members for t in graph[m]}
        stale = sorted(c for c in claims - members if not any(_covers(c, t) for t in actual | inside))
        if missing:
            problems.append(f"row `{path}`: its imports cell must name " + ", ".join(
                f"`{t.removeprefix('gspo_kernels.')}`" for t in missing) + " (imported by the code)")
        if stale:
            problems.append(f"row `{path}`: its imports cell names " + ", ".join(
                f"`{c.removeprefix('gspo_kernels.')}`" for c in stale) + " (imported by none of its modules): remove it")
    for module in sorted(set(files) - covered):
        path = str(files[module].relative_to(PACKAGE))
        package = f" (or name its package in a row `| `{path.rsplit('/', 1)[0]}/` | ...`)" if "/" in path else ""
        problems.append(f"no row for `{path}`: add `| `{path}` | what it owns | `the modules it imports` |`{package}")
    return problems


def tree_problems(text: str) -> list:
    """The "Where things are" tree must name every module: each line starts with a folder of the package
    (``gspo_kernels/...``) or continues the folder above (leading spaces); every module of that folder is named in
    its lines by its file name without ``.py``."""
    block = text.split("## Where things are", 1)[1].split("```", 2)[1]
    folders, current = {}, None
    for line in block.splitlines():
        if line and not line[0].isspace():
            current = line.split()[0]
        if current is not None:
            folders.setdefault(current, []).append(line)
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        folder = str(path.parent.relative_to(PACKAGE.parent)) + "/"
        if path.name == "__init__.py" or "csrc" in path.parts:
            continue
        words = set(re.findall(r"[A-Za-z_0-9]+", " ".join(folders.get(folder, [])).replace(".py", "")))
        if path.stem not in words:
            problems.append(f"docs/architecture.md's tree does not name {path.relative_to(PACKAGE.parent)}: add "
                            f"`{path.stem}` (what it is) to the line of `{folder}`")
    return problems


def test_the_map_names_every_module_and_its_imports():
    text = ARCHITECTURE.read_text()
    problems = tree_problems(text) + map_problems(text)
    assert not problems, "docs/architecture.md does not match the code:\n" + "\n".join(problems)


def test_the_map_check_catches_a_wrong_row():
    """A planted wrong row: ``options.py`` said to import nothing, ``checks.py`` said to import ``config``, and the
    row of ``precision.py`` left out."""
    text = ARCHITECTURE.read_text()
    rows = {first: line for line in text.splitlines() if line.startswith("| `")
            for first in [line.split(" | ")[0]]}
    options_row, checks_row = rows["| `options.py`"], rows["| `checks.py`"]
    wrong = (text.replace(options_row, options_row.rsplit(" | ", 1)[0] + " | nothing |")
             .replace(checks_row, checks_row.rsplit(" | ", 1)[0] + " | `config` |")
             .replace(rows["| `precision.py`"] + "\n", ""))
    problems = "\n".join(map_problems(wrong))
    assert "row `options.py`: its imports cell must name" in problems, problems
    assert "row `checks.py`: its imports cell names `config`" in problems, problems
    assert "no row for `precision.py`" in problems, problems
    tree = text.replace("versions.py (the tested floors)", "", 1)
    assert any("gspo_kernels/versions.py" in p for p in tree_problems(tree)), "the tree check missed versions.py"


def test_the_framework_adapter_sits_at_the_config_layer():
    """``integrations/adapter.py`` imports only the config, so the trainers of ``train/`` declare their options with it
    and import nothing else of ``integrations/`` (no framework's integration)."""
    graph = import_graph()
    assert graph["gspo_kernels.integrations.adapter"] == {"gspo_kernels.config"}
    from_train = {t for module, targets in graph.items() if module.startswith("gspo_kernels.train")
                  for t in targets if t.startswith("gspo_kernels.integrations")}
    assert from_train == {"gspo_kernels.integrations.adapter"}, from_train
