"""pytest-benchmark suite setup: the cases of ``gspo-kernels bench``, GPU-only cases skipped with a reason.

Run: ``pytest benchmarks/ --benchmark-only`` (quick shapes, a few minutes on 2 CPU cores);
``GSPO_BENCH_FULL=1 pytest benchmarks/ --benchmark-only`` for the full shapes of `gspo-kernels bench` (tens of minutes).
Peak memory is not measured here (pytest runs every case in one process): ``gspo-kernels bench``
measures it in a fresh subprocess per case.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support import skip_gpu_items_without_cuda  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu_items_without_cuda(items)


@pytest.fixture(scope="session")
def bench_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
