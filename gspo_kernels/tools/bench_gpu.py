"""``gspo-kernels bench --gpu``: the GPU measurements of issue 26 in one run, as ratios against the peers.

Sections, each in a fresh subprocess (a crash or a poisoned CUDA context stays in its section; each
case's figures are streamed back as they come, so a section stopped at its time limit keeps them):

* ``hidden``: N = 16 x 1024 tokens, H = 4096, V = 151936, bf16, GSPO sequence level (eps 3e-4 / 4e-4):
  the bare cuBLAS bf16 GEMM ceiling (8192^3, and ``hidden @ weight.T`` at the shape), then fwd + bwd of
  ``fused_linear_gspo_loss`` (one pass; all rows active, and half the responses at zero advantage),
  plain PyTorch (bf16 GEMM, fp32 ``log_softmax`` + gather, autograd, the same GSPO formula) on the same
  two inputs, TRL's ``ChunkedLogProbFunction`` + the GSPO formula, Cut Cross-Entropy's
  ``linear_cross_entropy`` (cross-entropy log-probs + the GSPO formula) and Liger's
  ``LigerFusedLinearGRPOLoss`` (eager; last, skipped when the time budget is short). For ours: the CUDA
  kernel total of one call (torch.profiler) against the event wall time, the host time to issue one call
  while the GPU is held busy by a spin kernel (a call that reads the device waits for the spin: reported as
  a host read), the synchronizing ops PyTorch flags (``torch.cuda.set_sync_debug_mode``), and the relative
  error of dH / dW against plain PyTorch's. Then the two-pass ``linear_logprobs`` forward (no grad, the old
  log-prob pass) against ``ChunkedLogProbFunction``'s forward.
* ``logits``: ``gspo_loss`` from bf16 logits ``[16, 1025, V]`` read through ``[:, :-1]``, at V = 151936 and
  50257: wall ms per fwd + bwd, the 3-pass floor (forward read + backward read + gradient write of
  ``N * V`` bf16 at the device-to-device copy bandwidth measured in the same section), the host work per
  call (issue time with the GPU held busy; and wall minus kernel time), plain PyTorch, Liger's
  ``triton_grpo_loss`` (sequence level, not in place).
* ``torch-backend``: ``backend="torch"`` on CUDA against plain PyTorch, both paths, at smaller shapes
  (logits ``[8, 1025, 151936]``; hidden N = 4096, H = 4096, V = 151936).
* ``trl-step``: ``benchmarks/trl_step.py`` at the client shape (Qwen3 architecture, 2 layers, hidden 2048,
  V = 151936 untied, bf16 autocast, 8 x 1024 completions after 64-token prompts), stock ``trl.GRPOTrainer``
  then the drop-in, each in a fresh process: ``_compute_loss`` + backward and the old-log-prob pass (medians
  of 3 after a warm-up), the step's peak memory, both losses. Needs trl and a source checkout.

Method: CUDA events around each step, median of 5 after 2 warm-ups (fewer for the slow peers: the JSON
says how many), gradients set to None before each step; peak extra = ``torch.cuda.max_memory_allocated``
above the allocation at the step's start (the gradients count), max over the timed steps;
``torch.cuda.empty_cache`` between cases. TFLOP/s on ``6 N H V`` whatever share of rows carries gradient.
Peers are optional: a missing one is listed as skipped with the reason. The whole run keeps to
``--budget-s`` (hidden option, default 215 s): a section starts only with time left, slow optional cases
are skipped when their section's deadline is near.

Output: a table of ratios and of the issue's targets (met / MISSED), ``<out>.json`` and ``<out>.md``
(``--out``, default ``results/bench_gpu``). Without CUDA: a message and exit status 2. ``--device cpu
--tiny`` (hidden) runs every code path on tiny shapes on the CPU: a smoke test, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds gspo_kernels/
RESULT = "BENCH-GPU-CASE "
SECTIONS = ("hidden", "logits", "trl-step", "torch-backend")
PEERS = ("trl", "liger", "cce")  # the optional peers (--peers, hidden)
DEFAULT_BUDGET_S = 215.0
GIB = float(2**30)

# The issue's shapes, and tiny ones for the CPU smoke test (--tiny).
SHAPES = {
    False: dict(B=16, T=1024, H=4096, V=151936, V_small=50257, gemm=8192, copy_mib=4096,
                torch_logits=dict(B=8, T=1024, V=151936), torch_hidden=dict(B=4, T=1024, H=4096, V=151936)),
    True: dict(B=2, T=16, H=32, V=256, V_small=200, gemm=64, copy_mib=4,
               torch_logits=dict(B=2, T=8, V=128), torch_hidden=dict(B=2, T=8, H=16, V=128)),
}
# Seconds a section may take at most on an H100 (its own timeout), and the least it needs to be worth starting.
SECTION_LIMIT_S = {"hidden": 100.0, "logits": 45.0, "trl-step": 150.0, "torch-backend": 40.0}
SECTION_MIN_S = {"hidden": 40.0, "logits": 15.0, "trl-step": 45.0, "torch-backend": 10.0}

# The issue's targets: (key, text, ratio, limit); ratio <= limit is met.
TARGETS = (
    ("hidden_all", "hidden one-pass, all rows active: ours / plain <= 0.80", 0.80),
    ("hidden_half", "hidden one-pass, half the responses at zero advantage: ours / plain (same inputs) <= 0.55", 0.55),
    ("hidden_peak", "hidden one-pass peak extra memory (default budget, max of both cases) <= 8 GiB", 8.0),
    ("two_pass_fwd", "two-pass linear_logprobs forward / TRL ChunkedLogProbFunction forward <= 1.0", 1.0),
    ("trl_time", "TRL drop-in loss step / stock TRL step time <= 0.85", 0.85),
    ("trl_peak", "TRL drop-in loss step / stock TRL step peak memory <= 0.80", 0.80),
    ("logits_host", "logits path host work per call (issue time, GPU busy), V = 151936 <= 0.5 ms", 0.5),
    ("logits_host_small", "logits path host work per call (issue time, GPU busy), V = 50257 <= 0.5 ms", 0.5),
    ("logits_floor", "logits path: 3-pass floor / wall at V = 151936 >= 0.85 (shown as 0.85 / share <= 1)", 1.0),
    ("logits_floor_small", "logits path: 3-pass floor / wall at V = 50257 >= 0.75 (shown as 0.75 / share <= 1)", 1.0),
    ("torch_logits", "backend='torch' on CUDA / plain PyTorch, logits path <= 1.0", 1.0),
    ("torch_hidden", "backend='torch' on CUDA / plain PyTorch, hidden path <= 1.0", 1.0),
)


class Skip(Exception):
    """This case cannot run here (the message says why)."""


def gspo_formula(logp, old, advantages, mask, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """GSPO (sequence level, ``"grpo"`` aggregation) in PyTorch on ``[B, T]`` fp32 log-probs, as TRL computes it:
    what plain PyTorch and the peers that give log-probs only are completed with (here and in bench.py, which
    imports it; this module does not import bench.py)."""
    import torch

    lengths = mask.sum(-1).clamp(min=1.0)
    seq_log_ratio = ((logp - old) * mask).sum(-1) / lengths
    w = torch.exp(seq_log_ratio)[:, None]
    a = advantages[:, None]
    per_token = -torch.min(w * a, torch.clamp(w, 1 - eps_low, 1 + eps_high) * a)
    return ((per_token * mask).sum(-1) / lengths).mean()


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


def _peer(module: str, what: str):
    """Import ``what`` from ``module`` or raise Skip naming the missing package."""
    import importlib


    try:
        return getattr(importlib.import_module(module), what)
    except Exception as exc:  # ImportError, or a peer failing at import on this machine
        raise Skip(f"{module}.{what} not importable ({type(exc).__name__}: {str(exc)[:120]})") from exc


def _rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# --- the hidden-state section ------------------------------------------------------------------------------


def section_hidden(ctx: _Ctx) -> None:
    import gspo_kernels as gk

    torch, s, dev = ctx.torch, ctx.shape, ctx.device
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    B, T, H, V = s["B"], s["T"], s["H"], s["V"]
    N = B * T
    ctx.emit("hidden", "environment", status="info", environment=_environment(ctx))

    # Ceilings: bare cuBLAS bf16 GEMMs.
    def gemm_square():
        n = s["gemm"]
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        r = time_steps(ctx, lambda: a @ b, warmup=3, reps=10)
        return dict(r, tflops=2 * n**3 / (r["ms"] * 1e-3) / 1e12, n=n)

    gemm = _run_case(ctx, "hidden", "ceiling: cuBLAS bf16 GEMM n^3", gemm_square)
    peak_tflops = gemm.get("tflops") if gemm and gemm.get("status") == "ok" else None

    gen = torch.Generator(device=dev).manual_seed(0)  # on the device: 0.6 G weights drawn on the host take seconds
    hidden = (torch.randn(B, T, H, generator=gen, device=dev) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen, device=dev) * H**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen, device=dev)
    mask = torch.ones(B, T, device=dev)
    adv_all = torch.randn(B, generator=torch.Generator().manual_seed(0)).abs() + 0.5
    adv_all[1::2] *= -1
    adv_half = adv_all.clone()
    adv_half[0::2] = 0.0  # half the responses at zero advantage
    adv_all, adv_half = adv_all.to(dev), adv_half.to(dev)
    with torch.no_grad():
        old = gk.linear_logprobs(hidden, weight, labels).float()  # on-policy: every weight ~1, nothing clipped
    leaves = (hidden, weight)
    flops6 = 6.0 * N * H * V

    def zero_grads():
        for leaf in leaves:
            leaf.grad = None

    def gemm_shape():
        h2 = hidden.detach().reshape(N, H)
        w = weight.detach()
        r = time_steps(ctx, lambda: h2 @ w.t(), warmup=2, reps=5)
        limit = f"; 6NHV at the n^3 rate: {flops6 / (peak_tflops * 1e12) * 1e3:.1f} ms" if peak_tflops else ""
        return dict(r, tflops=2.0 * N * H * V / (r["ms"] * 1e-3) / 1e12, bare_gemms_6nhv_ms=3 * r["ms"],
                    limit_6nhv_ms=flops6 / (peak_tflops * 1e12) * 1e3 if peak_tflops else None,
                    note=f"hidden @ weight.T, bf16 out; x3 (the three GEMMs of 6NHV): {3 * r['ms']:.1f} ms{limit}")

    _run_case(ctx, "hidden", "ceiling: cuBLAS hidden @ weight.T at the shape", gemm_shape)
    for h_size in chunk_gemm_hidden_sizes(H, tiny=ctx.tiny):
        _run_case(ctx, "hidden", f"ceiling: chunk GEMM by rows, H={h_size}",
                  lambda h_size=h_size: chunk_gemm_sweep(ctx, N, h_size, V, dtype, peak_tflops))

    def plain_step(adv):
        def step():
            logits = hidden @ weight.t()
            logp = logits.float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
            del logits
            loss = gspo_formula(logp, old, adv, mask)
            loss.backward()
            return loss
        return step

    def ours_step(adv):
        def step():
            loss = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask).loss
            loss.backward()
            return loss
        return step

    def with_rate(r: Dict) -> Dict:
        r["tflops"] = flops6 / (r["ms"] * 1e-3) / 1e12
        if peak_tflops:
            r["of_gemm_ceiling"] = r["tflops"] / peak_tflops
        return r

    ref: Dict[str, object] = {}

    def plain(adv, keep: bool):
        def fn():
            r = with_rate(time_steps(ctx, plain_step(adv), zero_grads))
            if keep:  # plain PyTorch's gradients: the reference of ours' dH / dW
                ref["dh"], ref["dw"] = hidden.grad.detach().clone(), weight.grad.detach().clone()
            zero_grads()
            return r
        return fn

    def ours(adv, full: bool):
        def fn():
            step = ours_step(adv)
            r = with_rate(time_steps(ctx, step, zero_grads))
            if full and ctx.cuda:
                r["clocks_after_timed_steps"] = _gpu_clocks(ctx)
            if full:
                if "dh" in ref:
                    r["dh_rel_err_vs_plain"] = _rel_err(hidden.grad, ref["dh"])
                    r["dw_rel_err_vs_plain"] = _rel_err(weight.grad, ref["dw"])
                r["kernel_ms"] = kernel_ms(ctx, step, zero_grads, record=r)
                if r["kernel_ms"] is not None:
                    r["wall_minus_kernel_ms"] = r["ms"] - r["kernel_ms"]
                    r["kernel_share_of_wall"] = r["kernel_ms"] / r["ms"]
                r.update(issue_ms(ctx, step, zero_grads))
                r["sync_ops_per_call"] = sync_count(ctx, step, zero_grads)
            zero_grads()
            return r
        return fn

    _run_case(ctx, "hidden", "plain PyTorch, all rows", plain(adv_all, keep=True))
    _run_case(ctx, "hidden", "ours fused_linear_gspo_loss, all rows", ours(adv_all, full=True))
    ref.clear()
    _run_case(ctx, "hidden", "plain PyTorch, half zero advantage", plain(adv_half, keep=False))
    _run_case(ctx, "hidden", "ours fused_linear_gspo_loss, half zero advantage", ours(adv_half, full=False))

    _hidden_peers(ctx, hidden=hidden, weight=weight, labels=labels, mask=mask, old=old, adv_all=adv_all,
                  zero_grads=zero_grads, with_rate=with_rate)


# The chunk GEMM (``linear.chunk_logits``: ``hidden[:m] @ weight.T`` written as fp32 into the chunk buffer) at the
# row counts the library's chunk rules give and their neighbours that are multiples of 128: whether a row count
# that is not a multiple of cuBLAS's tile costs its padding (the sliced route's forward runs 432-row GEMMs at the
# TRL client's shape, the no-grad pass 1760-row ones). H = 2048 is the TRL client's hidden size.
CHUNK_GEMM_ROWS = (384, 512, 1024, 1536, 1664, 1792)
CHUNK_GEMM_TINY_ROWS = (8, 16, 24, 32)


def chunk_gemm_hidden_sizes(H: int, tiny: bool) -> Tuple[int, ...]:
    return (H,) if tiny else tuple(dict.fromkeys((H, 2048)))


def chunk_gemm_rows(N: int, V: int, dtype, tiny: bool) -> List[int]:
    """The sweep's row counts: the library's own chunk rows at ``(N, V)`` (the no-grad pass, the vocabulary-sliced
    route's forward) and :data:`CHUNK_GEMM_ROWS`, at most ``N``."""
    from gspo_kernels.backends.triton import configs

    own = [configs.gemm_chunk_rows(N, V, dtype, budget, need_dz=False)
           for budget in (None, configs.VOCAB_SLICE_BUDGET)]
    fixed = CHUNK_GEMM_TINY_ROWS if tiny else CHUNK_GEMM_ROWS
    return sorted({m for m in (*own, *fixed) if 0 < m <= N})


def chunk_gemm_sweep(ctx: _Ctx, N: int, H: int, V: int, dtype, peak_tflops: Optional[float]) -> Dict:
    """TFLOP/s of the library's chunk GEMM for each row count of :func:`chunk_gemm_rows` (one row of the table;
    ``sweep``: rows -> TFLOP/s, ``ms`` the largest count's)."""
    from gspo_kernels.backends.triton.linear import chunk_logits

    torch, dev = ctx.torch, ctx.device
    rows = chunk_gemm_rows(N, V, dtype, ctx.tiny)
    gen = torch.Generator(device=dev).manual_seed(1)
    h = (torch.randn(max(rows), H, generator=gen, device=dev) * 0.5).to(dtype)
    w = (torch.randn(V, H, generator=gen, device=dev) * H**-0.5).to(dtype)
    out = torch.empty(max(rows), V, device=dev, dtype=torch.float32)
    sweep, last = {}, None
    for m in rows:
        last = time_steps(ctx, lambda m=m: chunk_logits(h[:m], w, None, out), warmup=2, reps=5)
        sweep[m] = 2.0 * m * H * V / (last["ms"] * 1e-3) / 1e12
    best = max(sweep.values())
    note = ", ".join(f"{m}: {t:.0f}" for m, t in sweep.items())
    return dict(last, tflops=sweep[max(rows)], sweep=sweep, H=H,
                of_gemm_ceiling=sweep[max(rows)] / peak_tflops if peak_tflops else None,
                note=f"TFLOP/s by rows (fp32 out, V = {V}): {note}; best {best:.0f}")


def _hidden_peers(ctx: _Ctx, *, hidden, weight, labels, mask, old, adv_all, zero_grads, with_rate) -> None:
    """The hidden-state section's peers on the same inputs (all rows counted): TRL's chunked log-probs,
    Cut Cross-Entropy and Liger, each with the GSPO formula in PyTorch, and the no-grad forward pass."""
    import gspo_kernels as gk

    torch = ctx.torch
    (B, T), H = labels.shape, hidden.shape[-1]
    N = B * T

    def trl_chunk_size() -> int:
        try:
            from trl.trainer import utils as trl_utils
            return int(getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768))
        except Exception:
            return 32768

    def trl_logp(fn, chunk: int):
        return fn.apply(hidden.reshape(N, H), weight, None, labels.reshape(N), 1.0, chunk, None, 1.0, ())[0]

    def trl_fwd_bwd():
        fn, chunk = _peer("trl.kernels", "ChunkedLogProbFunction"), trl_chunk_size()

        def step():
            logp = trl_logp(fn, chunk).reshape(B, T)
            loss = gspo_formula(logp, old, adv_all, mask)
            loss.backward()
            return loss
        r = with_rate(time_steps(ctx, step, zero_grads))
        r["chunk_size"] = chunk
        zero_grads()
        return r

    _run_case(ctx, "hidden", "TRL ChunkedLogProbFunction + GSPO formula, all rows", trl_fwd_bwd, peer="trl")

    def cce():
        if not ctx.cuda:
            raise Skip("Cut Cross-Entropy's kernels need CUDA")
        linear_cross_entropy = _peer("cut_cross_entropy", "linear_cross_entropy")

        def step():
            nll = linear_cross_entropy(hidden.reshape(N, H), weight, labels.reshape(N), reduction="none")
            loss = gspo_formula(-nll.float().reshape(B, T), old, adv_all, mask)
            loss.backward()
            return loss
        r = with_rate(time_steps(ctx, step, zero_grads))
        r["note"] = "cross-entropy log-probs (default impl and filter) + the GSPO formula in PyTorch"
        zero_grads()
        return r

    _run_case(ctx, "hidden", "Cut Cross-Entropy linear_cross_entropy + GSPO formula", cce, peer="cce")

    # The two-pass head with autograd (the TRL drop-in's route and verl's): the log-probs, the GSPO formula in
    # PyTorch, the backward (over vocabulary slices here: V >= 4 N).
    def two_pass():
        def step():
            logp = gk.linear_logprobs(hidden, weight, labels)
            loss = gspo_formula(logp, old, adv_all, mask)
            loss.backward()
            return loss
        r = with_rate(time_steps(ctx, step, zero_grads))
        zero_grads()
        return r

    _run_case(ctx, "hidden", "ours linear_logprobs + autograd (two pass) + GSPO formula, all rows", two_pass)

    # The two-pass forward (no grad): the old / reference log-prob pass.
    def fwd_ours():
        with torch.no_grad():
            return time_steps(ctx, lambda: gk.linear_logprobs(hidden, weight, labels))

    def fwd_trl():
        fn, chunk = _peer("trl.kernels", "ChunkedLogProbFunction"), trl_chunk_size()
        with torch.no_grad():
            return time_steps(ctx, lambda: trl_logp(fn, chunk))

    _run_case(ctx, "hidden", "forward: ours linear_logprobs (no grad)", fwd_ours)
    _run_case(ctx, "hidden", "forward: TRL ChunkedLogProbFunction (no grad)", fwd_trl, peer="trl")

    def liger():
        cls = _peer("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss")
        loss_fn = cls(beta=0.0, compiled=False, use_ref_model=False, epsilon_low=3e-4, epsilon_high=4e-4,
                      loss_type="grpo", importance_sampling_level="sequence")

        def step():
            out = loss_fn(hidden, weight, labels, mask, adv_all, old_per_token_logps=old)
            loss = out[0] if isinstance(out, tuple) else out
            loss.backward()
            return loss
        r = with_rate(time_steps(ctx, step, zero_grads, warmup=1, reps=2))
        r["note"] = "eager (compiled=False), 1 warm-up + 2 timed"
        zero_grads()
        return r

    _run_case(ctx, "hidden", "Liger LigerFusedLinearGRPOLoss (sequence), all rows", liger,
              need_s=0 if ctx.tiny else 20.0, peer="liger")


# --- the logits section ------------------------------------------------------------------------------------


def _copy_bandwidth(ctx: _Ctx) -> Dict:
    torch = ctx.torch
    n = ctx.shape["copy_mib"] * 2**20 // 2
    src = torch.randn(n, device=ctx.device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    r = time_steps(ctx, lambda: dst.copy_(src), warmup=3, reps=10)
    return dict(r, tb_s=2 * src.numel() * 2 / (r["ms"] * 1e-3) / 1e12, bytes=2 * src.numel() * 2,
                note="device-to-device copy, bytes read + written")


def _logits_inputs(ctx: _Ctx, B: int, T: int, V: int, seed: int = 0):
    import gspo_kernels as gk

    torch = ctx.torch
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    logits = (torch.randn(B, T + 1, V, generator=gen, device=ctx.device) * 2).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen, device=ctx.device)
    adv = torch.randn(B, generator=gen, device=ctx.device)
    mask = torch.ones(B, T, device=ctx.device)
    with torch.no_grad():
        old = gk.token_logprobs(logits.detach()[:, :-1], labels).float()
    return logits, labels, adv, old, mask


def _logits_steps(logits, labels, adv, old, mask, **loss_options) -> Tuple[Callable, Callable, Callable]:
    """``(zero_grads, ours, plain)`` on logits ``[B, T + 1, V]`` (the last position dropped, as a model's
    shifted output): one loss + backward step of ``gspo_loss`` (with ``loss_options``) and of plain PyTorch."""
    import gspo_kernels as gk

    def zero_grads():
        logits.grad = None

    def ours():
        loss = gk.gspo_loss(logits[:, :-1], labels, adv, old, mask=mask, **loss_options).loss
        loss.backward()
        return loss

    def plain():
        logp = logits[:, :-1].float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
        loss = gspo_formula(logp, old, adv, mask)
        loss.backward()
        return loss

    return zero_grads, ours, plain


def section_logits(ctx: _Ctx) -> None:
    s = ctx.shape
    copy = _run_case(ctx, "logits", "ceiling: device-to-device copy", lambda: _copy_bandwidth(ctx))
    tb_s = copy.get("tb_s") if copy and copy.get("status") == "ok" else None
    for V in (s["V"], s["V_small"]):
        _logits_vocab(ctx, V, tb_s)
        ctx.clean()


def _logits_vocab(ctx: _Ctx, V: int, tb_s: Optional[float]) -> None:
    """The logits section's cases at one vocabulary size."""
    B, T = ctx.shape["B"], ctx.shape["T"]
    logits, labels, adv, old, mask = _logits_inputs(ctx, B, T, V)
    itemsize = logits.element_size()
    floor_bytes = 3.0 * B * T * V * itemsize
    floor_ms = floor_bytes / (tb_s * 1e12) * 1e3 if tb_s else None

    zero_grads, ours_step, plain_step = _logits_steps(logits, labels, adv, old, mask)

    def with_floor(r: Dict) -> Dict:
        r.update(floor_ms=floor_ms, floor_bytes=floor_bytes, V=V)
        if floor_ms:
            r["of_floor"] = floor_ms / r["ms"]
        return r

    def ours():
        r = with_floor(time_steps(ctx, ours_step, zero_grads))
        r["kernel_ms"] = kernel_ms(ctx, ours_step, zero_grads, record=r)
        if r["kernel_ms"] is not None:
            r["wall_minus_kernel_ms"] = r["ms"] - r["kernel_ms"]
        r.update(issue_ms(ctx, ours_step, zero_grads))
        r["sync_ops_per_call"] = sync_count(ctx, ours_step, zero_grads)
        zero_grads()
        return r

    def plain():
        r = with_floor(time_steps(ctx, plain_step, zero_grads))
        zero_grads()
        return r

    def liger():
        if not ctx.cuda:
            raise Skip("Liger's triton_grpo_loss needs CUDA")
        fn = _peer("liger_kernel.transformers.grpo_loss", "triton_grpo_loss")

        def step():
            loss = fn(logits, old, None, labels, adv, mask, temperature=1.0, beta=0.0, eps_low=3e-4,
                      eps_high=4e-4, inplace=False, loss_type="grpo", importance_sampling_level="sequence",
                      reduce=True)[0]
            loss.backward()
            return loss
        r = with_floor(time_steps(ctx, step, zero_grads))
        r["note"] = "reads [B, T+1, V] and shifts itself; not in place"
        zero_grads()
        return r

    _run_case(ctx, "logits", f"ours gspo_loss, V={V}", ours)
    _run_case(ctx, "logits", f"plain PyTorch, V={V}", plain)
    _run_case(ctx, "logits", f"Liger triton_grpo_loss (sequence), V={V}", liger, peer="liger")


# --- backend="torch" on CUDA ------------------------------------------------------------------------------


def section_torch_backend(ctx: _Ctx) -> None:
    _torch_backend_logits(ctx)
    ctx.clean()
    _torch_backend_hidden(ctx)


def _torch_backend_logits(ctx: _Ctx) -> None:
    sl = ctx.shape["torch_logits"]
    logits, labels, adv, old, mask = _logits_inputs(ctx, sl["B"], sl["T"], sl["V"], seed=1)

    zero_logits, ours_logits, plain_logits = _logits_steps(logits, labels, adv, old, mask, backend="torch")

    _torch_backend_pair(ctx, f"logits [{sl['B']}, {sl['T'] + 1}, {sl['V']}]", ours_logits, plain_logits, zero_logits)


def _torch_backend_pair(ctx: _Ctx, shape: str, ours: Callable, plain: Callable, prepare: Callable) -> None:
    """``backend="torch"`` and plain PyTorch at one shape of the torch-backend section: one warm-up, 3 timed steps."""
    for label, step in ((f"ours backend='torch', {shape}", ours), (f"plain PyTorch, {shape}", plain)):
        _run_case(ctx, "torch-backend", label,
                  lambda step=step: dict(time_steps(ctx, step, prepare, warmup=1, reps=3), shape=shape))


def _torch_backend_hidden(ctx: _Ctx) -> None:
    import gspo_kernels as gk

    torch = ctx.torch
    sh = ctx.shape["torch_hidden"]
    B, T, H, V = sh["B"], sh["T"], sh["H"], sh["V"]
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator(device=ctx.device).manual_seed(2)
    hidden = (torch.randn(B, T, H, generator=gen, device=ctx.device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen, device=ctx.device) * H**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen, device=ctx.device)
    adv = torch.randn(B, generator=gen, device=ctx.device)
    mask = torch.ones(B, T, device=ctx.device)
    with torch.no_grad():
        old = gk.linear_logprobs(hidden, weight, labels).float()

    def zero_hidden():
        hidden.grad = weight.grad = None

    def ours_hidden():
        loss = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, backend="torch").loss
        loss.backward()
        return loss

    def plain_hidden():
        logp = (hidden @ weight.t()).float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
        loss = gspo_formula(logp, old, adv, mask)
        loss.backward()
        return loss

    _torch_backend_pair(ctx, f"hidden N={B * T}, H={H}, V={V}", ours_hidden, plain_hidden, zero_hidden)


SECTION_FUNCS = {"hidden": section_hidden, "logits": section_logits, "torch-backend": section_torch_backend}


def _section_main() -> None:
    """Entry point of a section subprocess: the spec (JSON) on stdin, one result line per case on stdout.
    ``spec["sections"]``: the sections to run in this process, in order (one on a GPU; all of them in a
    ``--tiny`` smoke run, which saves the interpreter starts)."""
    spec = json.loads(sys.stdin.read())
    ctx = _Ctx(spec["device"], spec["tiny"], spec["deadline"], spec.get("peers", PEERS))
    for section in spec["sections"]:
        SECTION_FUNCS[section](ctx)
        ctx.clean()


# ---------------------------------------------------------------------------------------------------------
# The driver (the parent process: never touches the GPU itself).
# ---------------------------------------------------------------------------------------------------------


def _env_for_children() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _parse_rows(stdout) -> List[Dict]:
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    rows = []
    for line in (stdout or "").splitlines():
        if line.startswith(RESULT):
            try:
                rows.append(json.loads(line[len(RESULT):]))
            except json.JSONDecodeError:
                pass
    return rows


def run_section(section: str, device: str, tiny: bool, limit_s: float, group: Sequence[str] = (),
                peers: Sequence[str] = PEERS) -> Dict:
    """``section`` (and the sections of ``group`` after it) in a fresh process: the rows, the exit status
    and the seconds (on a timeout, the rows streamed so far)."""
    spec = json.dumps(dict(sections=[section, *group], device=device, tiny=tiny, peers=list(peers),
                           deadline=time.time() + limit_s - 5.0))
    cmd = [sys.executable, "-c", "from gspo_kernels.tools.bench_gpu import _section_main; _section_main()"]
    start = time.time()
    try:
        proc = subprocess.run(cmd, input=spec, stdout=subprocess.PIPE, stderr=None, text=True, timeout=limit_s,
                              env=_env_for_children())
        rows, status = _parse_rows(proc.stdout), ("ok" if proc.returncode == 0 else f"exit {proc.returncode}")
    except subprocess.TimeoutExpired as exc:
        rows, status = _parse_rows(exc.stdout), f"timed out after {limit_s:.0f} s"
    return dict(section=section, status=status, seconds=time.time() - start, rows=rows)


def run_trl_step(device: str, tiny: bool, limit_s: float) -> Dict:
    """benchmarks/trl_step.py for stock TRL then the drop-in, each in a fresh process."""
    start = time.time()
    script = os.path.join(ROOT, "benchmarks", "trl_step.py")
    rows: List[Dict] = []
    reason = None
    try:
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            reason = "trl not installed"
    except Exception as exc:  # a broken trl install
        reason = f"trl not importable ({exc})"
    if reason is None and not os.path.exists(script):
        reason = f"{script} not found (needs a source checkout)"
    if reason is not None:
        rows.append(dict(section="trl-step", case="stock TRL vs drop-in", status="skipped", reason=reason))
        sys.stderr.write(f"  trl-step: skipped: {reason}\n")
        return dict(section="trl-step", status="skipped", seconds=0.0, rows=rows)
    precision = "bf16" if device == "cuda" else "fp32"
    status = "ok"
    # the drop-in as it comes, then with gspo_one_pass=True (the loss inside the forward: the check on the default)
    cases = (("trl", "stock trl.GRPOTrainer", []), ("gspo", "drop-in integrations.trl.GRPOTrainer", []),
             ("gspo", "drop-in, gspo_one_pass=True", ["--one-pass"]))
    for case, name, options in cases:
        left = limit_s - (time.time() - start)
        if left < 10:
            rows.append(dict(section="trl-step", case=name, status="skipped", reason="time budget"))
            continue
        cmd = [sys.executable, script, "--case", case, "--precision", precision, "--device", device,
               "--shape", "tiny" if tiny else "client", "--repeats", "3", *options]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=_env_for_children())
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode == 0 and lines:
                figures = json.loads(lines[-1])
                figures["trainer"] = figures.pop("case")
                row = dict(section="trl-step", case=name, status="ok", **figures)
                row["ms"] = row["step_s"] * 1e3
                row["old_ms"] = row["old_s"] * 1e3
                row["peak_extra_gib"] = row["peak_mb"] / 1024
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                row = dict(section="trl-step", case=name, status="error",
                           reason=f"exit {proc.returncode}: {' | '.join(tail)[:400]}")
                status = "error"
        except subprocess.TimeoutExpired:
            row = dict(section="trl-step", case=name, status="error", reason=f"timed out after {left:.0f} s")
            status = "error"
        rows.append(row)
        sys.stderr.write(f"  trl-step / {name}: {_brief(row)}\n")
    return dict(section="trl-step", status=status, seconds=time.time() - start, rows=rows)


def _find(rows: List[Dict], section: str, prefix: str) -> Optional[Dict]:
    for r in rows:
        if r.get("section") == section and str(r.get("case", "")).startswith(prefix) and r.get("status") == "ok":
            return r
    return None


def _ratio(a: Optional[Dict], b: Optional[Dict], key: str = "ms") -> Optional[float]:
    if a is None or b is None or a.get(key) is None or not b.get(key):
        return None
    return a[key] / b[key]


def add_ratios(rows: List[Dict]) -> None:
    """Each row's ``x_plain`` (ms over the plain PyTorch row of its group) in place."""
    groups = {
        "hidden": ("plain PyTorch, all rows", lambda c: "half zero advantage" not in c),
        "hidden-half": ("plain PyTorch, half zero advantage", lambda c: "half zero advantage" in c),
    }
    for r in rows:
        if r.get("status") != "ok" or "ms" not in r or r["case"].startswith(("ceiling", "forward")):
            continue
        section, case = r["section"], r["case"]
        if section == "hidden":
            key = "hidden-half" if groups["hidden-half"][1](case) else "hidden"
            base = _find(rows, "hidden", groups[key][0])
        elif section == "logits":
            base = _find(rows, "logits", f"plain PyTorch, V={r.get('V')}")
        elif section == "torch-backend":
            base = _find(rows, "torch-backend", f"plain PyTorch, {r.get('shape')}")
        elif section == "trl-step":
            base = _find(rows, "trl-step", "stock")
        else:
            base = None
        r["x_plain"] = _ratio(r, base)
    fwd_ours = _find(rows, "hidden", "forward: ours")
    fwd_trl = _find(rows, "hidden", "forward: TRL")
    if fwd_ours:
        fwd_ours["x_trl_forward"] = _ratio(fwd_ours, fwd_trl)


def evaluate_targets(rows: List[Dict]) -> List[Dict]:
    """The issue's targets as (value, limit, met); a target whose rows are missing is 'not measured'."""
    f = lambda section, prefix: _find(rows, section, prefix)  # noqa: E731
    ours_all, ours_half = f("hidden", "ours fused_linear_gspo_loss, all"), f("hidden", "ours fused_linear_gspo_loss, half")
    plain_all, plain_half = f("hidden", "plain PyTorch, all"), f("hidden", "plain PyTorch, half")
    peaks = [r["peak_extra_gib"] for r in (ours_all, ours_half) if r and r.get("peak_extra_gib") is not None]
    trl_stock, trl_ours = f("trl-step", "stock"), f("trl-step", "drop-in")
    logits = {}
    for r in rows:
        if r.get("section") == "logits" and r.get("status") == "ok" and str(r["case"]).startswith("ours"):
            logits[r["V"]] = r
    big = logits.get(max(logits)) if logits else None
    small = logits.get(min(logits)) if len(logits) > 1 else None

    def host(r):
        if r is None or r.get("issue_ms") is None:
            return None
        return r["issue_ms"]

    def floor_share(r, need):
        return need / r["of_floor"] if r is not None and r.get("of_floor") else None

    values = {
        "hidden_all": _ratio(ours_all, plain_all),
        "hidden_half": _ratio(ours_half, plain_half),
        "hidden_peak": max(peaks) if peaks else None,
        "two_pass_fwd": _ratio(f("hidden", "forward: ours"), f("hidden", "forward: TRL")),
        "trl_time": _ratio(trl_ours, trl_stock),
        "trl_peak": _ratio(trl_ours, trl_stock, "peak_extra_gib"),
        "logits_host": host(big),
        "logits_host_small": host(small),
        "logits_floor": floor_share(big, 0.85),
        "logits_floor_small": floor_share(small, 0.75),
        "torch_logits": _ratio(f("torch-backend", "ours backend='torch', logits"),
                               f("torch-backend", "plain PyTorch, logits")),
        "torch_hidden": _ratio(f("torch-backend", "ours backend='torch', hidden"),
                               f("torch-backend", "plain PyTorch, hidden")),
    }
    out = []
    for key, text, limit in TARGETS:
        value = values.get(key)
        status = "not measured" if value is None else ("met" if value <= limit else "MISSED")
        note = None
        if key.startswith("logits_host") and (big if key == "logits_host" else small) is not None:
            r = big if key == "logits_host" else small
            if r.get("waited_on_device"):
                note = "issued from an idle GPU: the call's one host read waits for a busy GPU"
        out.append(dict(key=key, target=text, value=value, limit=limit, status=status, note=note))
    return out


def _fmt(x, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else str(x)


COLUMNS = (("ms", "ms", ".2f"), ("x_plain", "x plain", ".3f"), ("tflops", "TFLOP/s", ".0f"),
           ("of_floor", "of floor", ".2f"), ("peak_extra_gib", "peak extra GiB", ".2f"),
           ("kernel_ms", "kernel ms", ".2f"), ("issue_ms", "host issue ms", ".3f"),
           ("sync_ops_per_call", "sync ops", "d"))


def table_lines(rows: List[Dict], markdown: bool) -> List[str]:
    lines: List[str] = []
    sections = [s for s in SECTIONS if any(r.get("section") == s for r in rows)]
    for section in sections:
        srows = [r for r in rows if r.get("section") == section and r.get("status") != "info"]
        if markdown:
            lines += [f"### {section}", "", "| case | " + " | ".join(c[1] for c in COLUMNS) + " | notes |",
                      "|---" * (len(COLUMNS) + 2) + "|"]
        else:
            lines += ["", f"== {section}", f"{'case':58} " + " ".join(f"{c[1]:>14}" for c in COLUMNS)]
        for r in srows:
            if r.get("status") != "ok":
                cells, notes = ["-"] * len(COLUMNS), f"{r.get('status')}: {r.get('reason', '')}"
            else:
                cells = [_fmt(r.get(k), spec) for k, _, spec in COLUMNS]
                extra = []
                if r.get("dh_rel_err_vs_plain") is not None:
                    extra.append(f"dH/dW rel err vs plain {r['dh_rel_err_vs_plain']:.1e}/{r['dw_rel_err_vs_plain']:.1e}")
                if r.get("of_gemm_ceiling") is not None:
                    extra.append(f"{r['of_gemm_ceiling']:.2f} of the GEMM ceiling")
                if r.get("wall_minus_kernel_ms") is not None:
                    extra.append(f"wall - kernels {r['wall_minus_kernel_ms']:.2f} ms")
                if r.get("profiled_wall_ms") is not None:
                    part = f"profiled step: wall {r['profiled_wall_ms']:.2f} ms"
                    if r.get("before_first_op_ms") is not None:
                        part += (f", {r['before_first_op_ms']:.2f} ms to its first device op, "
                                 f"{r['idle_after_first_op_ms']:.2f} ms idle after it")
                    extra.append(part)
                if r.get("waited_on_device"):
                    extra.append("host issue from an idle GPU (its host read waits behind a busy GPU)")
                if r.get("x_trl_forward") is not None:
                    extra.append(f"{r['x_trl_forward']:.3f}x TRL's forward")
                if r.get("tb_s") is not None:
                    extra.append(f"{r['tb_s']:.2f} TB/s")
                if r.get("old_ms") is not None:
                    extra.append(f"old-log-prob pass {r['old_ms']:.1f} ms; loss {r.get('loss'):.6f}")
                if r.get("note"):
                    extra.append(r["note"])
                notes = "; ".join(extra)
            if markdown:
                lines.append(f"| {r['case']} | " + " | ".join(cells) + f" | {notes} |")
            else:
                lines.append(f"{r['case'][:58]:58} " + " ".join(f"{c:>14}" for c in cells) + (f"  {notes}" if notes else ""))
        if markdown:
            lines.append("")
    return lines


def target_lines(targets: List[Dict], markdown: bool) -> List[str]:
    lines = ["", "### issue 26 targets (this run)" if markdown else "issue 26 targets (this run):", ""]
    if markdown:
        lines += ["| target | value | limit | status |", "|---|---|---|---|"]
    for t in targets:
        value = _fmt(t["value"], ".3f")
        note = f" ({t['note']})" if t.get("note") else ""
        if markdown:
            lines.append(f"| {t['target']} | {value} | {t['limit']} | {t['status']}{note} |")
        else:
            lines.append(f"  [{t['status']:>12}] {t['target']}: {value}{note}")
    return lines


def write_outputs(out: str, payload: Dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(payload, f, indent=1, default=float)
    env = payload.get("environment") or {}
    md = [f"# gspo-kernels bench --gpu: {env.get('device_name', payload.get('device'))}", "",
          f"Command: `{payload['command']}`; {payload['elapsed_s']:.0f} s. Versions: "
          + ", ".join(f"{k} {v}" for k, v in (env.get("versions") or {}).items() if v) + ".", "",
          "Method: CUDA events, median of 5 after 2 warm-ups (fewer where the JSON says), gradients set to None "
          "before each step; peak extra = max allocated above the step's start; TFLOP/s on 6NHV.", ""]
    if payload.get("tiny"):
        md.insert(1, "**--tiny smoke run: not a measurement.**\n")
    md += table_lines(payload["results"], markdown=True)
    md += target_lines(payload["targets"], markdown=True)
    with open(out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")


# ---------------------------------------------------------------------------------------------------------
# The subcommand (``gspo-kernels bench --gpu``; the flags live in bench.py's parser).
# ---------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden options of ``bench --gpu`` (``--gpu``, ``--device`` and ``--out`` are bench's)."""
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sections", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help=argparse.SUPPRESS)
    parser.add_argument("--peers", default=",".join(PEERS), help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    device = getattr(args, "device", None) or "cuda"
    tiny = bool(getattr(args, "tiny", False))
    out = getattr(args, "out", None) or "results/bench_gpu"
    if out == "results/bench":  # bench's own default
        out = "results/bench_gpu"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gspo-kernels bench --gpu: no CUDA device here (torch.cuda.is_available() is False); nothing "
                  "measured. Run it on a GPU machine.", file=sys.stderr)
            return 2
    elif device != "cpu" or not tiny:
        print(f"gspo-kernels bench --gpu: measures on CUDA; --device {device} is accepted only as '--device cpu "
              "--tiny' (a smoke test of the code paths)", file=sys.stderr)
        return 2
    sections = SECTIONS
    if getattr(args, "sections", None):
        sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
        unknown = [s for s in sections if s not in SECTIONS]
        if unknown:
            print(f"--sections: unknown {unknown}; choose among {list(SECTIONS)}", file=sys.stderr)
            return 2
    peers = tuple(p.strip() for p in str(getattr(args, "peers", ",".join(PEERS))).split(",") if p.strip())
    if any(p not in PEERS for p in peers):
        print(f"--peers: choose among {list(PEERS)}; got {list(peers)}", file=sys.stderr)
        return 2
    budget = float(getattr(args, "budget_s", DEFAULT_BUDGET_S))
    start = time.time()
    command = "gspo-kernels " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "gspo-kernels bench --gpu"
    print(f"gspo-kernels bench --gpu: device {device}{' (tiny smoke run: not a measurement)' if tiny else ''}, "
          f"sections {', '.join(sections)}, budget {budget:.0f} s", flush=True)
    runs: List[Dict] = []
    rows: List[Dict] = []
    payload: Dict = {}

    def save() -> None:
        env = next((r.get("environment") for r in rows if r.get("case") == "environment"), None)
        data = [r for r in rows if r.get("case") != "environment"]
        add_ratios(data)
        payload.clear()
        payload.update(command=command, device=device, tiny=tiny, environment=env, elapsed_s=time.time() - start,
                       budget_s=budget, sections=[{k: v for k, v in s.items() if k != "rows"} for s in runs],
                       method=dict(timing="CUDA events; median of 5 after 2 warm-ups unless a row says otherwise",
                                   peak="torch.cuda.max_memory_allocated above the allocation at the step's start",
                                   flops="6*N*H*V per fwd+bwd step", floor="3*N*V*itemsize bytes at the copy bandwidth",
                                   host="issue time of one call with the GPU held busy by a spin kernel"),
                       results=data, targets=evaluate_targets(data))
        write_outputs(out, payload)

    # A --tiny smoke run groups the in-process sections into one subprocess (interpreter starts are most of it).
    grouped = [s for s in sections if s in SECTION_FUNCS] if tiny else []
    for section in sections:
        if section in grouped[1:]:
            continue
        left = budget - (time.time() - start)
        limit = SECTION_LIMIT_S[section] if not tiny else 120.0
        if left < (SECTION_MIN_S[section] if not tiny else 5.0):
            runs.append(dict(section=section, status=f"skipped: {left:.0f} s of the budget left", seconds=0.0))
            rows.append(dict(section=section, case="(section)", status="skipped", reason="time budget"))
            print(f"[{section}] skipped: {left:.0f} s of the budget left", flush=True)
            continue
        limit = min(limit, left)
        print(f"[{section}] (limit {limit:.0f} s)", flush=True)
        if section == "trl-step":
            result = run_trl_step(device, tiny, limit)
        else:
            result = run_section(section, device, tiny, limit, group=grouped[1:] if section in grouped else (),
                                 peers=peers)
        runs.append(result)
        rows.extend(result["rows"])
        print(f"[{section}] {result['status']} in {result['seconds']:.0f} s", flush=True)
        save()
    save()
    print("\n".join(table_lines(payload["results"], markdown=False)))
    print("\n".join(target_lines(payload["targets"], markdown=False)))
    print(f"\nwrote {out}.json and {out}.md ({payload['elapsed_s']:.0f} s)")
    failed = any(r.get("status") == "error" for r in payload["results"]) or any(
        not str(s.get("status", "")).startswith(("ok", "skipped")) for s in runs)
    return 1 if failed else 0
