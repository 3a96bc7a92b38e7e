"""Builds the C++ CPU kernels (``csrc/``) on first use, into a per-user cache, and loads them.

The wheel is pure Python: it carries the C++ sources as package data (``gspo_kernels/csrc``; a checkout has
them in its top-level ``csrc/``: :func:`_find_source_dir`), and the first process that needs ``backend="cpu"``
compiles them with :func:`torch.utils.cpp_extension.load` against the torch it runs with (about a minute on
2 cores, once). Why this design, and not a compiled wheel: ``docs/install.md``.

Cache: ``$GSPO_KERNELS_CACHE``, else ``$XDG_CACHE_HOME/gspo_kernels``, else ``~/.cache/gspo_kernels``; one
directory per key. The key hashes everything the binary depends on: the torch build (version, git revision,
C++ ABI), the Python ABI and platform, the compiler (``$CXX``) and flags, the contents of the sources, and the
CPU's model and feature flags, because the code is compiled with ``-march=native`` (a home directory shared
by cluster nodes of different CPUs gets one build per CPU kind, never an AVX-512 binary on a CPU without it).

Concurrency: a build runs under an exclusive ``fcntl.flock`` on ``<key>.lock``, in a private temporary
directory that is renamed to its final name only when complete; a process that finds the final directory
loads it without locking. Several torchrun ranks importing at once: one builds, the others wait, then load.
A killed build leaves its temporary directory behind; the next build under the lock removes it.

Environment: ``GSPO_KERNELS_CACHE`` (the cache root), ``GSPO_KERNELS_NO_EXT=1`` (never build or load: the
``cpu`` backend is unavailable), ``GSPO_KERNELS_REQUIRE_EXT=1`` (an unavailable ``cpu`` backend is an error,
see :mod:`gspo_kernels.backends`), ``GSPO_KERNELS_VERBOSE_BUILD=1`` (show the compiler's output), ``CXX``,
``MAX_JOBS`` (parallel compiler jobs, read by torch).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

logger = logging.getLogger("gspo_kernels")

# Bumped when the way the library is built or laid out changes (not for source changes: those are hashed).
BUILD_FORMAT = 1
LIBRARY_NAME = "_C"  # module.cpp defines PyInit__C; the operators register under torch.ops.gspo_kernels


def _find_source_dir() -> Path:
    """Where the C++ sources are: ``gspo_kernels/csrc`` inside an installed package (the wheel maps the
    checkout's top-level ``csrc/`` there), else the top-level ``csrc/`` beside the package folder (a source
    checkout, an editable install, a ``PYTHONPATH`` run). Neither: the installed location, which
    :func:`_check_platform` reports as missing."""
    package = Path(__file__).resolve().parents[2]
    for candidate in (package / "csrc", package.parent / "csrc"):
        if (candidate / "module.cpp").is_file():
            return candidate
    return package / "csrc"


SOURCE_DIR = _find_source_dir()

# No -ffast-math: its reciprocal approximations and reassociation change results (a logit scaled by
# 1/temperature = 1e6 must round the same way everywhere). -ffp-contract=off: no implicit FMA, so one
# expression gives the same bits wherever it is written (the code uses std::fma explicitly where it wants
# one). -fno-math-errno / -fno-trapping-math let GCC vectorize floor and selects. -march=native: the build
# runs on the machine that runs the code (the CPU is part of the cache key). -DNDEBUG -fwrapv: as Python's
# own extension flags, which the former setup.py build used.
CXX_FLAGS = ("-O3", "-g0", "-DNDEBUG", "-fwrapv", "-march=native", "-fno-math-errno", "-fno-trapping-math",
             "-ffp-contract=off")
OPENMP_FLAGS = () if sys.platform == "darwin" else ("-fopenmp",)

_loaded_path: Optional[Path] = None


class ExtensionUnavailable(RuntimeError):
    """The C++ CPU kernels cannot be built or loaded here; the message says why."""


def source_files() -> List[Path]:
    """The shipped C++ sources and headers (all of them enter the cache key)."""
    return sorted(p for p in SOURCE_DIR.glob("*") if p.suffix in (".cpp", ".h"))


def cache_root() -> Path:
    """Where builds are kept: ``$GSPO_KERNELS_CACHE``, ``$XDG_CACHE_HOME/gspo_kernels`` or ``~/.cache/gspo_kernels``."""
    explicit = os.environ.get("GSPO_KERNELS_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "gspo_kernels"


def cpu_signature() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
        wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")  # x86 and aarch64 names
        fields = {}
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in wanted and key not in fields:
                fields[key] = " ".join(sorted(value.split())) if key in ("flags", "Features") else value.strip()
        if fields:
            return ";".join(f"{k}={fields[k]}" for k in sorted(fields))
    except OSError:
        pass
    return f"{platform.machine()};{platform.processor()}"


def build_flags() -> Dict[str, List[str]]:
    """Compiler and linker flags of the build."""
    return {"cflags": [*CXX_FLAGS, *OPENMP_FLAGS], "ldflags": list(OPENMP_FLAGS)}


def cache_dir() -> Path:
    """The directory that holds (or will hold) the build for this torch, Python, CPU, compiler and sources."""
    import torch

    digest = hashlib.sha256()
    parts = [
        f"format={BUILD_FORMAT}",
        f"torch={torch.__version__}",
        f"torch_git={getattr(torch.version, 'git_version', '')}",
        f"cxx11_abi={getattr(torch._C, '_GLIBCXX_USE_CXX11_ABI', '')}",
        f"python={sys.implementation.cache_tag}",
        f"ext_suffix={sysconfig.get_config_var('EXT_SUFFIX')}",
        f"platform={sysconfig.get_platform()}",
        f"cxx={os.environ.get('CXX', 'c++')}",
        f"flags={build_flags()}",
        f"cpu={cpu_signature()}",
    ]
    for part in parts:
        digest.update(part.encode() + b"\0")
    for path in source_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    torch_version = "".join(c if c.isalnum() or c in ".+-" else "_" for c in torch.__version__)
    return cache_root() / f"cpu-torch{torch_version}-{sys.implementation.cache_tag}-{digest.hexdigest()[:16]}"


def library_path() -> Path:
    """The shared library inside :func:`cache_dir` (it exists only once built)."""
    return cache_dir() / f"{LIBRARY_NAME}.so"


def _check_platform() -> None:
    if os.environ.get("GSPO_KERNELS_NO_EXT") == "1":
        raise ExtensionUnavailable("disabled by GSPO_KERNELS_NO_EXT=1")
    if os.name != "posix":
        raise ExtensionUnavailable(f"the C++ CPU kernels are built on Linux and macOS only, not on {sys.platform}")
    if not source_files():
        raise ExtensionUnavailable(f"the C++ sources are missing from {SOURCE_DIR} (an incomplete installation)")


def _with_ninja_on_path() -> Dict[str, str]:
    """``os.environ`` changes that put a ninja on PATH (torch runs ``ninja`` by name): the ``ninja`` wheel's
    binary, or this interpreter's scripts directory, which holds it in a virtual environment that was not
    activated. Raises when there is no ninja at all."""
    if shutil.which("ninja"):
        return {}
    candidates = []
    try:
        import ninja  # the PyPI package (a dependency of gspo-kernels)

        candidates.append(getattr(ninja, "BIN_DIR", ""))
    except ImportError:
        pass
    candidates += [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    for directory in candidates:
        if directory and shutil.which("ninja", path=directory):
            return {"PATH": directory + os.pathsep + os.environ.get("PATH", "")}
    raise ExtensionUnavailable("the ninja build tool is not installed (pip install ninja)")


def _check_tools() -> Dict[str, str]:
    """Raises when the compiler or ninja is missing; returns the environment changes :func:`_compile` needs."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise ExtensionUnavailable(f"no C++ compiler found ({compiler!r} is not on PATH; install g++ or clang, or set CXX)")
    return _with_ninja_on_path()


def _compile(build_directory: Path, log: Path, verbose: bool) -> None:
    """Compile and link the sources into ``build_directory`` (``torch.utils.cpp_extension.load``; it also
    loads the result into this process, which registers ``torch.ops.gspo_kernels.*``). On failure the
    compiler's output goes to ``log``."""
    from torch.utils import cpp_extension

    env_changes = _check_tools()
    saved = {k: os.environ.get(k) for k in env_changes}
    os.environ.update(env_changes)
    flags = build_flags()
    try:
        cpp_extension.load(
            name=LIBRARY_NAME,
            sources=[str(p) for p in source_files() if p.suffix == ".cpp"],
            extra_cflags=flags["cflags"],
            extra_ldflags=flags["ldflags"],
            build_directory=str(build_directory),
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as exc:  # the compiler's output is in the message; keep it in a log next to the cache
        text = str(exc)
        try:
            log.write_text(text, encoding="utf-8")
            where = f" (full output: {log})"
        except OSError:
            where = ""
        lines = [ln.strip() for ln in text.splitlines()]
        first_error = next((ln for ln in lines if "error:" in ln), None) or (lines[0][:300] if lines else repr(exc))
        raise ExtensionUnavailable(f"compiling the C++ CPU kernels failed: {first_error}{where}") from exc
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def build(verbose: bool = False) -> Path:
    """Make sure the library for this machine is built (build it under the lock if not); returns its path.

    Loads it into this process when this call built it. Raises :class:`ExtensionUnavailable` with the reason.
    """
    _check_platform()
    final = cache_dir()
    library = final / f"{LIBRARY_NAME}.so"
    if library.is_file():
        return library
    _check_tools()  # fail fast, before announcing a build
    import fcntl

    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        lock_file = open(final.parent / f"{final.name}.lock", "a+")
    except OSError as exc:
        raise ExtensionUnavailable(f"cannot write the build cache {final.parent} ({exc}); set GSPO_KERNELS_CACHE") from exc
    with lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)  # waits while another process builds this key
        if library.is_file():  # built by the process we waited for
            return library
        for stale in final.parent.glob(f".{final.name}.*"):  # left by a killed build of this key
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # a build directory without its library (emptied by hand): replaced
            shutil.rmtree(final)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        logger.warning("gspo_kernels: compiling the C++ CPU kernels for this machine into %s (once; about a minute)",
                       final)
        try:
            _compile(staging, final.parent / f"{final.name}.log",
                     verbose or os.environ.get("GSPO_KERNELS_VERBOSE_BUILD") == "1")
            os.chmod(staging, 0o755)  # mkdtemp made it private; a cache shared by a team stays readable
            os.rename(staging, final)  # atomic: readers see no directory or a complete one
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    global _loaded_path
    _loaded_path = library  # cpp_extension.load loaded it (from the staging path, the same file)
    return library


def load() -> Path:
    """Build if needed, then load the library into this process once (registers ``torch.ops.gspo_kernels.*``)."""
    global _loaded_path
    if _loaded_path is not None:
        return _loaded_path
    library = build()
    if _loaded_path is None:
        import torch

        try:
            torch.ops.load_library(str(library))
        except Exception as exc:
            raise ExtensionUnavailable(f"loading {library} failed: {exc} (delete that directory to rebuild)") from exc
        _loaded_path = library
    return _loaded_path


def status() -> str:
    """One line for ``gspo-kernels --version``: loaded / built (path) / not built yet / unavailable (reason)."""
    if _loaded_path is not None:
        return f"loaded from {_loaded_path}"
    try:
        _check_platform()
        library = library_path()
    except ExtensionUnavailable as exc:
        return f"unavailable: {exc}"
    if library.is_file():
        return f"built, cached at {library}"
    return f"not built yet (compiled at first use of backend 'cpu' into {library.parent}; or run gspo-kernels build-ext)"
