"""The README's table of tested versions is what ``make test`` installs: its "newest tested" column equals the pins of
``constraints/test.txt`` (the file every install of ``make test`` uses with ``-c``), its floor column equals the
floor environment's pins (the Makefile's ``FLOOR_SPEC``), and the Makefile's own ``==`` pins agree with the file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints" / "test.txt"
# The README's names of the packages whose distribution names differ.
DISTRIBUTIONS = {"liger": "liger-kernel", "cut cross-entropy": "cut-cross-entropy"}
MUST_BE_PINNED = ("torch", "triton", "numpy", "transformers", "accelerate", "trl", "liger-kernel", "cut-cross-entropy",
                  "deepspeed", "verl", "openrlhf", "pytest", "pytest-xdist")


def pins(text: str) -> Dict[str, str]:
    """``name==version`` lines of a requirements text (comments and blank lines skipped), names lower-cased."""
    found = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"not pinned with ==: {line!r}"
            found[name.strip().lower().replace("_", "-")] = version.strip()
    return found


def table_rows(readme: str) -> List[Tuple[str, str, str]]:
    """``(package, floor, newest)`` for every package of the README's tested-versions table."""
    section = readme.split("### Tested versions", 1)[1].split("\n\n", 2)[1]
    rows = []
    for line in section.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = [n.strip() for n in cells[0].split(",")]
        newest = [v.strip() for v in cells[2].split(",")]
        floors = [v.strip() for v in cells[1].split(",")] if cells[1] != "-" else ["-"] * len(names)
        assert len(newest) == len(names) == len(floors), line
        for name, floor, version in zip(names, floors, newest):
            rows.append((DISTRIBUTIONS.get(name.lower(), name.lower()), floor, version))
    return rows


def table_problems(readme: str, pinned: Dict[str, str], floor: Dict[str, str]) -> List[str]:
    problems = []
    for name, floor_version, version in table_rows(readme):
        if pinned.get(name) != version:
            problems.append(f"{name}: the README says {version}, constraints/test.txt pins {pinned.get(name)}")
        if floor_version != "-" and floor.get(name, floor_version) != floor_version:
            problems.append(f"{name}: the README's floor {floor_version}, the Makefile's FLOOR_SPEC {floor.get(name)}")
    return problems


def _makefile_variable(name: str) -> str:
    match = re.search(rf"^{name} \?= (.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, name
    return match.group(1)


def test_the_readme_table_is_the_constraints_file():
    readme = (ROOT / "README.md").read_text()
    pinned = pins(CONSTRAINTS.read_text())
    floor = pins("\n".join(_makefile_variable("FLOOR_SPEC").split()))
    rows = {name for name, _, _ in table_rows(readme)}
    assert {"torch", "triton", "numpy", "transformers", "trl", "verl", "openrlhf", "deepspeed", "accelerate"} <= rows
    assert not table_problems(readme, pinned, floor)
    # seen failing: the table's transformers one release behind the file
    assert table_problems(readme.replace("2.4.6, 5.25.0", "2.4.6, 5.24.0"), pinned, floor)


def test_the_constraints_file_pins_every_package_make_test_relies_on():
    pinned = pins(CONSTRAINTS.read_text())
    assert not [name for name in MUST_BE_PINNED if name not in pinned]


def test_make_test_installs_under_the_constraints_file_and_the_makefile_agrees_with_it():
    makefile = (ROOT / "Makefile").read_text()
    assert _makefile_variable("CONSTRAINTS") == "constraints/test.txt"
    stamp = makefile.split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    installs = [line for line in stamp.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert installs and all("$(PIN)" in line for line in installs), installs
    pinned = pins(CONSTRAINTS.read_text())
    for variable in ("TORCH_SPEC", "PEERS", "DEEPSPEED_SPEC", "VERL_SPEC", "OPENRLHF_SPEC"):
        for name, version in pins("\n".join(_makefile_variable(variable).split())).items():
            assert pinned.get(name) == version, f"Makefile {variable}: {name}=={version}, constraints: {pinned.get(name)}"
