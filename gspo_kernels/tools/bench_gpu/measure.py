"""Measuring, in a section's subprocess: the context of a section, step timing, kernel time, host issue
time, synchronizing ops, the environment, and one case's run."""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .plan import GIB, PEERS, RESULT, SHAPES, Skip

# ---------------------------------------------------------------------------------------------------------
# Measuring (in a section's subprocess).
# ---------------------------------------------------------------------------------------------------------


class _Ctx:
    """The section's device, shapes, deadline and the stream of case results."""

    def __init__(self, device: str, tiny: bool, deadline: float, peers: Sequence[str] = PEERS):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.tiny = tiny
        self.shape = SHAPES[tiny]
        self.deadline = deadline
        self.peers = tuple(peers)
        # A --tiny smoke run times fewer steps: it checks the code paths, not the numbers.
        self.warmup, self.reps = (1, 2) if tiny else (2, 5)

    def left_s(self) -> float:
        return self.deadline - time.time()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def emit(self, section: str, case: str, **fields) -> Dict:
        row = dict(section=section, case=case, **fields)
        print(RESULT + json.dumps(row, default=float), flush=True)
        sys.stderr.write(f"  {section} / {case}: {_brief(row)}\n")
        sys.stderr.flush()
        return row

    def clean(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()


def _brief(row: Dict) -> str:
    if row.get("status") != "ok":
        return f"{row.get('status')}: {row.get('reason', '')}"
    parts = [f"{row['ms']:.2f} ms" if "ms" in row else ""]
    if row.get("peak_extra_gib") is not None:
        parts.append(f"peak extra {row['peak_extra_gib']:.2f} GiB")
    for key in ("tflops", "tb_s", "kernel_ms", "issue_ms"):
        if row.get(key) is not None:
            parts.append(f"{key} {row[key]:.3g}")
    return ", ".join(p for p in parts if p)


def time_steps(ctx: _Ctx, step: Callable[[], object], prepare: Optional[Callable[[], None]] = None,
               warmup: Optional[int] = None, reps: Optional[int] = None) -> Dict:
    """Median ms of ``step()`` over ``reps`` calls after ``warmup`` (CUDA events on CUDA, the host clock
    with a synchronize otherwise), and the peak extra memory (CUDA: max allocated above the allocation at
    each timed step's start, after ``prepare()``; None on CPU)."""
    torch = ctx.torch
    # Unset: 2 warm-ups + 5 timed; a --tiny run caps both at 1 + 2.
    warmup = ctx.warmup if warmup is None else (min(warmup, ctx.warmup) if ctx.tiny else warmup)
    reps = ctx.reps if reps is None else (min(reps, ctx.reps) if ctx.tiny else reps)
    times: List[float] = []
    peak = 0
    for i in range(warmup + reps):
        if prepare is not None:
            prepare()
        ctx.sync()
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = step()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        else:
            t0 = time.perf_counter()
            out = step()
            ms = (time.perf_counter() - t0) * 1e3
        del out
        if i >= warmup:
            times.append(ms)
    return dict(ms=statistics.median(times), ms_all=times, warmup=warmup, reps=reps,
                peak_extra_gib=peak / GIB if ctx.cuda else None)


def kernel_ms(ctx: _Ctx, step: Callable[[], object], prepare: Optional[Callable[[], None]] = None,
              record: Optional[Dict] = None) -> Optional[float]:
    """The GPU-busy ms of one ``step()``: the union of its kernels', copies' and memsets' intervals
    (torch.profiler); None on CPU. ``record`` (a dict) receives what else the profiled step shows:
    ``profiled_wall_ms`` (CUDA events around it, as :func:`time_steps` times a step: a wall much below the
    timed median says the timed steps ran slower than this one, e.g. at lower clocks, rather than idled),
    ``before_first_op_ms`` (from the call's start on the host to its first device op: the host work the GPU
    waits for from idle) and ``idle_after_first_op_ms`` (the wall after the first op not covered by device work)."""
    if not ctx.cuda:
        return None
    from torch.profiler import ProfilerActivity, profile, record_function

    torch = ctx.torch
    if prepare is not None:
        prepare()
    ctx.sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        with record_function("gspo_bench_step"):
            out = step()
        end.record()
        ctx.sync()
    del out
    busy_ms, first_op_ms = profiled_busy(prof.events(), "gspo_bench_step")
    if record is not None:
        wall = start.elapsed_time(end)
        record["profiled_wall_ms"] = wall
        if first_op_ms is not None:
            record["before_first_op_ms"] = first_op_ms
            record["idle_after_first_op_ms"] = wall - first_op_ms - busy_ms
    return busy_ms


def profiled_busy(events, mark: Optional[str] = None) -> Tuple[float, Optional[float]]:
    """``(busy ms, ms from the CPU annotation `mark`'s start to the first device op)`` of profiler events: the
    union of the device's kernels, copies and memsets (not the GPU projections of user annotations, which span
    gaps), merged where they overlap; the second is None without ``mark`` or device ops."""
    from torch.autograd import DeviceType

    events = list(events)
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    busy_us, end_us = 0.0, float("-inf")
    for s0, s1 in spans:
        if s1 > end_us:
            busy_us += s1 - max(s0, end_us)
            end_us = s1
    marks = [e.time_range.start for e in events if mark is not None and e.name == mark
             and e.device_type == DeviceType.CPU]
    first = (spans[0][0] - min(marks)) / 1e3 if marks and spans else None
    return busy_us / 1e3, first


_SPIN: Dict[str, float] = {}


def issue_ms(ctx: _Ctx, step: Callable[[], object], prepare: Optional[Callable[[], None]] = None,
             reps: int = 3) -> Dict:
    """Host time to issue one ``step()`` while the GPU is held busy by a spin kernel (``torch.cuda._sleep``):
    the CPU cost of the call, its kernels queued behind the spin. A call that reads the device (the one host read
    a call may make, with the value checks) waits for the spin: then ``waited_on_device`` is true, and the host
    work is taken instead as the CPU time to issue the call from an idle GPU (``issue_method``: its read then
    waits only for the call's own kernels issued before it, the checks' few microseconds). On CPU: None."""
    torch = ctx.torch
    if not ctx.cuda:
        return dict(issue_ms=None, waited_on_device=None)
    if "cycles_per_ms" not in _SPIN:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        torch.cuda.synchronize()
        _SPIN["cycles_per_ms"] = 20_000_000 / max(start.elapsed_time(end), 1e-3)
    spin_ms = 300.0
    out_ms, waited = [], False
    for _ in range(reps):
        if prepare is not None:
            prepare()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(_SPIN["cycles_per_ms"] * spin_ms))
        t0 = time.perf_counter()
        out = step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        del out
        ms = (t1 - t0) * 1e3
        waited = waited or ms > 0.8 * spin_ms
        out_ms.append(ms)
    method = "behind a spin kernel"
    if waited:
        spun, out_ms, method = out_ms, [], "from an idle GPU (the call's host read waits for a busy GPU)"
        for _ in range(reps):
            if prepare is not None:
                prepare()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = step()
            out_ms.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            del out
    return dict(issue_ms=statistics.median(out_ms), issue_ms_all=out_ms, waited_on_device=waited, spin_ms=spin_ms,
                issue_method=method, **({"issue_ms_behind_spin": spun} if waited else {}))


def sync_count(ctx: _Ctx, step: Callable[[], object], prepare: Optional[Callable[[], None]] = None) -> Optional[int]:
    """How many synchronizing operations PyTorch flags in one ``step()`` (``set_sync_debug_mode("warn")``;
    Triton launches and the library's own host reads through them are counted when they go through a
    flagged op such as ``.item()``, ``nonzero`` or a device-to-host copy). None on CPU."""
    import warnings

    torch = ctx.torch
    if not ctx.cuda:
        return None
    if prepare is not None:
        prepare()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("warn")  # it warns once itself, about the mode: not a sync of the step
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    del out
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def _versions() -> Dict[str, Optional[str]]:
    import importlib.metadata as md

    out: Dict[str, Optional[str]] = {}
    for dist in ("gspo-kernels", "torch", "triton", "transformers", "trl", "liger-kernel", "cut-cross-entropy"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    import gspo_kernels

    out["gspo_kernels (imported)"] = gspo_kernels.__version__
    return out


def _environment(ctx: _Ctx) -> Dict:
    torch = ctx.torch
    env = dict(python=platform.python_version(), platform=platform.platform(), versions=_versions(),
               device=str(ctx.device), tiny=ctx.tiny)
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        env.update(device_name=props.name, sm_count=props.multi_processor_count,
                   total_memory_gib=props.total_memory / GIB, cuda=torch.version.cuda, clocks=_gpu_clocks(ctx))
    else:
        env.update(device_name=platform.processor() or "cpu", torch_threads=torch.get_num_threads())
    import gspo_kernels as gk

    env["backends_available"] = list(gk.available_backends())
    return env


_CLOCK_FIELDS = ("clocks.sm", "clocks.max.sm", "clocks.applications.graphics", "power.draw", "power.limit",
                 "temperature.gpu", "clocks_event_reasons.active")


def _gpu_clocks(ctx: _Ctx) -> Optional[Dict[str, str]]:
    """The device's SM clocks, power and the active clock-event (throttle) reasons from ``nvidia-smi``, as
    strings (None when it is missing): what a slower timed run than a profiled one would point to."""
    index = ctx.device.index if ctx.device.index is not None else ctx.torch.cuda.current_device()
    try:
        done = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=" + ",".join(_CLOCK_FIELDS),
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    values = [v.strip() for v in done.stdout.strip().split(",")]
    return dict(zip(_CLOCK_FIELDS, values)) if done.returncode == 0 and len(values) == len(_CLOCK_FIELDS) else None


def _run_case(ctx: _Ctx, section: str, case: str, fn: Callable[[], Dict], need_s: float = 0.0,
              peer: Optional[str] = None) -> Optional[Dict]:
    """Run one case's measurement ``fn`` (returns its fields), catching Skip and errors; emits the row.
    ``peer``: the optional peer the case measures (skipped unless selected)."""

    if peer is not None and peer not in ctx.peers:
        return ctx.emit(section, case, status="skipped", reason=f"peer {peer!r} not selected (--peers)")
    if need_s and ctx.left_s() < need_s:
        return ctx.emit(section, case, status="skipped", reason=f"time budget: {ctx.left_s():.0f} s left, "
                        f"needs ~{need_s:.0f} s")
    try:
        fields = fn()
        row = ctx.emit(section, case, status="ok", **fields)
    except Skip as exc:
        row = ctx.emit(section, case, status="skipped", reason=str(exc))
    except Exception as exc:  # reported in the table and the JSON; the section goes on
        oom = ctx.cuda and isinstance(exc, ctx.torch.cuda.OutOfMemoryError)
        row = ctx.emit(section, case, status="error", reason=f"{'OOM ' if oom else ''}{type(exc).__name__}: {exc}"[:400])
    ctx.clean()
    return row


def _rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))

