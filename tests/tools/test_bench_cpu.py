"""``gspo-kernels bench`` on the CPU: the peak-memory column counts what each implementation holds for a step."""

from __future__ import annotations

import pytest

from gspo_kernels import available_backends
from gspo_kernels.tools import bench


@pytest.mark.skipif("cpu" not in available_backends("cpu"), reason="the C++ CPU kernels are unavailable here")
def test_cpu_backend_peak_counts_the_gradient_it_keeps_between_steps(capsys):
    """The logits path's out-of-place gradient is allocated in the warm-up and reused by every timed step, so a
    peak taken above the timed steps' start would read 0; the column counts it: one [N, V] gradient."""
    case = dict(path="logits", B=4, T=80, V=32768, dtype="fp32", inactive=0.0)  # [N, V] fp32: 40 MiB
    grad_bytes = case["B"] * case["T"] * case["V"] * 4
    result = bench.run_one("gspo-cpu", case, repeats=2, device="cpu", timeout=120)
    assert result["status"] == "ok", result
    assert 0.9 * grad_bytes <= result["kept_bytes"] <= 1.1 * grad_bytes, result
    assert 0.9 * grad_bytes <= result["peak_extra_bytes"] <= 1.5 * grad_bytes, result
    bench.print_table([dict(case="logits", impl="gspo-cpu", case_spec=case, **result)], {"logits": case})
    out = capsys.readouterr().out
    assert "peak MB includes the buffers the cpu backend keeps between steps" in out and "): gspo-cpu 40 MB" in out
