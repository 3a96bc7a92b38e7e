"""The ``gpu`` marker's rule, shared by ``tests/conftest.py`` and ``benchmarks/conftest.py``."""

import pytest
import torch


def skip_gpu_items_without_cuda(items) -> None:
    """Mark every item carrying ``@pytest.mark.gpu`` as skipped (with the reason) when CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU-only: no CUDA device on this machine (never ran here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
