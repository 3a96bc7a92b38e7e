"""benchmarks/memory_trace.py's accountant against bytes computed by hand (shape x element size)."""

import gc

import numpy as np
import pytest
import torch

from benchmarks.memory_trace import MemoryTrace


def test_new_storages_count_views_and_in_place_results_do_not():
    a = torch.randn(100, 100)
    with MemoryTrace() as trace:
        b = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        view = b.view(10, 100)  # no new storage
        b.add_(1)  # in place: none
        torch.mul(view, 2, out=view)  # out=: none
        d = a @ a  # 100 x 100 fp32: 40000
        assert trace.current == 44000
        del d
        gc.collect()
        assert trace.current == 4000
        e = torch.zeros(10, dtype=torch.bfloat16)  # 20
        f = a[:64, :32].to(torch.bfloat16)  # a strided view's copy: 64 x 32 x 2 = 4096 (the view of a: none)
    assert trace.peak_bytes == 44000
    assert trace.current == 4000 + 20 + 4096
    assert trace.allocated == 4000 + 40000 + 20 + 4096
    at_peak = {(r.shape, r.dtype, r.op, r.bytes) for r in trace.at_peak()}
    assert at_peak == {((1000,), torch.float32, "empty", 4000), ((100, 100), torch.float32, "mm", 40000)}
    assert all("test_new_storages_count" in r.where[-1] for r in trace.at_peak())
    del b, view, e, f


def test_a_backward_counts_its_gradient_and_frees_what_it_does_not_keep():
    w = torch.randn(50, 40, requires_grad=True)
    x = torch.randn(30, 50)
    with MemoryTrace() as trace:
        y = (x @ w).sum()  # x @ w (30 x 40 fp32, 4800) freed once summed: the sum keeps no input
        assert trace.current == 4
        y.backward()  # the incoming gradient (4), 1 x 1 expanded (no storage), then dW = x^T @ g: 50 x 40 fp32, 8000
    assert trace.peak_bytes == 4 + 4 + 8000
    assert trace.current == 4 + 8000  # the loss and w.grad; the incoming gradient freed
    grad = trace.live[w.grad.untyped_storage()._cdata]
    assert grad.shape == (50, 40) and grad.bytes == 8000


def test_a_peak_inside_a_function_is_the_sum_of_its_live_temporaries():
    x = torch.randn(256, 64)

    def twice():
        t1 = x * 2  # 65536
        t2 = t1 + 1  # 65536: the peak, both alive
        return t2.sum()  # 4 more while t1 and t2 are alive; they die with the frame

    with MemoryTrace() as trace:
        s = twice()
    assert trace.peak_bytes == 65536 * 2 + 4
    assert trace.current == 4
    assert sorted(r.bytes for r in trace.at_peak()) == [4, 65536, 65536]
    del s


def test_adopted_storages_subtract_when_freed_and_tracked_ones_add():
    old = torch.empty(1000, dtype=torch.float64)  # before the start: 8000
    with MemoryTrace() as trace:
        trace.adopt(old, None)
        made_outside = torch.from_numpy(np.zeros(10))  # no op of torch's dispatcher: invisible ...
        assert trace.current == 0
        trace.track(made_outside, "numpy")  # ... until tracked: 80
        assert trace.current == 80
        del old
        gc.collect()
    assert trace.current == 80 - 8000
    assert trace.peak_bytes == 80
    assert [r.op for r in trace.at_peak()] == ["numpy"]


def test_paused_storages_are_not_counted_but_kept_track_of():
    with MemoryTrace() as trace:
        with trace.paused():
            gone = torch.empty(500)  # 2000, freed: nothing remains
            kept = torch.empty(100)  # 400, alive: in uncounted
            del gone
        z = torch.empty(8, dtype=torch.int64)  # 64
    assert trace.peak_bytes == 64 and trace.current == 64
    assert sum(trace.uncounted.values()) == 400
    del kept
    gc.collect()
    assert trace.uncounted == {}
    del z


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="stack_depth"):
        MemoryTrace(stack_depth=-1)
    trace = MemoryTrace()
    with pytest.raises(TypeError, match="tensor"):
        trace.track([1, 2], "list")
    with trace:
        with pytest.raises(RuntimeError, match="already active"):
            trace.__enter__()


def test_a_tensor_pointed_at_an_existing_storage_is_not_new():
    a = torch.randn(100)
    with MemoryTrace() as trace:
        b = a.new_empty(0)  # no bytes
        b.set_(a.untyped_storage(), 0, (100,), (1,))  # a's 400 bytes, allocated before the start
        c = a[10:20].clone()  # 40
    assert trace.peak_bytes == 40 and trace.current == 40
    del b, c


def test_the_formula_refuses_an_unknown_route_and_sums_the_two_pass_head_by_hand():
    from benchmarks.memory_trace import predicted_peak

    with pytest.raises(ValueError, match="route"):
        predicted_peak("three-pass", V=10, H=4, N=6, activations=0)
    parts = predicted_peak("two-pass", V=10, H=4, N=6, activations=100, rows=(2, 8))
    # A, fp32 dW, bf16 head copy, fp32 logits rows, bf16 dZ rows, bf16 hidden copy, bf16 dH, the flush's masked rows
    assert sum(parts.values()) == 100 + 160 + 80 + 80 + 160 + 48 + 48 + 64
    # the sliced backward: A, fp32 dW, R S fp32 logits + bf16 dZ, fp32 dH, bf16 hidden copy, masked rows, a bf16 slice
    parts = predicted_peak("two-pass-sliced", V=40, H=4, N=6, activations=100, slices=(6, 8), forward_rows=2,
                           last_hidden=10)
    assert sum(parts.values()) == 100 + 640 + 192 + 96 + 96 + 48 + 48 + 64
    # ... unless its forward holds more: A + the last hidden state, the bf16 head copy, fp32 logits rows, the copy
    parts = predicted_peak("two-pass-sliced", V=40, H=4, N=6, activations=100, slices=(6, 8), forward_rows=8,
                           last_hidden=10)
    assert sum(parts.values()) == 110 + 320 + 1280 + 48
