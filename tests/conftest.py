"""Test setup: the Triton interpreter on CPU-only machines, seeds, and the GPU marker."""

from gspo_kernels.testing import setup_triton_interpreter

# Must happen before anything imports triton: without a GPU, Triton kernels run in the interpreter.
setup_triton_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.support import skip_gpu_items_without_cuda  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu_items_without_cuda(items)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield
