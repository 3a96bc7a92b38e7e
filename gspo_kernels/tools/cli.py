"""The ``gspo-kernels`` command: ``verify``, ``bench``, ``h100-report``, ``gpu-check``, ``train``, ``build-ext``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
they are imported only when their subcommand runs (``bench --scaling``: :data:`SCALING`). The help's text is plain (:data:`DESCRIPTION`), not this
docstring's reST.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Optional, Sequence

DESCRIPTION = ("gspo-kernels: the fused GSPO / GRPO loss kernels' command line. Start with "
               "'gspo-kernels verify --quick' (every backend against the float64 reference, seconds on a CPU); "
               "'gspo-kernels SUBCOMMAND --help' for each subcommand's options.")

SUBCOMMANDS = {
    "verify": ("gspo_kernels.tools.verify", "compare every available backend with the float64 reference"),
    "bench": ("gspo_kernels.tools.bench", "time and measure memory of every implementation side by side"),
    "h100-report": ("gspo_kernels.tools.h100_report", "compile every Triton kernel for sm_90a and report resources"),
    "gpu-check": ("gspo_kernels.tools.gpu_check", "the first command on a GPU machine: versions, H100 report, verify, "
                  "GPU tests, Triton tests, memcheck, benchmarks, the whole suite -> results/gpu_check.{json,md}"),
    "train": ("gspo_kernels.train.toy_trainer", "run the toy GSPO/GRPO trainer on a toy task"),
    "build-ext": ("gspo_kernels.tools.build_ext", "compile the C++ CPU kernels now (otherwise: at first use)"),
}

SCALING = "gspo_kernels.tools.bench_scaling"  # bench --scaling


def version_report() -> str:
    """Versions of the package, torch and triton, and the C++ CPU kernels' status (never builds them)."""
    import importlib.metadata as md

    import torch

    import gspo_kernels
    from gspo_kernels.backends.cpu import build as cpu_build

    def installed(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    return "\n".join([
        f"gspo-kernels {gspo_kernels.__version__}",
        f"torch {torch.__version__}",  # with its build tag (+cpu, +cu130), which the distribution's version lacks
        f"triton {triton_line(installed('triton'))}",
        f"C++ CPU kernels: {cpu_build.status()}",
    ])


def triton_line(version: str) -> str:
    """The installed triton's version, with why the Triton backend refuses it when it is older than the floor."""
    from gspo_kernels.versions import triton_problem

    if version == "not installed":
        return version
    problem = triton_problem(version)
    return version if problem is None else f"{version} (the Triton backend is unavailable: {problem})"


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_report())
        parser.exit()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gspo-kernels", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log which backend runs")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of gspo-kernels, torch, triton and the C++ kernels' status")
    sub = parser.add_subparsers(dest="command", required=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(p)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(message)s")
    module_name = SUBCOMMANDS[args.command][0]
    if args.command == "bench" and getattr(args, "scaling", False):
        module_name = SCALING  # its flags are bench's; its module imports bench's measuring, so bench cannot import it
    module = importlib.import_module(module_name)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
