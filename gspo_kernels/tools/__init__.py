"""Command-line tools of ``gspo-kernels``: ``verify``, ``bench``, ``h100-report`` (one module each, ``cli`` dispatches)."""
