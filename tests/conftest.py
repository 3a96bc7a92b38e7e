"""Test setup: the Triton interpreter on CPU-only machines, seeds, and the GPU marker."""

import os

# Must happen before anything imports triton: without a GPU, Triton kernels run in the interpreter.
if os.environ.get("TRITON_INTERPRET") is None:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # pragma: no cover
        pass

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU-only check: no CUDA device on this machine (never ran here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield
