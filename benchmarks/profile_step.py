"""Where a loss step's GPU waits: one profiled step per case, its idle gaps and what the CPU was doing.

    python benchmarks/profile_step.py --out results/profile        # CUDA only

Cases (the shapes of ``gspo-kernels bench --gpu``): the one-pass hidden-state loss (N = 16384, H = 4096,
V = 151936, bf16, all rows active), and ``gspo_loss`` from bf16 logits ``[16, 1025, V][:, :-1]`` at V = 151936
and 50257. For each: the wall time (CUDA events, from an idle GPU, as ``bench --gpu`` times it), the GPU-busy
time (the union of every device interval: kernels, copies, fills), the device idle gaps over 20 us with the
CPU op that issued the work after each gap and how late it was issued, and the stack of every operation that
PyTorch's sync debug mode flags (a host read). Writes ``<out>.json`` and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
import warnings

import torch


def _hidden_case():
    import gspo_kernels as gk

    B, T, H, V = 16, 1024, 4096, 151936
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(B, T, H, generator=gen, device="cuda")).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, generator=gen, device="cuda") * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen, device="cuda")
    adv = torch.randn(B, generator=gen, device="cuda")
    with torch.no_grad():
        old = gk.linear_logprobs(hidden, weight, labels).float()
    cfg = gk.GSPOConfig(importance_sampling_level="sequence", epsilon_low=3e-4, epsilon_high=4e-4)

    def prepare():
        hidden.grad = weight.grad = None

    def step():
        out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, config=cfg)
        out.loss.backward()
        return out.loss

    return prepare, step


def _logits_case(V: int):
    import gspo_kernels as gk

    B, T = 16, 1024
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = (torch.randn(B, T + 1, V, generator=gen, device="cuda") * 2).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen, device="cuda")
    adv = torch.randn(B, generator=gen, device="cuda")
    mask = torch.ones(B, T, device="cuda")
    with torch.no_grad():
        old = gk.token_logprobs(logits.detach()[:, :-1], labels).float()

    def prepare():
        logits.grad = None

    def step():
        loss = gk.gspo_loss(logits[:, :-1], labels, adv, old, mask=mask).loss
        loss.backward()
        return loss

    return prepare, step


def _syncs(prepare, step):
    """The stacks of the operations the sync debug mode flags in one step."""
    prepare()
    torch.cuda.synchronize()
    stacks = []
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower():
            frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
            stacks.append([f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-8:]])

    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.cuda.set_sync_debug_mode("warn")  # its own warning about the mode is not a sync of the step
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = original
    torch.cuda.synchronize()
    return stacks


def _profile(prepare, step):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        prepare()
        step()
    prepare()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end)
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = {e["args"].get("correlation"): e for e in events
               if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "args" in e}
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    device.sort(key=lambda e: e["ts"])
    busy, gaps, last_end = 0.0, [], None
    for e in device:
        s, t = e["ts"], e["ts"] + e["dur"]
        if last_end is None or s > last_end:
            if last_end is not None and s - last_end > 20:
                gaps.append((last_end, s, e))
            busy += e["dur"]
            last_end = t
        elif t > last_end:
            busy += t - last_end
            last_end = t
    out_gaps = []
    for g0, g1, e in sorted(gaps, key=lambda g: g[0] - g[1])[:25]:
        launch = runtime.get(e.get("args", {}).get("correlation"))
        op = None
        if launch is not None:
            enclosing = [c for c in cpu_ops if c["ts"] <= launch["ts"] <= c["ts"] + c["dur"]]
            names = [c["name"] for c in sorted(enclosing, key=lambda c: -c["dur"])]
            op = " > ".join(names[-4:])
        out_gaps.append(dict(gap_us=round(g1 - g0, 1), at_us=round(g0 - device[0]["ts"], 1),
                             next_device_op=e["name"][:80], issued_by=op,
                             launched_late_us=None if launch is None else round(launch["ts"] - g0, 1)))
    first_device = device[0]["ts"] if device else None
    first_cpu = min((c["ts"] for c in cpu_ops), default=None)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return dict(wall_ms=wall_ms, device_busy_ms=busy / 1e3, idle_ms=wall_ms - busy / 1e3, n_device_ops=len(device),
                n_gaps_over_20us=len(gaps), idle_in_gaps_ms=sum(g1 - g0 for g0, g1, _ in gaps) / 1e3,
                first_device_op_after_cpu_start_us=None if first_device is None or first_cpu is None
                else round(first_device - first_cpu, 1),
                gaps=out_gaps, cpu_table=table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/profile")
    parser.add_argument("--cases", default="hidden,logits151936,logits50257")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("profile_step.py: no CUDA device here", file=sys.stderr)
        return 2
    makers = {"hidden": _hidden_case, "logits151936": lambda: _logits_case(151936),
              "logits50257": lambda: _logits_case(50257)}
    results = {}
    for name in args.cases.split(","):
        prepare, step = makers[name]()
        r = _profile(prepare, step)
        r["sync_stacks"] = _syncs(prepare, step)
        results[name] = r
        print(f"== {name}: wall {r['wall_ms']:.2f} ms, device busy {r['device_busy_ms']:.2f} ms, idle {r['idle_ms']:.2f} "
              f"ms ({r['n_gaps_over_20us']} gaps > 20 us: {r['idle_in_gaps_ms']:.2f} ms); first device op "
              f"{r['first_device_op_after_cpu_start_us']} us after the CPU's first op; {len(r['sync_stacks'])} syncs")
        for g in r["gaps"][:12]:
            print(f"   gap {g['gap_us']:8.1f} us at {g['at_us']:9.1f}: next {g['next_device_op'][:50]!r} issued by "
                  f"{g['issued_by']!r}, {g['launched_late_us']} us after the gap began")
        for stack in r["sync_stacks"]:
            print("   sync:", " <- ".join(reversed(stack)))
        print(r["cpu_table"])
        del prepare, step
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
