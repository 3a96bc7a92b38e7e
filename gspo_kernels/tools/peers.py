"""The peers the benchmarks compare against (TRL, Liger, Cut Cross-Entropy) are optional: :func:`peer` imports
one or raises :class:`Skip` saying why, and the run reports that case as skipped with the reason."""

from __future__ import annotations

import importlib


class Skip(Exception):
    """This implementation or case cannot run here (the message says why)."""


def peer(module: str, what: str, package: str = ""):
    """``module.what``, imported; raises :class:`Skip` naming ``package`` (default: ``module``'s top level) when it is
    missing or fails at import on this machine."""
    try:
        return getattr(importlib.import_module(module), what)
    except Exception as exc:  # ImportError, or a peer failing at import here
        name = package or module.split(".")[0]
        raise Skip(f"{name} not installed or not importable here: {module}.{what} "
                   f"({type(exc).__name__}: {str(exc)[:120]})") from exc
