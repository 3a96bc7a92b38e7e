"""The versions this package is tested on, and the one check that refuses an older triton by name.

Floors (the oldest versions on which the whole kernel, conformance and trainer suite passes; ``make
test-compat`` runs it there): torch 2.8 and the triton it ships, 3.4. Older tritons fail inside the
kernels (triton 3.2 cannot index a ``constexpr`` tuple; on triton 3.3 about half of the Triton kernels'
tests fail), so the Triton backend refuses them before any kernel is built: ``backend="auto"`` then runs
the ``torch`` backend on CUDA tensors (one ``RuntimeWarning`` says why), and ``backend="triton"`` raises
:class:`UnsupportedVersion`. The torch floor is declared in the package's requirements (``torch>=2.8``).

Imports neither torch nor triton at import time.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

MIN_TORCH = (2, 8)
MIN_TRITON = (3, 4)


class UnsupportedVersion(RuntimeError):
    """An installed dependency is older than the floor this package is tested on."""


def parse(version: str) -> Tuple[int, ...]:
    """``"3.4.0+git1234"`` -> ``(3, 4, 0)``: the leading numeric release, pre-release tags ignored."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", str(version))
    if match is None:
        raise ValueError(f"cannot read a version number from {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def _floor(version: Tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def triton_problem(installed: Optional[str] = None) -> Optional[str]:
    """Why the installed triton cannot run this package's kernels (None when it can).

    ``installed``: a version string to judge (default: the imported ``triton.__version__``).
    """
    if installed is None:
        import triton

        installed = triton.__version__
    if parse(installed)[:2] >= MIN_TRITON:
        return None
    return (
        f"triton {installed} is installed, but gspo_kernels' Triton kernels need triton>={_floor(MIN_TRITON)} "
        f"(torch>={_floor(MIN_TORCH)} ships it): upgrade torch (with its triton), or pass backend='torch'"
    )


def check_triton(installed: Optional[str] = None) -> None:
    """Raise :class:`UnsupportedVersion` when the installed triton is older than :data:`MIN_TRITON`."""
    problem = triton_problem(installed)
    if problem is not None:
        raise UnsupportedVersion(problem)
