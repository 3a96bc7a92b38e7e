"""Host-side cost of one call on the Triton backend (forward + backward): ``gspo_loss`` on the logits path, or
``fused_linear_gspo_loss`` on the hidden-state path (``--path hidden``).

What one call costs the CPU, separated from what its kernels cost the GPU: the aten ops dispatched (each a
kernel launch on CUDA, most of them tiny), the Triton launches, the host reads (``.item()``, ``.tolist()``,
``nonzero``, boolean indexing: each a device synchronisation on CUDA), and the Python time per call.

* Without CUDA (this is what it was written for): the Triton launches are replaced by no-ops (the launchers
  still run: every argument is built and every output allocated, only the kernel body is skipped), and the
  tensors are CPU tensors under the Triton interpreter. The Python time per call is then the host work of a
  call with no kernel time in it; on a GPU each aten op adds its launch (a few microseconds) and each Triton
  launch its binder (tens of microseconds).
* With CUDA (``--cuda``): the real kernels; it reports the wall time per call (CUDA events) next to the
  counts.

The hidden-state path (``--path hidden``, CPU only) runs the one-pass loss at the H200 profile's row and
chunk counts (16 x 1024 rows, 16 chunks of 1024 logits rows, a 4096-row ``dZ`` store) on a tiny head (H, V
= 8, 16), so that its real GEMMs cost next to nothing: what it reports is the Python between the call's start,
its one host read, its first logits GEMM and each later GEMM. On a GPU the chunk's GEMMs take milliseconds, so
only the work before the first GEMM (and after the host read, which waits for the device) leaves the GPU idle.

Run: ``python benchmarks/host_overhead.py [--path logits|hidden] [--shape tiny|mid|all] [--cuda] [--repeat 200]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

if "--cuda" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gspo_kernels as gk  # noqa: E402

SHAPES = {"tiny": (2, 8, 64), "mid": (16, 1024, 256)}  # (B, T, V): the call reads logits[:, :-1] of [B, T + 1, V]

# Ops that read a device value back to the host (a synchronisation on CUDA).
HOST_READ_OPS = {"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched (by name) and the host reads among them."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.host_reads = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in HOST_READ_OPS:
            self.host_reads[name] += 1
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                   for i in (args[1] if len(args) > 1 else ()) if i is not None):
            self.host_reads["bool index"] += 1
        return func(*args, **(kwargs or {}))


class LaunchStub:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` counts and returns."""

    launches = Counter()
    first_forward_launch = None  # perf_counter() at the first logprobs_fwd_kernel launch since reset

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            LaunchStub.launches[self.name] += 1
            if self.name == "logprobs_fwd_kernel" and LaunchStub.first_forward_launch is None:
                LaunchStub.first_forward_launch = time.perf_counter()

        return launch


def stub_kernels():
    from gspo_kernels.backends.triton import logits, sequence

    for module, names in ((logits, ("logprobs_fwd_kernel", "logprobs_bwd_kernel")),
                          (sequence, ("gspo_sequence_kernel", "gspo_reduce_kernel"))):
        for name in names:
            setattr(module, name, LaunchStub(name))


class HostReadSpy:
    """Counts ``Tensor.tolist`` / ``item`` / ``__bool__`` calls (on CPU tensors these dispatch no aten op)."""

    def __init__(self):
        self.count = Counter()
        self.saved = {}
        self.last = None  # perf_counter() when the last read returned

    def __enter__(self):
        for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
            original = getattr(torch.Tensor, name)
            self.saved[name] = original

            def spy(t, *a, _original=original, _name=name, **k):
                self.count[_name] += 1
                value = _original(t, *a, **k)
                self.last = time.perf_counter()
                return value

            setattr(torch.Tensor, name, spy)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


def make_inputs(shape, device):
    B, T, V = shape
    g = torch.Generator().manual_seed(0)
    base = torch.randn(B, T + 1, V, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g).to(device)
    adv = torch.randn(B, generator=g).to(device)
    old = (torch.randn(B, T, generator=g) - 5.0).to(device)
    mask = (torch.rand(B, T, generator=g) > 0.1).to(device)
    return base, labels, adv, old, mask


def one_call(base, labels, adv, old, mask):
    out = gk.gspo_loss(base[:, :-1], labels, adv, old, mask=mask, backend="triton")
    return out


def measure(shape_name, device, repeat):
    shape = SHAPES[shape_name]
    base, labels, adv, old, mask = make_inputs(shape, device)
    for _ in range(3):  # warm-up (JIT, caches)
        base.grad = None
        one_call(base, labels, adv, old, mask).loss.backward()

    LaunchStub.launches.clear()
    fwd_ops, bwd_ops = OpCounter(), OpCounter()
    with HostReadSpy() as spy:
        base.grad = None
        with fwd_ops:
            out = one_call(base, labels, adv, old, mask)
        fwd_launches = sum(LaunchStub.launches.values())
        with bwd_ops:
            out.loss.backward()
        bwd_launches = sum(LaunchStub.launches.values()) - fwd_launches

    def timed(fn):
        times = []
        for _ in range(repeat):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times), 1e3 * min(times)

    state = {}

    def fwd():
        base.grad = None
        state["out"] = one_call(base, labels, adv, old, mask)

    def fwd_bwd():
        base.grad = None
        one_call(base, labels, adv, old, mask).loss.backward()

    fwd_ms = timed(fwd)
    total_ms = timed(fwd_bwd)
    to_launch, read_to_launch = [], []
    if device.type == "cpu":  # the part of the host work the GPU waits for: up to the forward kernel's launch
        with HostReadSpy() as spy:
            for _ in range(repeat):
                base.grad = None
                LaunchStub.first_forward_launch = None
                t0 = time.perf_counter()
                one_call(base, labels, adv, old, mask)
                to_launch.append(LaunchStub.first_forward_launch - t0)
                read_to_launch.append(LaunchStub.first_forward_launch - spy.last)
    return {
        "shape": f"{shape_name} B,T,V={shape}",
        "aten ops fwd": sum(fwd_ops.ops.values()),
        "aten ops bwd": sum(bwd_ops.ops.values()),
        "triton launches fwd/bwd": f"{fwd_launches}/{bwd_launches}" if device.type == "cpu" else "n/a",
        "host reads (aten)": dict(fwd_ops.host_reads + bwd_ops.host_reads),
        "host reads (tolist/item/bool)": dict(spy.count),
        "fwd ms (median, min)": fwd_ms,
        "fwd+bwd ms (median, min)": total_ms,
        "start -> fwd launch ms": (1e3 * statistics.median(to_launch), 1e3 * min(to_launch)) if to_launch else "n/a",
        "host read -> fwd launch ms": ((1e3 * statistics.median(read_to_launch), 1e3 * min(read_to_launch))
                                       if read_to_launch else "n/a"),
        "fwd ops": dict(fwd_ops.ops.most_common()),
        "bwd ops": dict(bwd_ops.ops.most_common()),
    }


HIDDEN = dict(B=16, T=1024, H=8, V=16, chunk=1024, store=4096)  # the H200 profile's rows and chunks, a tiny head


class GemmClock:
    """Times (perf_counter) at each GEMM of the one-pass loss: logits chunks and store flushes."""

    def __init__(self):
        self.times = []

    def install(self):
        from gspo_kernels.backends.triton import chunked_gemm, linear, linear_loss

        original_logits, original_dw = chunked_gemm.chunk_logits, chunked_gemm.accumulate_dw

        def chunk_logits(*a, **k):
            self.times.append(("logits", time.perf_counter()))
            return original_logits(*a, **k)

        def accumulate_dw(*a, **k):
            self.times.append(("dw", time.perf_counter()))
            return original_dw(*a, **k)

        chunked_gemm.chunk_logits, chunked_gemm.accumulate_dw = chunk_logits, accumulate_dw
        linear_loss.chunk_logits = chunk_logits  # the one-pass loss's own binding of chunked_gemm.chunk_logits
        linear.configs.one_pass_chunk_rows = lambda *a, **k: (HIDDEN["chunk"], HIDDEN["store"])


def measure_hidden(repeat):
    """The hidden-state path's host work per call (kernels stubbed, a tiny head: see the module docstring)."""
    B, T, H, V = (HIDDEN[k] for k in ("B", "T", "H", "V"))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B * T, H, generator=g).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    old = torch.randn(B, T, generator=g) - 5.0

    def call():
        return gk.fused_linear_gspo_loss(hidden.view(B, T, H), weight, labels, adv, old, backend="triton")

    clock = GemmClock()
    clock.install()
    for _ in range(3):
        hidden.grad = weight.grad = None
        call().loss.backward()
    fwd_ops, bwd_ops = OpCounter(), OpCounter()
    with HostReadSpy() as spy:
        hidden.grad = weight.grad = None
        with fwd_ops:
            out = call()
        with bwd_ops:
            out.loss.backward()
    start_read, read_gemm, gaps, fwd, bwd = [], [], [], [], []
    with HostReadSpy() as timing:
        for _ in range(repeat):
            hidden.grad = weight.grad = None
            clock.times.clear()
            t0 = time.perf_counter()
            out = call()
            t1 = time.perf_counter()
            out.loss.backward()
            t2 = time.perf_counter()
            stamps = [t for _, t in clock.times]
            start_read.append(timing.last - t0)
            read_gemm.append(stamps[0] - timing.last)
            gaps.append(statistics.median(b - a for a, b in zip(stamps, stamps[1:])))
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    kinds = Counter(kind for kind, _ in clock.times)

    def ms(values):
        return 1e3 * statistics.median(values), 1e3 * min(values)

    return {
        "shape": f"hidden B,T={B},{T} (H, V = {H}, {V}); chunks {HIDDEN['chunk']} rows, store {HIDDEN['store']}",
        "aten ops fwd": sum(fwd_ops.ops.values()),
        "aten ops bwd": sum(bwd_ops.ops.values()),
        "GEMM calls per call": dict(kinds),
        "host reads (aten)": dict(fwd_ops.host_reads + bwd_ops.host_reads),
        "host reads (tolist/item/bool)": dict(spy.count),
        "fwd ms (median, min)": ms(fwd),
        "bwd ms (median, min)": ms(bwd),
        "start -> host read ms": ms(start_read),
        "host read -> first GEMM ms": ms(read_gemm),
        "between GEMM calls ms": ms(gaps),
        "fwd ops": dict(fwd_ops.ops.most_common()),
        "bwd ops": dict(bwd_ops.ops.most_common()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="all", choices=["all", *SHAPES])
    parser.add_argument("--cuda", action="store_true", help="real kernels on the current CUDA device")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--ops", action="store_true", help="list the aten ops of each direction")
    parser.add_argument("--path", default="logits", choices=["logits", "hidden"])
    args = parser.parse_args()
    if args.path == "hidden" and args.cuda:
        parser.error("--path hidden measures the host work with the kernels stubbed: CPU only")
    device = torch.device("cuda" if args.cuda else "cpu")
    if not args.cuda:
        stub_kernels()
    runs = ([lambda: measure_hidden(args.repeat)] if args.path == "hidden" else
            [lambda name=name: measure(name, device, args.repeat) for name in
             (SHAPES if args.shape == "all" else [args.shape])])
    for run in runs:
        result = run()
        for key, value in result.items():
            if key.endswith("ops") and not args.ops:
                continue
            if isinstance(value, tuple):
                value = f"{value[0]:.3f} / {value[1]:.3f}"
            print(f"{key:32s} {value}")
        print()


if __name__ == "__main__":
    main()
