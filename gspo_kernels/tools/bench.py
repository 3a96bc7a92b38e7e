"""``gspo-kernels bench``: time and measure the memory of every implementation side by side.

For each case, each implementation runs in a fresh subprocess: it builds the inputs, runs one
warm-up step (fwd + bwd; this includes any compilation), then ``--repeats`` timed steps. Reported:
median forward, backward and total milliseconds, the spread of the timed steps' totals (min / median / max,
so a row whose steps swing shows it), the throughput, and the peak extra memory of the
timed steps (CPU: peak RSS above the RSS measured just before them, after resetting the kernel's
high-water mark through ``/proc/self/clear_refs``, plus, for the ``cpu`` backend, the buffers it keeps from one
step to the next, allocated in the warm-up: ``kept_bytes``, the RSS that ``release_buffers()`` frees; CUDA:
``torch.cuda.max_memory_allocated`` above the allocation before them).

Throughput formulas (the work a step must do, not what an implementation chooses to redo):
* hidden-state path: ``6 * N * H * V`` FLOP (the forward GEMM and the two gradient GEMMs), as GFLOP/s;
* logits path: ``3 * N * V * itemsize`` bytes (read the logits forward and backward, write the
  gradient), as GB/s.

Implementations: ours (each backend; ``gspo-cpu-recompute`` is the cpu backend with
``memory_budget=0``, ``gspo-cpu-invariant`` the cpu backend with ``batch_invariant=True``: the price
of bitwise batch invariance), the plain PyTorch path (materialized logits, ``log_softmax`` +
``gather``), TRL (``trl.kernels.ChunkedLogProbFunction``; ``selective_log_softmax``) and Cut
Cross-Entropy (``impl="torch_compile"``, ``reduction="none"``) with the GSPO formula on their
log-probs, and Liger (``LigerFusedLinearGRPOLoss(importance_sampling_level="sequence",
loss_type="grpo")``, eager). Peers are optional: missing ones are listed as skipped, with the reason.
Output: a table (the progress on stderr while it runs: ``tools/progress.py``), a JSON file with every figure plus
the device and versions, and a PNG chart (skipped, with a note, when matplotlib is missing).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Tuple

from gspo_kernels.tools.bench_compiled import compiled_step, print_compiled, with_compiled  # the "-compiled" rows
from gspo_kernels.tools.bench_gpu import gspo_formula  # the GSPO formula the peers are completed with
from gspo_kernels.tools.peers import Skip, peer  # Skip: an implementation that cannot run here
from gspo_kernels.tools.progress import track
from gspo_kernels.tools.table import Column, text_header, text_row

# ---------------------------------------------------------------------------------------------
# Cases: the full shapes, and small ones for --quick (a few minutes on 2 CPU cores).
# ---------------------------------------------------------------------------------------------

CASES: Dict[str, Dict] = {
    # hidden-state path, Qwen2.5-0.5B head: N = 4 x 256 tokens, H = 896, V = 151936, fp32
    "linear": dict(path="linear", B=4, T=256, H=896, V=151936, dtype="fp32", inactive=0.0),
    # the same with half of the responses clipped (one) or at zero advantage (one)
    "linear_half_inactive": dict(path="linear", B=4, T=256, H=896, V=151936, dtype="fp32", inactive=0.5),
    # logits path: N = 16 x 256 = 4096 tokens, V = 151936, fp32 logits (2.5 GB)
    "logits": dict(path="logits", B=16, T=256, V=151936, dtype="fp32", inactive=0.0),
}
QUICK_CASES: Dict[str, Dict] = {
    "linear": dict(path="linear", B=4, T=64, H=256, V=32768, dtype="fp32", inactive=0.0),
    "linear_half_inactive": dict(path="linear", B=4, T=64, H=256, V=32768, dtype="fp32", inactive=0.5),
    "logits": dict(path="logits", B=4, T=128, V=32768, dtype="fp32", inactive=0.0),
}

IMPLS: Dict[str, Tuple[str, ...]] = with_compiled({
    "linear": ("gspo-cpu", "gspo-cpu-recompute", "gspo-cpu-invariant", "gspo-torch", "gspo-triton", "plain-torch", "trl-chunked", "liger",
               "cce"),
    "logits": ("gspo-cpu", "gspo-cpu-inplace", "gspo-torch", "gspo-triton", "plain-torch", "trl-selective"),
})
BASELINE = {"linear": "trl-chunked", "logits": "plain-torch"}  # the "x base" column divides by these
PLAIN = "plain-torch"  # the "x plain" column divides by it
KEPT_NOTE = ("the buffers the cpu backend keeps between steps (allocated once, reused every step: its [N, V] "
             "gradient on the logits path, its saved logits on the hidden path)")


# ---------------------------------------------------------------------------------------------
# Inputs and the GSPO formula applied to the peers' log-probs.
# ---------------------------------------------------------------------------------------------


def make_inputs(case: Dict, device) -> Dict:
    """Seeded inputs of one case; ``old_logprobs`` puts response 0 (of each 4) at zero advantage and
    response 1 clipped above the band when ``inactive = 0.5``, every response inside it otherwise."""
    import torch

    gen = torch.Generator().manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case["dtype"]]
    B, T, V = case["B"], case["T"], case["V"]
    labels = torch.randint(0, V, (B, T), generator=gen)
    out: Dict = dict(labels=labels.to(device))
    if case["path"] == "linear":
        H = case["H"]
        out["hidden"] = (torch.randn(B, T, H, generator=gen) * 0.5).to(dtype).to(device)
        out["weight"] = (torch.randn(V, H, generator=gen) * (1.0 / H**0.5)).to(dtype).to(device)
    else:
        out["logits"] = (torch.randn(B, T, V, generator=gen) * 2).to(dtype).to(device)
    adv = torch.randn(B, generator=gen).abs() + 0.5
    adv[1::2] *= -1
    shift = torch.zeros(B)
    if case["inactive"] > 0:
        adv[0::4] = 0.0  # zero advantage
        adv[1::4] = 1.0
        shift[1::4] = 1e-3  # w = e^(1e-3) > 1 + epsilon_high: clipped
    out["advantages"] = adv.to(device)
    with torch.no_grad():
        current = _current_logprobs(out, case)
    out["old_logprobs"] = (current - shift.to(device)[:, None]).float()
    out["mask"] = torch.ones(B, T, device=device)
    return out


def _current_logprobs(inputs: Dict, case: Dict):
    import gspo_kernels as gk

    if case["path"] == "linear":
        return gk.linear_logprobs(inputs["hidden"], inputs["weight"], inputs["labels"])
    return gk.token_logprobs(inputs["logits"], inputs["labels"])


# ---------------------------------------------------------------------------------------------
# Implementations: build(case, inputs) -> (step() -> loss, leaves whose .grad the step produces).
# ---------------------------------------------------------------------------------------------


def build_impl(name: str, case: Dict, inputs: Dict) -> Tuple[Callable, List]:
    if name.endswith("-compiled"):  # bench_compiled: the step of the name without the suffix, compiled
        return compiled_step(name, case, inputs, build_impl)
    import gspo_kernels as gk
    from gspo_kernels import backends

    device = inputs["labels"].device
    labels, adv, old, mask = inputs["labels"], inputs["advantages"], inputs["old_logprobs"], inputs["mask"]
    B, T = labels.shape
    if name.startswith("gspo-"):
        backend = name.split("-")[1]
        impl = backends.load(backend)
        if impl is None:
            raise Skip(f"backend {backend!r} unavailable: {backends.unavailable_reason(backend)}")
        if not impl.supports(device):
            raise Skip(f"backend {backend!r} does not run on {device.type} (GPU-only)")

    if case["path"] == "linear":
        hidden = inputs["hidden"].requires_grad_()
        weight = inputs["weight"].requires_grad_()
        leaves = [hidden, weight]
        if name.startswith("gspo-"):
            budget = 0 if name == "gspo-cpu-recompute" else None  # 0: no logits kept, the least memory
            extra = dict(batch_invariant=True) if name.endswith("-invariant") else {}

            def step():
                return gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, backend=backend,
                                                 memory_budget=budget, **extra).loss
            return step, leaves
        if name == "plain-torch":
            def step():
                logp = (hidden @ weight.T).float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
                return gspo_formula(logp, old, adv, mask)
            return step, leaves
        if name == "trl-chunked":
            ChunkedLogProbFunction = peer("trl.kernels", "ChunkedLogProbFunction", "trl")
            chunk = 32768  # TRL's _CHUNKED_LOGPROB_CHUNK_SIZE

            def step():
                logp = ChunkedLogProbFunction.apply(hidden.reshape(B * T, -1), weight, None, labels.reshape(-1), 1.0,
                                                    chunk, None, 1.0, ())[0]
                return gspo_formula(logp.reshape(B, T), old, adv, mask)
            return step, leaves
        if name == "liger":
            LigerFusedLinearGRPOLoss = peer("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss", "liger-kernel")
            loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False, epsilon_low=3e-4,
                                               epsilon_high=4e-4, loss_type="grpo",
                                               importance_sampling_level="sequence")

            def step():
                out = loss_fn(hidden, weight, labels, mask, adv, old_per_token_logps=old)
                return out[0] if isinstance(out, tuple) else out
            return step, leaves
        if name == "cce":
            linear_cross_entropy = peer("cut_cross_entropy", "linear_cross_entropy", "cut-cross-entropy")

            def step():
                nll = linear_cross_entropy(hidden.reshape(B * T, -1), weight, labels.reshape(-1),
                                           impl="torch_compile", reduction="none")
                return gspo_formula(-nll.float().reshape(B, T), old, adv, mask)
            return step, leaves
    else:
        logits = inputs["logits"].requires_grad_()
        leaves = [logits]
        if name.startswith("gspo-"):
            inplace = name.endswith("-inplace")
            return (lambda: gk.gspo_loss(logits, labels, adv, old, mask=mask, backend=backend,
                                         inplace_backward=inplace).loss), leaves
        if name == "plain-torch":
            def step():
                logp = logits.float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
                return gspo_formula(logp, old, adv, mask)
            return step, leaves
        if name == "trl-selective":
            selective_log_softmax = peer("trl.trainer.utils", "selective_log_softmax", "trl")
            return (lambda: gspo_formula(selective_log_softmax(logits, labels), old, adv, mask)), leaves
    raise Skip(f"{name} has no {case['path']}-path implementation")


# ---------------------------------------------------------------------------------------------
# The worker: one (case, implementation) in a fresh process.
# ---------------------------------------------------------------------------------------------


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False


def measure(name: str, case: Dict, repeats: int, device_name: str) -> Dict:
    """Warm up once, then time ``repeats`` fwd+bwd steps and record the peak extra memory."""
    import torch

    device = torch.device(device_name)
    inputs = make_inputs(case, device)
    step, leaves = build_impl(name, case, inputs)
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def one():
        for leaf in leaves:
            leaf.grad = None
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, float(loss.detach())

    one()  # warm-up (compilation, caches)
    for leaf in leaves:
        leaf.grad = None
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        reset_ok = _reset_peak_rss()
        base = _rss_bytes("VmRSS")
    fwd, bwd, loss_value = [], [], 0.0
    for _ in range(repeats):
        f, b, loss_value = one()
        fwd.append(f)
        bwd.append(b)
    kept = 0
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
        how = "torch.cuda.max_memory_allocated above the allocation before the timed steps"
    else:
        peak = _rss_bytes("VmHWM") - base if reset_ok else None
        how = "peak RSS (VmHWM after clear_refs) above the RSS before the timed steps"
        if name.startswith("gspo-cpu"):
            kept = _kept_buffer_bytes(leaves)
            if peak is not None:
                peak += kept
            how += ", plus the buffers the cpu backend keeps between steps (kept_bytes)"
    totals = [a + b for a, b in zip(fwd, bwd)]
    return dict(fwd_s=fwd, bwd_s=bwd, fwd_ms=1e3 * statistics.median(fwd), bwd_ms=1e3 * statistics.median(bwd),
                total_ms=1e3 * statistics.median(totals), min_ms=1e3 * min(totals), max_ms=1e3 * max(totals),
                peak_extra_bytes=peak, kept_bytes=kept,
                memory_method=how, loss=loss_value, threads=torch.get_num_threads())


def _kept_buffer_bytes(leaves: List) -> int:
    """Resident bytes the ``cpu`` backend keeps from one step to the next (the logits path's out-of-place gradient,
    the hidden path's saved logits: reused by the next step, so allocated in the warm-up and absent from a peak
    taken above the timed steps' start), measured as the RSS they free. Drops the leaves' gradients first: the
    backend reuses a gradient's storage only once nothing holds it, and frees only what nothing holds."""
    from gspo_kernels.backends.cpu.logits import release_buffers

    for leaf in leaves:
        leaf.grad = None
    gc.collect()
    before = _rss_bytes("VmRSS")
    release_buffers()
    return max(before - _rss_bytes("VmRSS"), 0)


def _worker_main() -> None:
    spec = json.loads(sys.stdin.read())
    if spec.get("memory_cap") is not None:  # bench --scaling: allocations past the cap fail here, as out of memory
        from gspo_kernels.tools.memory_cap import apply_cap

        apply_cap(spec["memory_cap"], spec["device"])
    try:
        result = dict(status="ok", **measure(spec["impl"], spec["case"], spec["repeats"], spec["device"]))
    except Skip as exc:
        result = dict(status="skipped", reason=str(exc))
    except Exception as exc:  # reported in the table and the JSON, the run goes on
        result = dict(status="error", reason=f"{type(exc).__name__}: {exc}"[:500])
    print("BENCH-RESULT " + json.dumps(result), flush=True)


def run_one(impl: str, case: Dict, repeats: int, device: str, timeout: float,
            memory_cap: Optional[int] = None) -> Dict:
    """``measure`` in a fresh subprocess; ``memory_cap``: the bytes it may allocate past its start (None: no cap)."""
    spec = json.dumps(dict(impl=impl, case=case, repeats=repeats, device=device, memory_cap=memory_cap))
    cmd = [sys.executable, "-c", "from gspo_kernels.tools.bench import _worker_main; _worker_main()"]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # gspo_kernels importable as here
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.run(cmd, input=spec, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(status="error", reason=f"timed out after {timeout:.0f} s")
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("BENCH-RESULT "):
            return json.loads(line[len("BENCH-RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return dict(status="error", reason=f"worker exited with {proc.returncode}: {tail[0][:300]}")


# ---------------------------------------------------------------------------------------------
# Throughput, environment, reporting.
# ---------------------------------------------------------------------------------------------


def work(case: Dict) -> Tuple[float, str]:
    """(amount of work per fwd+bwd step, unit): FLOP for the hidden-state path, bytes for the logits one."""
    N = case["B"] * case["T"]
    if case["path"] == "linear":
        return 6.0 * N * case["H"] * case["V"], "GFLOP/s"
    itemsize = {"fp32": 4, "bf16": 2}[case["dtype"]]
    return 3.0 * N * case["V"] * itemsize, "GB/s"


def environment(device: str) -> Dict:
    import importlib.metadata as md

    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("gspo_kernels", "triton", "trl", "liger-kernel", "cut-cross-entropy", "transformers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        commit = None
    return dict(device=device, device_name=name, cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                platform=platform.platform(), versions=versions, git_commit=commit,
                time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def _fmt_mb(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f}"


def _spread(r: Dict) -> str:
    """``min/median/max`` of the timed steps' totals (ms): a row whose steps swing (e.g. bimodal) shows it."""
    if "min_ms" not in r:
        return "-"
    return f"{r['min_ms']:.0f}/{r['total_ms']:.0f}/{r['max_ms']:.0f}"


# The table's columns; the throughput column's title is its unit (GFLOP/s or GB/s: ``work``).
COLUMNS = (Column("implementation", 18, "<"), Column("fwd ms", 9, spec=".0f"), Column("bwd ms", 9, spec=".0f"),
           Column("total ms", 9, spec=".0f"), Column("min/med/max ms", 16), Column("rate", 8, spec=".1f"),
           Column("peak MB", 8), Column("x base", 7), Column("x plain", 7))


def print_table(results: List[Dict], cases: Dict[str, Dict]) -> None:
    for case_name, case in cases.items():
        rows = [r for r in results if r["case"] == case_name]
        amount, unit = work(case)
        base = next((r for r in rows if r["impl"] == BASELINE[case["path"]] and r["status"] == "ok"), None)
        plain = next((r for r in rows if r["impl"] == PLAIN and r["status"] == "ok"), None)
        shape = ", ".join(f"{k}={v}" for k, v in case.items() if k != "path")
        print(f"\n{case_name} ({case['path']} path: {shape}); x base = total / {BASELINE[case['path']]}'s, "
              f"x plain = total / {PLAIN}'s")
        columns = (*COLUMNS[:5], replace(COLUMNS[5], title=unit), *COLUMNS[6:])
        print(text_header(columns, indent="  "))
        for r in rows:
            if r["status"] != "ok":
                print(text_row(columns[:1], [r["impl"]], indent="  ") + f" {r['status']}: {r['reason']}")
                continue
            rate = amount / (r["total_ms"] / 1e3) / 1e9
            ratio = f"{r['total_ms'] / base['total_ms']:.2f}" if base else "-"
            to_plain = f"{r['total_ms'] / plain['total_ms']:.2f}" if plain else "-"
            print(text_row(columns, [r["impl"], r["fwd_ms"], r["bwd_ms"], r["total_ms"], _spread(r), rate,
                                     _fmt_mb(r["peak_extra_bytes"]), ratio, to_plain], indent="  "))
        kept = [r for r in rows if r["status"] == "ok" and r.get("kept_bytes")]
        if kept:
            print(f"  peak MB includes {KEPT_NOTE}: "
                  + ", ".join(f"{r['impl']} {_fmt_mb(r['kept_bytes'])} MB" for r in kept))


def targets(results: List[Dict], quick: bool = False) -> List[Dict]:
    """The CPU targets, evaluated on this run (only where every figure they need exists); with
    ``quick``, only "the cpu backend is never slower than plain PyTorch" (the others name the full shapes)."""
    def get(case, impl):
        return next((r for r in results if r["case"] == case and r["impl"] == impl and r["status"] == "ok"), None)

    out = []

    def check(name, ok_value, detail):
        out.append(dict(target=name, met=ok_value, detail=detail))

    for case in dict.fromkeys(r["case"] for r in results):
        ours_c, plain_c = get(case, "gspo-cpu"), get(case, PLAIN)
        if ours_c and plain_c:
            for part, key in (("total", "total_ms"), ("forward", "fwd_ms"), ("backward", "bwd_ms")):
                check(f"{case}: cpu {part} <= plain PyTorch", ours_c[key] <= plain_c[key],
                      f"ratio {ours_c[key] / plain_c[key]:.2f}")
    if quick:
        return out

    ours, trl = get("linear", "gspo-cpu"), get("linear", "trl-chunked")
    if ours and trl:
        check("linear all active: total <= 0.75 x TRL chunked", ours["total_ms"] <= 0.75 * trl["total_ms"],
              f"ratio {ours['total_ms'] / trl['total_ms']:.2f}")
        if ours["peak_extra_bytes"] is not None and trl["peak_extra_bytes"]:
            check("linear all active: peak extra memory <= 1.1 x TRL chunked",
                  ours["peak_extra_bytes"] <= 1.1 * trl["peak_extra_bytes"],
                  f"ratio {ours['peak_extra_bytes'] / trl['peak_extra_bytes']:.2f}")
    half, cce = get("linear_half_inactive", "gspo-cpu"), get("linear_half_inactive", "cce")
    if ours and half:
        check("half inactive: backward <= 0.6 x all-active backward", half["bwd_ms"] <= 0.6 * ours["bwd_ms"],
              f"ratio {half['bwd_ms'] / ours['bwd_ms']:.2f}")
    if half and cce:
        check("half inactive: total < Cut Cross-Entropy's", half["total_ms"] < cce["total_ms"],
              f"ratio {half['total_ms'] / cce['total_ms']:.2f}")
    lg, lref, lin = get("logits", "gspo-cpu"), get("logits", "plain-torch"), get("logits", "gspo-cpu-inplace")
    if lg and lref:
        check("logits: >= 3x faster than log_softmax + gather + autograd", lref["total_ms"] >= 3 * lg["total_ms"],
              f"speed-up {lref['total_ms'] / lg['total_ms']:.2f}x")
    lt = get("logits", "gspo-torch")
    if lt and lref:
        check("logits: backend='torch' total <= log_softmax + gather + autograd", lt["total_ms"] <= lref["total_ms"],
              f"ratio {lt['total_ms'] / lref['total_ms']:.2f}")
    if lg and lg["peak_extra_bytes"] is not None:
        case = next(r["case_spec"] for r in results if r["case"] == "logits")
        grad_bytes = case["B"] * case["T"] * case["V"] * {"fp32": 4, "bf16": 2}[case["dtype"]]
        check("logits: extra memory <= one [N, V] gradient", lg["peak_extra_bytes"] <= 1.05 * grad_bytes,
              f"{lg['peak_extra_bytes'] / grad_bytes:.2f} x [N, V]")
        if lin and lin["peak_extra_bytes"] is not None:
            check("logits inplace_backward: no [N, V] buffer", lin["peak_extra_bytes"] <= 0.1 * grad_bytes,
                  f"{lin['peak_extra_bytes'] / grad_bytes:.2f} x [N, V]")
    return out


def plot(results: List[Dict], cases: Dict[str, Dict], path: str) -> Optional[str]:
    """A bar chart of total ms per implementation, one panel per case; returns why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or the [plot] extra)"
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4.2), squeeze=False)
    for ax, case_name in zip(axes[0], cases):
        rows = [r for r in results if r["case"] == case_name and r["status"] == "ok"]
        names = [r["impl"] for r in rows]
        fwd = [r["fwd_ms"] / 1e3 for r in rows]
        bwd = [r["bwd_ms"] / 1e3 for r in rows]
        ax.barh(names, fwd, label="forward")
        ax.barh(names, bwd, left=fwd, label="backward")
        for i, r in enumerate(rows):
            kept = f" ({_fmt_mb(r['kept_bytes'])} kept*)" if r.get("kept_bytes") else ""
            ax.text(fwd[i] + bwd[i], i, f" {_fmt_mb(r['peak_extra_bytes'])} MB{kept}", va="center", fontsize=8)
        ax.set_title(case_name)
        ax.set_xlabel("seconds per step (median)")
        ax.invert_yaxis()
    axes[0][0].legend(loc="lower right", fontsize=8)
    note = "MB: peak extra memory of a step"
    if any(r["status"] == "ok" and r.get("kept_bytes") for r in results):
        note += "; * of which the cpu backend keeps between steps (its [N, V] gradient / saved logits, reused)"
    lines = textwrap.wrap(note, width=int(16 * fig.get_figwidth()))  # about 16 characters an inch at 8 pt
    fig.text(0.5, 0.005, "\n".join(lines), ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.035 * len(lines), 1, 1))
    fig.savefig(path, dpi=110)
    return None


# ---------------------------------------------------------------------------------------------
# The subcommand.
# ---------------------------------------------------------------------------------------------


def output_prefix(out: str) -> str:
    """``--out`` without a trailing ``.json`` or ``.png`` (``results/b.json`` -> ``results/b``): the prefix of both
    outputs, so neither gets a second suffix."""
    root, ext = os.path.splitext(out)
    return root if ext.lower() in (".json", ".png") else out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small shapes: a few minutes on a 2-core CPU")
    parser.add_argument("--cases", nargs="*", default=None, help=f"subset of {list(CASES)}")
    parser.add_argument("--impls", nargs="*", default=None, help="subset of the implementations (default: all)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps after one warm-up (default 3; 5 quick)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per implementation and case")
    parser.add_argument("--out", default="results/bench", help="prefix of the .json and .png outputs")
    parser.add_argument("--scaling", action="store_true", help="time and peak memory over a series of token counts "
                        "and one of vocabularies -> <out>.json and <out>.png (default results/scaling); docs/scaling.md")
    parser.add_argument("--memory-cap", type=float, default=None, metavar="GIB", help="--scaling: the GiB a point may "
                        "allocate (default: 3/4 of what is available); a point estimated over it is recorded as oom")
    parser.add_argument("--series", default=None, help="--scaling: the points instead of the defaults, "
                        "e.g. 'tokens=256,512;vocab=32768,65536;hidden=256'")
    parser.add_argument("--gpu", action="store_true", help="on a GPU: every ratio against plain PyTorch and the "
                        "peers, and each target met or missed -> results/bench_gpu.{json,md}; see docs/bench_gpu.md")
    from gspo_kernels.tools import bench_gpu

    bench_gpu.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "gpu", False):
        from gspo_kernels.tools import bench_gpu

        return bench_gpu.run(args)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    all_cases = QUICK_CASES if args.quick else CASES
    cases = {k: v for k, v in all_cases.items() if args.cases is None or k in args.cases}
    repeats = args.repeats or (5 if args.quick else 3)
    timeout = args.timeout or (300.0 if args.quick else 1200.0)
    env = environment(device)
    print(f"gspo-kernels bench{' --quick' if args.quick else ''}: {env['device_name']} ({device}, "
          f"{env['torch_threads']} threads); torch {env['versions']['torch']}; {repeats} timed steps after 1 warm-up")
    jobs = [(c, impl) for c, spec in cases.items() for impl in IMPLS[spec["path"]]
            if args.impls is None or impl in args.impls]
    results: List[Dict] = []
    for case_name, impl in track(jobs, lambda job: f"{job[0]} / {job[1]}"):
        result = run_one(impl, cases[case_name], repeats, device, timeout)
        results.append(dict(case=case_name, impl=impl, case_spec=cases[case_name], **result))
    print_table(results, cases)
    print_compiled(results)
    met = targets(results, quick=args.quick) if device == "cpu" else []
    if met:
        print("\ntargets (CPU, this run):")
        for t in met:
            print(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['detail']}")
    prefix = output_prefix(args.out)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    json_path, png_path = prefix + ".json", prefix + ".png"
    command = "gspo-kernels bench " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else [])
    skipped_chart = plot(results, cases, png_path)
    payload = dict(command=command.strip(), environment=env, repeats=repeats, quick=args.quick,
                   work_formulas={"linear": "6*N*H*V FLOP per fwd+bwd step", "logits": "3*N*V*itemsize bytes per step"},
                   results=results, targets=met, chart=None if skipped_chart else png_path,
                   chart_skipped=skipped_chart)
    with open(json_path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"\nwrote {json_path}" + (f" and {png_path}" if not skipped_chart else f"; chart skipped: {skipped_chart}"))
    return 1 if any(r["status"] == "error" for r in results) else 0
