"""The cases of ``gspo-kernels bench`` as a pytest-benchmark suite (fwd + bwd per round).

Each (case, implementation) is one benchmark; peers that are not installed and backends that
cannot run on this device are skipped with the reason. ``extra_info`` holds the throughput
(GFLOP/s for the hidden-state path, GB/s for the logits path; formulas in gspo_kernels/tools/bench.py).
"""

import os

import pytest

from gspo_kernels.tools import bench

FULL = os.environ.get("GSPO_BENCH_FULL") == "1"
CASES = bench.CASES if FULL else bench.QUICK_CASES
ROUNDS = 3 if FULL else 5

PARAMS = []
for case_name, spec in CASES.items():
    for impl in bench.IMPLS[spec["path"]]:
        marks = [pytest.mark.gpu] if impl.startswith("gspo-triton") else []
        PARAMS.append(pytest.param(case_name, impl, id=f"{case_name}-{impl}", marks=marks))


@pytest.mark.parametrize("case_name, impl", PARAMS)
def test_fwd_bwd(benchmark, bench_device, case_name, impl):
    case = CASES[case_name]
    inputs = bench.make_inputs(case, bench_device)
    try:
        step, leaves = bench.build_impl(impl, case, inputs)
    except bench.Skip as exc:
        pytest.skip(str(exc))

    def clear():
        for leaf in leaves:
            leaf.grad = None

    def fwd_bwd():
        loss = step()
        loss.backward()
        if bench_device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        return loss

    benchmark.group = case_name
    loss = benchmark.pedantic(fwd_bwd, setup=clear, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    amount, unit = bench.work(case)
    benchmark.extra_info.update(case=case, impl=impl, unit=unit, loss=float(loss.detach()),
                                rate=amount / benchmark.stats.stats.median / 1e9)
