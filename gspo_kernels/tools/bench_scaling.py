"""``gspo-kernels bench --scaling``: how a loss step's time and peak memory grow with the token count and the vocabulary.

For each path (hidden-state: ``hidden @ weight.T`` fused into the loss; logits: the loss from materialized logits)
and each implementation ``bench`` knows, every point of two series is measured with ``bench.run_one`` (a fresh
subprocess per point: one warm-up fwd + bwd, then the median of ``--repeats`` timed steps; peak memory as ``bench``
measures it, the buffers the cpu backend keeps between steps included):

* the token series: N = 256 -> 4096 (``--quick``) or 256 -> 16384 tokens at V = 32768;
* the vocabulary series: V = 32768 -> 262144 at N = 256 (``--quick``) or 1024.

Responses are ``min(N, 1024)`` tokens long (``B = N / T`` of them), fp32 on the CPU, bf16 on CUDA (larger series
there: :data:`PLANS`). Before a point runs, its memory is estimated (:func:`estimate_bytes`: its inputs, the
gradients, and the ``[N, V]``-sized buffers each implementation was measured to hold at its peak, with a margin);
a point estimated over the cap (``--memory-cap`` GiB, default 3/4 of the memory available at the start) is not
run and is recorded as ``"oom"``. A point that runs does so under the cap plus 1 GiB (CPU: its data size limit; CUDA:
its allocator's memory fraction; ``tools/memory_cap.py``): an allocation past it fails in the worker, which is
recorded as ``"oom"`` too, as is a worker killed by a signal 9. Once a point is out of memory, the same
implementation's larger points (more tokens and at least the vocabulary, or the reverse) are recorded as ``"oom"``
without running; once one is skipped (a peer not installed, a backend that does not run on the device) or times
out, its other points are ``"skipped"`` with the same reason.

Output: a plain progress line per point (it goes to CI logs), ``<out>.json`` (``records``: one per implementation
and point with ``impl``, ``path``, ``tokens``, ``vocab``, ``hidden``, ``ms``, ``peak_mb``, ``estimate_mb``,
``status`` and ``reason``; the environment as ``bench`` records it; ``slopes``: each implementation's log-log
slope of peak memory against tokens) and ``<out>.png`` (per path: peak memory and time against tokens, the same
against the vocabulary; log axes; the cap and the points over it marked). ``--out`` defaults to
``results/scaling``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from gspo_kernels.tools import bench
from gspo_kernels.tools.memory_cap import available_bytes, is_out_of_memory

GIB = 2**30
RUN_SLACK = GIB  # a running point's limit is the cap plus this (imports, compilation, the allocator's rounding)
PATH_NAMES = {"linear": "hidden-state path", "logits": "logits path"}


@dataclasses.dataclass(frozen=True)
class ScalingPlan:
    """The two series: ``tokens`` at ``vocab_fixed``, ``vocabs`` at ``tokens_fixed``; ``hidden`` H, ``dtype``
    "fp32" or "bf16", ``repeats`` timed steps after one warm-up, ``timeout_s`` per point."""

    tokens: Tuple[int, ...]
    vocab_fixed: int
    vocabs: Tuple[int, ...]
    tokens_fixed: int
    hidden: int
    dtype: str
    repeats: int
    timeout_s: float

    def points(self) -> List[Tuple[int, int]]:
        """The distinct ``(tokens, vocab)`` points of both series, smallest first."""
        pts = [(n, self.vocab_fixed) for n in self.tokens] + [(self.tokens_fixed, v) for v in self.vocabs]
        return sorted(dict.fromkeys(pts), key=lambda p: (p[0] * p[1], p))

    def series_of(self, tokens: int, vocab: int) -> List[str]:
        out = ["tokens"] if vocab == self.vocab_fixed and tokens in self.tokens else []
        return out + (["vocab"] if tokens == self.tokens_fixed and vocab in self.vocabs else [])


PLANS: Dict[Tuple[str, bool], ScalingPlan] = {
    ("cpu", True): ScalingPlan(tokens=(256, 1024, 4096), vocab_fixed=32768, vocabs=(32768, 65536, 131072, 262144),
                               tokens_fixed=256, hidden=256, dtype="fp32", repeats=2, timeout_s=300.0),
    ("cpu", False): ScalingPlan(tokens=(256, 512, 1024, 2048, 4096, 8192, 16384), vocab_fixed=32768,
                                vocabs=(32768, 65536, 131072, 151936, 262144), tokens_fixed=1024, hidden=896,
                                dtype="fp32", repeats=3, timeout_s=1800.0),
    ("cuda", True): ScalingPlan(tokens=(1024, 4096, 16384), vocab_fixed=151936, vocabs=(32768, 151936, 262144),
                                tokens_fixed=4096, hidden=4096, dtype="bf16", repeats=3, timeout_s=300.0),
    ("cuda", False): ScalingPlan(tokens=(1024, 2048, 4096, 8192, 16384, 32768, 65536), vocab_fixed=151936,
                                 vocabs=(32768, 65536, 131072, 151936, 262144), tokens_fixed=16384, hidden=4096,
                                 dtype="bf16", repeats=5, timeout_s=600.0),
}
DEFAULT_IMPLS: Dict[str, Tuple[str, ...]] = {
    "linear": ("gspo-cpu", "gspo-cpu-recompute", "gspo-torch", "gspo-triton", "plain-torch", "trl-chunked", "liger",
               "cce"),
    "logits": ("gspo-cpu", "gspo-cpu-inplace", "gspo-torch", "gspo-triton", "plain-torch", "trl-selective"),
}

# fp32 [rows, cols] buffers each implementation holds at its peak (besides the gradients of hidden and weight),
# measured with bench on the CPU at N = 1024 and 2048, V = 32768 and 65536 (peak / (4 N V): plain PyTorch 3.0, TRL
# 8.5 of its [min(N, 4096), min(V, 32768)] tiles, cpu 1.3, recompute 0.3, torch 0.6, Liger 0.7, Cut Cross-Entropy
# 1.25; logits path: plain 3.0, TRL 2.0, cpu 1.0, torch 1.25), rounded up. An implementation not listed: 4.
NV_BUFFERS: Dict[Tuple[str, str], float] = {
    ("linear", "gspo-cpu"): 1.5, ("linear", "gspo-cpu-recompute"): 0.5, ("linear", "gspo-torch"): 1.0,
    ("linear", "gspo-triton"): 1.5, ("linear", "plain-torch"): 3.5, ("linear", "liger"): 1.0, ("linear", "cce"): 1.5,
    ("logits", "gspo-cpu"): 1.1, ("logits", "gspo-cpu-inplace"): 0.1, ("logits", "gspo-torch"): 1.5,
    ("logits", "gspo-triton"): 1.1, ("logits", "plain-torch"): 3.5, ("logits", "trl-selective"): 2.5,
}
TRL_TILE = (4096, 32768)  # TRL's ChunkedLogProbFunction: [TOKEN_CHUNK_SIZE, chunk_size] tiles
FIXED_BYTES = 64 * 2**20  # small buffers, allocator rounding


def estimate_bytes(impl: str, path: str, tokens: int, vocab: int, hidden: int, dtype: str) -> int:
    """Estimated bytes of a point past its process's start: its inputs, the gradients the step returns and the
    ``[N, V]``-sized buffers of :data:`NV_BUFFERS` (fp32), plus :data:`FIXED_BYTES`."""
    item = {"fp32": 4, "bf16": 2}[dtype]
    small = tokens * (8 + 4 * 3)  # labels, old log-probs, mask, (advantages)
    if path == "linear":
        inputs = (tokens + vocab) * hidden * item
        grads = (tokens + vocab) * hidden * 4  # the gradients (fp32 accumulators on some routes)
        if impl == "trl-chunked":
            nv = 10.0 * min(tokens, TRL_TILE[0]) * min(vocab, TRL_TILE[1])
        else:
            nv = NV_BUFFERS.get((path, impl), 4.0) * tokens * vocab
        return int(inputs + grads + 4 * nv + small + FIXED_BYTES)
    inputs = tokens * vocab * item
    return int(inputs + 4 * NV_BUFFERS.get((path, impl), 4.0) * tokens * vocab + small + FIXED_BYTES)


def parse_series(text: str, base: ScalingPlan) -> ScalingPlan:
    """``--series "tokens=16,32;vocab=64,128;hidden=16;at_tokens=16;at_vocab=64"`` over ``base`` (each key optional;
    ``at_*`` the fixed value of the other series, default the series' first)."""
    fields: Dict[str, Sequence[int]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, _, value = part.partition("=")
        if key not in ("tokens", "vocab", "hidden", "at_tokens", "at_vocab") or not value:
            raise ValueError(f"--series: {part!r} is not one of tokens=, vocab=, hidden=, at_tokens=, at_vocab=")
        try:
            numbers = tuple(int(x) for x in value.split(","))
        except ValueError as exc:
            raise ValueError(f"--series: {part!r} has a value that is not an integer") from exc
        if any(n <= 0 for n in numbers):
            raise ValueError(f"--series: {part!r} has a value <= 0")
        fields[key] = numbers
    tokens = tuple(fields.get("tokens", base.tokens))
    vocabs = tuple(fields.get("vocab", base.vocabs))
    return dataclasses.replace(
        base, tokens=tokens, vocabs=vocabs, hidden=fields.get("hidden", (base.hidden,))[0],
        vocab_fixed=fields.get("at_vocab", (vocabs[0] if "vocab" in fields else base.vocab_fixed,))[0],
        tokens_fixed=fields.get("at_tokens", (tokens[0] if "tokens" in fields else base.tokens_fixed,))[0])


def make_case(path: str, tokens: int, vocab: int, plan: ScalingPlan) -> Dict:
    """bench's case dict for one point: ``B`` responses of ``T = min(N, 1024)`` tokens."""
    length = min(tokens, 1024)
    if tokens % length:
        raise ValueError(f"--series: {tokens} tokens are not a whole number of {length}-token responses")
    case = dict(path=path, B=tokens // length, T=length, V=vocab, dtype=plan.dtype, inactive=0.0)
    if path == "linear":
        case["H"] = plan.hidden
    return case


@dataclasses.dataclass(frozen=True)
class ScalingPoint:
    """One implementation (``impl``, bench's name) on one case (``path``: ``"logits"`` or ``"linear"``) at one
    point of the series: ``tokens`` (N) and ``vocab`` (V)."""

    impl: str
    path: str
    tokens: int
    vocab: int

    def estimate(self, plan: ScalingPlan) -> int:
        """:func:`estimate_bytes` of this point under ``plan`` (its hidden size and dtype)."""
        return estimate_bytes(self.impl, self.path, self.tokens, self.vocab, plan.hidden, plan.dtype)


def _record(point: ScalingPoint, plan: ScalingPlan, estimate: int) -> Dict:
    impl, path, tokens, vocab = point.impl, point.path, point.tokens, point.vocab
    return dict(impl=impl, path=path, tokens=tokens, vocab=vocab, hidden=plan.hidden if path == "linear" else None,
                dtype=plan.dtype, series=plan.series_of(tokens, vocab), ms=None, fwd_ms=None, bwd_ms=None,
                peak_mb=None, kept_mb=None, estimate_mb=round(estimate / 2**20, 1), status=None, reason=None)


def run_point(point: ScalingPoint, plan: ScalingPlan, device: str, cap: int, predict: bool = True,
              slack: int = RUN_SLACK) -> Dict:
    """One implementation at one point: ``"oom"`` without running when estimated over ``cap`` bytes (``predict``),
    else ``bench.run_one`` under ``cap + slack`` bytes, its result classified (an allocation that failed: "oom")."""
    impl, path, tokens, vocab = point.impl, point.path, point.tokens, point.vocab
    estimate = point.estimate(plan)
    rec = _record(point, plan, estimate)
    if predict and estimate > cap:
        rec.update(status="oom", reason=f"estimated {estimate / GIB:.2f} GiB > the cap of {cap / GIB:.2f} GiB: "
                                        "not run")
        return rec
    result = bench.run_one(impl, make_case(path, tokens, vocab, plan), plan.repeats, device, plan.timeout_s,
                           memory_cap=cap + slack)
    status, reason = result["status"], result.get("reason")
    if status == "ok":
        peak = result["peak_extra_bytes"]
        rec.update(status="ok", ms=round(result["total_ms"], 2), fwd_ms=round(result["fwd_ms"], 2),
                   bwd_ms=round(result["bwd_ms"], 2), peak_mb=None if peak is None else round(peak / 2**20, 1),
                   kept_mb=round(result.get("kept_bytes", 0) / 2**20, 1), spread_ms=[round(result["min_ms"], 2),
                                                                                    round(result["max_ms"], 2)])
    elif status == "error" and (is_out_of_memory(reason) or "exited with -9" in (reason or "")):
        rec.update(status="oom", reason=f"out of memory while running (limit {(cap + slack) / GIB:.2f} GiB): "
                                        f"{reason}"[:500])
    elif status == "error" and (reason or "").startswith("timed out"):
        rec.update(status="skipped", reason=reason)
    else:
        rec.update(status=status, reason=reason)
    return rec


def _inherited(rec: Dict, done: List[Dict]) -> Optional[Tuple[str, str]]:
    """(status, reason) when an earlier point of the same implementation and path decides this one's."""
    for old in done:
        if old["impl"] != rec["impl"] or old["path"] != rec["path"]:
            continue
        if old["status"] == "skipped":
            return "skipped", old["reason"]
        if (old["status"] == "oom" and rec["tokens"] >= old["tokens"] and rec["vocab"] >= old["vocab"]
                and old["reason"] and "not run" not in old["reason"]):
            return "oom", f"not run: {old['tokens']} tokens x {old['vocab']} was out of memory"
    return None


def progress_line(i: int, total: int, rec: Dict, seconds: float) -> str:
    """The plain line printed after each point (no carriage returns: it goes to CI logs)."""
    head = (f"[{i:>3}/{total}] {rec['path']:<6} N={rec['tokens']:<6} V={rec['vocab']:<7} {rec['impl']:<19} "
            f"{rec['status']:<7}")
    if rec["status"] == "ok":
        peak = "n/a" if rec["peak_mb"] is None else f"{rec['peak_mb']:.0f}"
        return f"{head} {rec['ms']:9.1f} ms {peak:>7} MB (estimate {rec['estimate_mb']:.0f} MB) {seconds:5.1f} s"
    return f"{head} {rec['reason']}"[:240]


def slopes(records: List[Dict], plan: ScalingPlan) -> Dict[str, Dict[str, float]]:
    """``{path: {impl: d log(peak) / d log(N)}}`` over the token series' measured points (two at least)."""
    out: Dict[str, Dict[str, float]] = {}
    for rec in records:
        out.setdefault(rec["path"], {})
    for path in out:
        for impl in dict.fromkeys(r["impl"] for r in records if r["path"] == path):
            pts = [(math.log(r["tokens"]), math.log(r["peak_mb"])) for r in records
                   if r["path"] == path and r["impl"] == impl and "tokens" in r["series"] and r["status"] == "ok"
                   and r["peak_mb"] and r["peak_mb"] > 0]
            if len(pts) >= 2:
                mx = sum(x for x, _ in pts) / len(pts)
                my = sum(y for _, y in pts) / len(pts)
                den = sum((x - mx) ** 2 for x, _ in pts)
                if den > 0:
                    out[path][impl] = round(sum((x - mx) * (y - my) for x, y in pts) / den, 3)
    return out


def plot(records: List[Dict], plan: ScalingPlan, cap: int, path: str, title: str) -> Optional[str]:
    """Per path a row of four log-log panels: peak memory and time against tokens, the same against the vocabulary;
    points over the cap drawn as x at their estimate; returns why the chart was skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or the [plot] extra)"
    paths = list(dict.fromkeys(r["path"] for r in records))
    impls = list(dict.fromkeys(r["impl"] for r in records))
    colors = {impl: f"C{i % 10}" for i, impl in enumerate(impls)}
    fig, axes = plt.subplots(len(paths), 4, figsize=(19, 4.3 * len(paths)), squeeze=False)
    columns = (("tokens", "peak_mb", f"peak memory vs tokens (V = {plan.vocab_fixed})"),
               ("tokens", "ms", f"time vs tokens (V = {plan.vocab_fixed})"),
               ("vocab", "peak_mb", f"peak memory vs vocabulary (N = {plan.tokens_fixed})"),
               ("vocab", "ms", f"time vs vocabulary (N = {plan.tokens_fixed})"))
    for row, p in zip(axes, paths):
        for ax, (series, key, name) in zip(row, columns):
            x_key = "tokens" if series == "tokens" else "vocab"
            for impl in impls:
                rows = sorted((r for r in records if r["path"] == p and r["impl"] == impl and series in r["series"]),
                              key=lambda r: r[x_key])
                ok = [r for r in rows if r["status"] == "ok" and r[key]]
                if ok:
                    ax.plot([r[x_key] for r in ok], [r[key] for r in ok], "o-", color=colors[impl], label=impl, ms=4)
                over = [r for r in rows if r["status"] == "oom"]
                if over and key == "peak_mb":
                    ax.plot([r[x_key] for r in over], [r["estimate_mb"] for r in over], "x", color=colors[impl],
                            ms=8, mew=2)
            if key == "peak_mb":
                shown = [y for line in ax.get_lines() for y in line.get_ydata()]
                if shown and cap / 2**20 <= 4 * max(shown):  # the cap line only where it does not flatten the curves
                    ax.axhline(cap / 2**20, color="gray", ls="--", lw=1)
                ax.text(0.01, 0.98, f"cap {cap / GIB:.1f} GiB; x: out of memory (at the estimate)",
                        transform=ax.transAxes, va="top", fontsize=7, color="gray")
            ax.set_xscale("log", base=2)
            xs = sorted({r[x_key] for r in records if r["path"] == p and series in r["series"]})
            ax.set_xticks(xs, [f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x) for x in xs])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("tokens N" if series == "tokens" else "vocabulary V")
            ax.set_ylabel("peak extra MB" if key == "peak_mb" else "ms per fwd + bwd (median)")
            ax.set_title(f"{PATH_NAMES.get(p, p)}: {name}", fontsize=9)
            ax.grid(True, which="major", alpha=0.3)
        if row[0].get_legend_handles_labels()[0]:
            row[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _setup(args: argparse.Namespace) -> Tuple[str, ScalingPlan, int, str, Dict[str, Tuple[str, ...]]]:
    """(device, plan, cap bytes, where the cap came from, {path: impls}) from the arguments; ValueError if bad."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device: cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    plan = PLANS[("cuda" if device.startswith("cuda") else "cpu", bool(args.quick))]
    if getattr(args, "series", None):
        plan = parse_series(args.series, plan)
    if args.repeats is not None:
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        plan = dataclasses.replace(plan, repeats=args.repeats)
    if args.timeout is not None:
        plan = dataclasses.replace(plan, timeout_s=float(args.timeout))
    if args.memory_cap is not None:
        if not args.memory_cap > 0:
            raise ValueError(f"--memory-cap must be > 0 GiB, got {args.memory_cap}")
        cap, source = int(args.memory_cap * GIB), "--memory-cap"
    else:
        cap, source = int(0.75 * available_bytes(device)), f"3/4 of the memory available on {device} at the start"
    paths = ("linear", "logits")
    if args.cases:
        unknown = [c for c in args.cases if c not in bench.CASES]
        if unknown:
            raise ValueError(f"--cases: unknown {unknown}; choose among {list(bench.CASES)}")
        paths = tuple(p for p in paths if any(bench.CASES[c]["path"] == p for c in args.cases))
    impls = {}
    for p in paths:
        known = bench.IMPLS[p]
        if args.impls:
            impls[p] = tuple(i for i in args.impls if i in known)
        else:
            impls[p] = tuple(i for i in DEFAULT_IMPLS[p] if i in known)
    if args.impls:
        unknown = [i for i in args.impls if not any(i in bench.IMPLS[p] for p in paths)]
        if unknown:
            raise ValueError(f"--impls: unknown {unknown}; choose among {sorted(set().union(*bench.IMPLS.values()))}")
    return device, plan, cap, source, impls


def run(args: argparse.Namespace) -> int:
    """The subcommand ``bench --scaling``: exit status 0, 1 when a point failed (not oom, not skipped), 2 on bad
    arguments."""
    if getattr(args, "gpu", False):
        print("gspo-kernels bench: --scaling and --gpu are two runs; give one", file=sys.stderr)
        return 2
    try:
        device, plan, cap, cap_source, impls = _setup(args)
    except ValueError as exc:
        print(f"gspo-kernels bench --scaling: {exc}", file=sys.stderr)
        return 2
    env = bench.environment("cuda" if device.startswith("cuda") else "cpu")
    jobs = [(p, n, v, impl) for p in impls for (n, v) in plan.points() for impl in impls[p]]
    print(f"gspo-kernels bench --scaling{' --quick' if args.quick else ''}: {env['device_name']} ({device}, "
          f"{env['torch_threads']} threads), torch {env['versions']['torch']}; tokens {list(plan.tokens)} at "
          f"V = {plan.vocab_fixed}, vocabularies {list(plan.vocabs)} at N = {plan.tokens_fixed}, H = {plan.hidden}, "
          f"{plan.dtype}; {len(jobs)} points; memory cap {cap / GIB:.2f} GiB ({cap_source})", flush=True)
    records: List[Dict] = []
    start = time.time()
    for i, (p, n, v, impl) in enumerate(jobs, 1):
        t0 = time.time()
        point = ScalingPoint(impl=impl, path=p, tokens=n, vocab=v)
        rec = _record(point, plan, point.estimate(plan))
        inherited = _inherited(rec, records)
        if inherited:
            rec.update(status=inherited[0], reason=inherited[1])
        else:
            rec = run_point(point, plan, device, cap)
        records.append(rec)
        print(progress_line(i, len(jobs), rec, time.time() - t0), flush=True)
    prefix = bench.output_prefix("results/scaling" if args.out == "results/bench" else args.out)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    json_path, png_path = prefix + ".json", prefix + ".png"
    command = "gspo-kernels " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "gspo-kernels bench --scaling"
    fitted = slopes(records, plan)
    title = (f"{command}  |  {env['device_name']} ({device}), torch {env['versions']['torch']}, {env['time_utc']}; "
             f"H = {plan.hidden}, {plan.dtype}, median of {plan.repeats} after a warm-up")
    skipped_chart = plot(records, plan, cap, png_path, title)
    payload = dict(command=command, environment=env, elapsed_s=round(time.time() - start, 1),
                   plan=dataclasses.asdict(plan), memory_cap_bytes=cap, memory_cap_source=cap_source,
                   method=dict(time="median fwd + bwd ms of the timed steps after one warm-up, a fresh process per "
                                    "point (bench.run_one)",
                               peak="peak extra memory as bench measures it: "
                                    + ("torch.cuda.max_memory_allocated above the step's start" if device != "cpu"
                                       else "peak RSS above the timed steps' start, plus the buffers the cpu backend "
                                            "keeps between steps"),
                               estimate="estimate_bytes: inputs, gradients and the [N, V] buffers each "
                                        "implementation holds (bench_scaling.NV_BUFFERS); over the cap: oom, not run"),
                   slopes_peak_vs_tokens=fitted, records=records,
                   chart=None if skipped_chart else png_path, chart_skipped=skipped_chart)
    with open(json_path, "w") as f:
        json.dump(payload, f, indent=1)
    for p, by_impl in fitted.items():
        if by_impl:
            print(f"slope of log peak memory vs log tokens ({PATH_NAMES[p]}): "
                  + ", ".join(f"{k} {s:.2f}" for k, s in by_impl.items()))
    print(f"wrote {json_path}" + (f" and {png_path}" if not skipped_chart else f"; chart skipped: {skipped_chart}")
          + f" ({time.time() - start:.0f} s)")
    return 1 if any(r["status"] == "error" for r in records) else 0
