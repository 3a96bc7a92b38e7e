"""Test setup: the Triton interpreter on CPU-only machines, seeds, and the GPU marker."""

import os
import zlib

from gspo_kernels.testing import guard_interpreter_launches, setup_triton_interpreter

# Must happen before anything imports triton: without a GPU, Triton kernels run in the interpreter, every access
# checked against the launch's tensors and the programs of each grid axis run odds first, then evens (a write into
# a neighbour's range then changes a value): docs/testing.md. GSPO_TEST_PROGRAM_ORDER=forward|reverse changes the
# order; GSPO_TEST_OUT_OF_BOUNDS=ignore leaves out-of-bounds accesses out without failing (what values alone show).
if setup_triton_interpreter().startswith("cpu (Triton"):
    guard_interpreter_launches(os.environ.get("GSPO_TEST_PROGRAM_ORDER", "parity"),
                               fail_out_of_bounds=os.environ.get("GSPO_TEST_OUT_OF_BOUNDS", "fail") != "ignore")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.support import skip_gpu_items_without_cuda  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu_items_without_cuda(items)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


SEED_OFFSET = int(os.environ.get("GSPO_TEST_SEED", "0"))


def pytest_report_header(config):
    return [f"parity matrices: each test's seed is crc32(its id from the file name on) + GSPO_TEST_SEED "
            f"({SEED_OFFSET})"]


@pytest.fixture
def case_seed(request) -> int:
    """Seeds torch for this test alone, so that every cell of a parity matrix draws its own inputs around the
    designed responses of ``tests/support.RESPONSES``; ``GSPO_TEST_SEED=n`` draws another sample for all of them.
    A failing test's report shows its seed. The id is taken from the file name on (``test_x.py::test_y[...]``), so
    that moving a test file to another folder keeps its draws."""
    seed = (zlib.crc32(request.node.nodeid.rsplit("/", 1)[-1].encode()) + SEED_OFFSET) % 2**31
    torch.manual_seed(seed)
    request.node.gspo_seed = seed
    return seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "gspo_seed", None)
    if seed is not None and report.failed:
        report.sections.append(("seed", f"torch.manual_seed({seed}) before the test's draws "
                                        f"(GSPO_TEST_SEED={SEED_OFFSET})"))


@pytest.fixture
def row_independent_dot(monkeypatch):
    """Under the interpreter, ``tl.dot`` with each output element summed over ``k`` in one fixed order.

    The interpreter's ``tl.dot`` is numpy's ``matmul``, i.e. the CPU's BLAS, and that is not row-independent
    everywhere: numpy's OpenBLAS on an AMD EPYC (Haswell kernels) rounds rows 6-11 of a ``[16, 32] @ [32, 16]``
    product differently depending on what the other rows of the tile hold. A GPU's MMA computes every output
    element of a tile in the same order whatever the other rows hold, which is what the kernels' batch
    invariance rests on; this fixture gives the interpreter that property (products in the accumulator
    dtype, then a sequential sum over ``k``), so the test checks the kernels' own structure (chunking,
    compaction, reduction steps) on any CPU. On CUDA it changes nothing."""
    from gspo_kernels.backends.triton.launch import interpreter_active

    if not interpreter_active():
        return
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.dtype
        lhs, rhs = a.data.astype(acc), b.data.astype(acc)
        out = d.data.copy()
        for k in range(lhs.shape[-1]):
            out = out + lhs[..., :, k, None] * rhs[..., None, k, :]
        return interpreter.TensorHandle(np.asarray(out, dtype=acc), d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
