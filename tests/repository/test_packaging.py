"""Packaging: the sdist and the wheel build in isolation (no torch at build time), the wheel is pure Python and
carries the C++ sources, each installs into a fresh virtual environment that has only torch, where the README's
example and ``gspo-kernels verify --quick`` run with ``backend="cpu"`` compiled at first use. Also the first-use
build's lock, the fallback without a compiler and ``gspo-kernels --version``.

The fresh environments get torch from pip (this machine's local wheel cache: the same version as the one
running the tests), never from the development environment, so nothing of the checkout leaks into them.
Building the sdist needs the ``build`` package (the Makefile installs it); without it the module is skipped,
except under ``GSPO_KERNELS_REQUIRE_EXT=1`` (``make test``), where that is an error.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import backends
from gspo_kernels.backends.cpu import build as cpu_build

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".cpp", ".h"))
# Machine code in an archive member: ELF, Mach-O (32/64-bit, either byte order, universal), PE.
BINARY_MAGIC = (b"\x7fELF", b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe", b"\xfe\xed\xfa\xcf", b"\xca\xfe\xba\xbe", b"MZ")
COMPILED_SUFFIXES = (".so", ".pyd", ".dylib", ".dll", ".o", ".a")
IGNORED = shutil.ignore_patterns(".git", ".venv", "__pycache__", "build", "dist", "*.egg-info", "results", "*.so",
                                 ".pytest_cache", ".ruff_cache", ".benchmarks")

try:
    import build  # noqa: F401
except ImportError as exc:
    if os.environ.get("GSPO_KERNELS_REQUIRE_EXT") == "1":
        raise RuntimeError("the packaging tests need the `build` package (pip install build); make installs it") from exc
    pytest.skip("the `build` package is not installed (pip install build)", allow_module_level=True)


def _clean_env(**extra: str) -> dict:
    """The environment of a command in a fresh virtual environment: nothing that points at the checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "TRITON_INTERPRET")}
    env.update(extra)
    return env


def _run(cmd, *, cwd: Path, env: dict | None = None, timeout: float = 600) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or _clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict:
    """A copy of the checkout, and the sdist plus the wheel built from that sdist (``python -m build``: both in
    isolated build environments, which have no torch)."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=IGNORED)
    _run([sys.executable, "-m", "build", "--outdir", tmp / "dist", src], cwd=tmp, env=dict(os.environ))
    (sdist,) = (tmp / "dist").glob("*.tar.gz")
    (wheel,) = (tmp / "dist").glob("*.whl")
    return dict(tmp=tmp, src=src, sdist=sdist, wheel=wheel)


@pytest.fixture(scope="module")
def fresh_venv(dist) -> Path:
    """A virtual environment with pip's torch (the version running these tests) and nothing else; shared by the
    two install tests (each installs the package into it with pip's default options, after removing what the
    other installed: installing torch takes most of a fresh venv's time)."""
    path = dist["tmp"] / "venv"
    _run([sys.executable, "-m", "venv", path], cwd=path.parent)
    python = path / "bin" / "python"
    _run([python, "-m", "pip", "install", "-q", f"torch=={md.version('torch')}"], cwd=path.parent)
    return python


def _install_fresh(python: Path, what: Path, cwd: Path) -> None:
    """``pip install what`` with pip's defaults into ``python``'s venv, no gspo-kernels there before."""
    _run([python, "-m", "pip", "uninstall", "-q", "-y", "gspo-kernels"], cwd=cwd)  # a no-op when absent
    listed = _run([python, "-m", "pip", "list", "--format=freeze"], cwd=cwd)
    assert "gspo-kernels" not in listed and "gspo_kernels" not in listed, listed
    _run([python, "-m", "pip", "install", "-q", what], cwd=cwd)


def _readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return blocks[0]


def _check_install(python: Path, workdir: Path, env: dict) -> str:
    """Runs the README's example and ``gspo-kernels verify --quick`` with ``python``'s environment; returns
    ``gspo-kernels --version``."""
    script = workdir / "readme_example.py"
    script.write_text(_readme_example() + textwrap.dedent("""
        import pathlib, sys
        assert torch.isfinite(loss), loss
        assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
        assert "cpu" in gk.available_backends(), gk.backends.unavailable_reason("cpu")
        assert pathlib.Path(gk.__file__).is_relative_to(sys.prefix), gk.__file__  # the installed copy
        from gspo_kernels.backends.cpu import build as cpu_build
        assert cpu_build.SOURCE_DIR == pathlib.Path(gk.__file__).parent / "csrc", cpu_build.SOURCE_DIR  # its sources
        print("README example OK")
    """))
    assert "README example OK" in _run([python, script], cwd=workdir, env=env)
    out = _run([python.parent / "gspo-kernels", "verify", "--quick", "--seed", "7"], cwd=workdir, env=env)
    assert re.search(r"^\d+ passed, 0 failed$", out, re.M), out
    assert re.search(r"^cpu ", out, re.M), f"backend 'cpu' was not verified:\n{out}"
    return _run([python.parent / "gspo-kernels", "--version"], cwd=workdir, env=env)


def _compiled_members(wheel: Path) -> list:
    with zipfile.ZipFile(wheel) as whl:
        return [n for n in whl.namelist() if n.endswith(COMPILED_SUFFIXES) or whl.read(n)[:4].startswith(BINARY_MAGIC)]


@pytest.mark.network
def test_wheel_is_pure_python_and_carries_the_cpp_sources(dist):
    assert _compiled_members(dist["wheel"]) == [], "compiled code in the wheel"
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = whl.namelist()
        wheel_meta = next(whl.read(n).decode() for n in names if n.endswith(".dist-info/WHEEL"))
        metadata = next(whl.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = next(whl.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
        for name in SOURCES:
            assert whl.read(f"gspo_kernels/csrc/{name}") == (ROOT / "csrc" / name).read_bytes()
        assert sorted(n for n in names if "csrc/" in n) == [f"gspo_kernels/csrc/{name}" for name in SOURCES]
    assert dist["wheel"].name.endswith("-py3-none-any.whl")
    assert "Root-Is-Purelib: true" in wheel_meta and "Tag: py3-none-any" in wheel_meta
    assert "Name: gspo-kernels" in metadata and f"Version: {gk.__version__}" in metadata
    assert "License-Expression: MIT" in metadata
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.M)
    assert any(r.startswith("torch>=") for r in requires)
    assert not any(r.startswith("tests") for r in names)
    assert "gspo-kernels = gspo_kernels.tools.cli:main" in entry_points


@pytest.mark.network
def test_pip_wheel_of_the_checkout_is_pure_python(dist, tmp_path):
    """``pip wheel --no-deps <checkout>`` with pip's defaults (build isolation): no compiled code."""
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path, dist["src"]], cwd=tmp_path)
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    assert _compiled_members(wheel) == []


@pytest.mark.network
def test_sdist_carries_the_cpp_sources_and_no_binaries(dist):
    with tarfile.open(dist["sdist"]) as sdist:
        members = {m.name.split("/", 1)[1]: m for m in sdist.getmembers() if "/" in m.name and m.isfile()}
        binaries = [n for n, m in members.items()
                    if n.endswith(COMPILED_SUFFIXES) or sdist.extractfile(m).read(4).startswith(BINARY_MAGIC)]
        sources = {s: sdist.extractfile(members[f"csrc/{s}"]).read() for s in SOURCES if f"csrc/{s}" in members}
        setup_py = sdist.extractfile(members["setup.py"]).read().decode() if "setup.py" in members else ""
    assert binaries == []
    for name in ["pyproject.toml", "setup.py", "LICENSE", "README.md"] + [f"csrc/{s}" for s in SOURCES]:
        assert name in members, f"{name} missing from the sdist"
    assert sources == {s: (ROOT / "csrc" / s).read_bytes() for s in SOURCES}
    assert not any(n.startswith("gspo_kernels/csrc/") for n in members), "a second copy of the C++ sources"
    # setup.py only maps csrc/ into the package: it compiles nothing (the wheel stays pure Python)
    assert '"gspo_kernels.csrc": "csrc"' in setup_py and "ext_modules" not in setup_py


@pytest.mark.network
def test_wheel_installs_into_a_fresh_venv_and_runs(dist, fresh_venv):
    """The wheel built from the sdist, installed with pip's default options; the C++ kernels come from the
    per-user cache (``make test`` built them for these very sources) or are compiled here."""
    python = fresh_venv
    _install_fresh(python, dist["wheel"], dist["tmp"])
    version = _check_install(python, dist["tmp"], _clean_env(GSPO_KERNELS_REQUIRE_EXT="1"))
    assert f"gspo-kernels {gk.__version__}" in version and f"torch {torch.__version__}" in version
    assert re.search(r"C\+\+ CPU kernels: built, cached at .*_C\.so", version), version


@pytest.mark.network
def test_checkout_installs_with_default_pip_options_and_compiles_at_first_use(dist, fresh_venv, tmp_path):
    """``pip install <checkout>`` (build isolation on) into a fresh venv, then the C++ kernels compiled from the
    installed sources into an empty cache on first use by the README's example, with the venv not activated and
    no ninja on PATH (only the compiler's tools): the ``ninja`` dependency's binary is found anyway."""
    python = fresh_venv
    _install_fresh(python, dist["src"], tmp_path)
    cache = tmp_path / "cache"
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("c++", "as", "ld", "which", "sh"):
        if shutil.which(tool):
            (tools / tool).symlink_to(shutil.which(tool))
    env = _clean_env(GSPO_KERNELS_REQUIRE_EXT="1", GSPO_KERNELS_CACHE=str(cache), PATH=str(tools))
    version = _check_install(python, tmp_path, env)
    (library,) = cache.glob("cpu-torch*/_C.so")
    assert f"built, cached at {library}" in version
    assert not list(cache.glob(".cpu-*")), "a staging directory was left behind"


@pytest.mark.network
def test_editable_install_compiles_the_checkouts_top_level_csrc(dist, fresh_venv, tmp_path):
    """``pip install -e <checkout>`` into a fresh venv: the package runs from the checkout, and the first-use build
    compiles the checkout's top-level ``csrc/`` (the same cache key as the wheel's copy of those sources)."""
    python = fresh_venv
    _run([python, "-m", "pip", "uninstall", "-q", "-y", "gspo-kernels"], cwd=tmp_path)
    _run([python, "-m", "pip", "install", "-q", "-e", dist["src"]], cwd=tmp_path)
    env = _clean_env(GSPO_KERNELS_REQUIRE_EXT="1")
    out = _run([python, "-c", "import gspo_kernels as gk; from gspo_kernels.backends.cpu import build as b; "
                "print(gk.__file__); print(b.SOURCE_DIR); print(b.cache_dir().name)"], cwd=tmp_path, env=env)
    package_file, source_dir, key = out.split()
    assert Path(package_file) == dist["src"] / "gspo_kernels" / "__init__.py"
    assert Path(source_dir) == dist["src"] / "csrc" and not (dist["src"] / "gspo_kernels" / "csrc").exists()
    assert key == cpu_build.cache_dir().name
    assert "gspo-kernels build-ext: " in _run([python.parent / "gspo-kernels", "build-ext"], cwd=tmp_path, env=env)
    _run([python, "-m", "pip", "uninstall", "-q", "-y", "gspo-kernels"], cwd=tmp_path)


def test_a_checkout_builds_its_top_level_csrc():
    """Run from the checkout (``PYTHONPATH``, as the tests do): the sources are the top-level ``csrc/``, the only copy."""
    assert Path(gk.__file__).resolve().parent == ROOT / "gspo_kernels"
    assert cpu_build.SOURCE_DIR == ROOT / "csrc"
    assert cpu_build.source_files() == [ROOT / "csrc" / name for name in SOURCES]
    assert not (ROOT / "gspo_kernels" / "csrc").exists()


# ---------------------------------------------------------------------------------------------
# The first-use build: its lock, the fallback without a compiler, --version.
# ---------------------------------------------------------------------------------------------

_FAKE_BUILD = """
import os, sys, time
from pathlib import Path
from gspo_kernels.backends.cpu import build as cpu_build

def fake_compile(build_directory, log, verbose):  # a slow "compiler": counts its runs, writes the library last
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(1.5)
    (Path(build_directory) / "_C.so").write_bytes(b"not a library")

cpu_build._compile = fake_compile
while time.time() < float(sys.argv[2]):  # start together
    time.sleep(0.01)
print(cpu_build.build())
"""


def test_concurrent_first_use_builds_once(tmp_path):
    """Four processes (as torchrun ranks) needing the library at once: one compiles, all get the same path, no
    staging directory stays behind (nor the one a killed build left)."""
    cache = tmp_path / "cache"
    env = _clean_env(GSPO_KERNELS_CACHE=str(cache), PYTHONPATH=str(ROOT))
    env_key_dir = subprocess.run([sys.executable, "-c", "from gspo_kernels.backends.cpu import build as b; "
                                  "print(b.cache_dir().name)"], env=env, capture_output=True, text=True,
                                 cwd=tmp_path, check=True).stdout.strip()
    killed = cache / f".{env_key_dir}.killed"
    killed.mkdir(parents=True)
    counter = tmp_path / "compiles.txt"
    start = time.time() + 6.0  # after every process has imported torch
    procs = [subprocess.Popen([sys.executable, "-c", _FAKE_BUILD, str(counter), str(start)], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    paths = {out.strip() for out, _ in results}
    assert paths == {str(cache / env_key_dir / "_C.so")}
    assert len(counter.read_text().split()) == 1, "the library was compiled more than once"
    assert not killed.exists() and not list(cache.glob(".cpu-*"))


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A fresh backend registry in an environment without a C++ compiler and with an empty build cache."""
    from gspo_kernels.backends.cpu import ops as cpu_ops

    monkeypatch.setenv("GSPO_KERNELS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.delenv("GSPO_KERNELS_REQUIRE_EXT", raising=False)
    monkeypatch.setattr(backends, "_cache", {})
    monkeypatch.setattr(backends, "_errors", {})
    monkeypatch.setattr(cpu_build, "_loaded_path", None)
    monkeypatch.setattr(cpu_ops, "_registered", False)
    return monkeypatch


def test_without_a_compiler_cpu_is_unavailable_with_one_warning_and_auto_runs_torch(no_compiler):
    logits = torch.randn(6, 50, dtype=torch.float64)
    labels = torch.randint(0, 50, (6,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = gk.available_backends("cpu")
        again = gk.available_backends("cpu")
        chosen = backends.resolve("auto", torch.device("cpu"))
        logp = gk.token_logprobs(logits.float(), labels)
    assert "cpu" not in names and "torch" in names and again == names
    assert chosen.name == "torch"
    reason = backends.unavailable_reason("cpu")
    assert "no C++ compiler" in reason and "no-such-compiler" in reason
    ours = [w for w in caught if "backend 'cpu'" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning) and reason in str(ours[0].message)
    expected = logits.log_softmax(-1).gather(-1, labels[:, None])[:, 0]
    assert torch.allclose(logp.double(), expected, rtol=0, atol=1e-5)


def test_a_compile_error_makes_cpu_unavailable_with_the_compilers_message(no_compiler, tmp_path):
    """A source that does not compile: the reason quotes the compiler's error line and points at the log."""
    broken = tmp_path / "csrc"
    shutil.copytree(cpu_build.SOURCE_DIR, broken)
    for source in broken.glob("*.cpp"):  # a fatal error first thing in every file: each compile stops at once
        source.write_text('#include "gspo_kernels_test_broken_source.h"\n' + source.read_text())
    no_compiler.setattr(cpu_build, "SOURCE_DIR", broken)
    no_compiler.delenv("CXX")
    with pytest.warns(RuntimeWarning, match="gspo_kernels_test_broken_source"):
        assert "cpu" not in gk.available_backends("cpu")
    reason = backends.unavailable_reason("cpu")
    assert re.search(r"compiling the C\+\+ CPU kernels failed: .*error: gspo_kernels_test_broken_source\.h", reason)
    log = cpu_build.cache_root() / f"{cpu_build.cache_dir().name}.log"
    assert f"full output: {log}" in reason and "gspo_kernels_test_broken_source" in log.read_text()
    assert not cpu_build.library_path().exists() and not list(cpu_build.cache_root().glob(".cpu-*"))


def test_require_ext_turns_an_unavailable_cpu_backend_into_an_error(no_compiler):
    no_compiler.setenv("GSPO_KERNELS_REQUIRE_EXT", "1")
    with pytest.raises(RuntimeError, match=r"GSPO_KERNELS_REQUIRE_EXT=1 .*no C\+\+ compiler"):
        gk.available_backends("cpu")
    with pytest.raises(RuntimeError, match="GSPO_KERNELS_REQUIRE_EXT=1"):
        backends.resolve("auto", torch.device("cpu"))


def test_version_reports_package_torch_triton_and_the_cpp_kernels(capsys):
    from gspo_kernels.tools import cli

    backends.load("cpu")  # loaded in this process (make test builds it first)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"gspo-kernels {gk.__version__}\n" in out and f"torch {torch.__version__}\n" in out
    assert re.search(r"^triton \S+", out, re.M)
    assert f"C++ CPU kernels: loaded from {cpu_build.library_path()}" in out


def test_cache_key_follows_the_sources_and_the_flags(monkeypatch, tmp_path):
    """An edited source or a different flag set is a different build directory (never a stale library)."""
    base = cpu_build.cache_dir()
    copy = tmp_path / "csrc"
    shutil.copytree(cpu_build.SOURCE_DIR, copy)
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", copy)
    assert cpu_build.cache_dir() == base
    (copy / "gspo_cpu.h").write_text((copy / "gspo_cpu.h").read_text() + "\n// edited\n")
    edited = cpu_build.cache_dir()
    assert edited != base
    monkeypatch.setattr(cpu_build, "CXX_FLAGS", (*cpu_build.CXX_FLAGS, "-fno-tree-vectorize"))
    assert cpu_build.cache_dir() not in (base, edited)
