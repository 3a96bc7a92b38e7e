"""``gspo-kernels build-ext``: compile the C++ CPU kernels now (into the per-user cache) instead of at first use.

For a developer's environment (``make install`` runs it once), a container image, or a cluster job that
should not pay the compile inside its first training step. Exits 1, with the reason, when the build fails.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose-build", action="store_true", help="show the compiler's commands and output")


def run(args: argparse.Namespace) -> int:
    from gspo_kernels.backends.cpu import build as cpu_build

    try:
        library = cpu_build.build(verbose=args.verbose_build)
    except cpu_build.ExtensionUnavailable as exc:
        print(f"gspo-kernels build-ext: {exc}")
        return 1
    print(f"gspo-kernels build-ext: {library}")
    return 0
