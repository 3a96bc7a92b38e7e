"""``gpu-check``'s ``cuda-graphs`` step: the compiled loss step captured as CUDA graphs (``mode="reduce-overhead"``).

For each selected backend, path and shape, the loss step (forward and backward: ``fused_linear_gspo_loss`` over
``hidden`` and the lm_head weight, or ``gspo_loss`` over logits) runs eager, compiled (Inductor) and compiled with
``mode="reduce-overhead"`` (Inductor's CUDA-graph trees), on fresh inputs of one shape each call. Checked: every call
of both compiled forms equals eager (loss and gradients; fp32 rounding: Inductor fuses the PyTorch parts), and
Inductor skipped no CUDA graph (``counters["inductor"]["cudagraph_skips"]``: a host read-back, a CPU tensor or an
input mutation makes it run the step without graphs, silently). Measured: the median milliseconds of a step in each
form (``cuda.synchronize`` around each), the host's share of a small step being what the graphs remove.

Run by ``gspo-kernels gpu-check --steps cuda-graphs`` (part of the full check) in a subprocess:
``python -m gspo_kernels.tools.gpu_check_graphs --out FILE.json [--backends triton,torch] [--paths linear,logits]
[--shapes small,medium] [--repeats N]``. Without a CUDA device it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from gspo_kernels import backends as _backends

# the backends that run on CUDA tensors, in "auto"'s order there (cpu's kernels are CPU-only)
BACKENDS = tuple(r.name for r in sorted((r for r in _backends.REGISTRY if "cuda" in r.auto),
                                        key=lambda r: r.auto["cuda"]))
PATHS = ("linear", "logits")
# B, T, H, V: small (host work dominates: where graphs help most) and medium (an RL micro-batch's head, shrunk)
SHAPES: Dict[str, Dict[str, int]] = {
    "small": dict(B=2, T=64, H=256, V=4096),
    "medium": dict(B=8, T=512, H=2048, V=32768),
}
FORMS = ("eager", "compiled", "reduce-overhead")
RTOL, ATOL = 1e-4, 1e-5  # fp32; sums over up to N = 4096 rows and V = 32768 columns in another order
RESULT_FILE = "cuda_graphs.json"


def parse_selection(option: str, text: Optional[str], known: Sequence[str]) -> List[str]:
    """The comma-separated names of ``text`` (None or empty: all of ``known``), checked against ``known``;
    a ``ValueError`` naming ``option`` otherwise."""
    if text is None or not text.strip():
        return list(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{option} must name among {', '.join(known)}; got {', '.join(unknown)}")
    return list(dict.fromkeys(names))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; ``--backends`` / ``--paths`` / ``--shapes`` become checked lists (``SystemExit`` 2 on a
    bad value, with argparse's message naming the option)."""
    parser = argparse.ArgumentParser(prog="python -m gspo_kernels.tools.gpu_check_graphs", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file of the results")
    parser.add_argument("--backends", default=None, help=f"comma-separated, among {', '.join(BACKENDS)} (default all)")
    parser.add_argument("--paths", default=None, help=f"comma-separated, among {', '.join(PATHS)} (default all)")
    parser.add_argument("--shapes", default=None, help=f"comma-separated, among {', '.join(SHAPES)} (default all)")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per form after the warm-up (default 10)")
    args = parser.parse_args(argv)
    try:
        args.backends = parse_selection("--backends", args.backends, BACKENDS)
        args.paths = parse_selection("--paths", args.paths, PATHS)
        args.shapes = parse_selection("--shapes", args.shapes, tuple(SHAPES))
    except ValueError as exc:
        parser.error(str(exc))
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def _inputs(path: str, shape: Dict[str, int], seed: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, V = shape["B"], shape["T"], shape["H"], shape["V"]
    labels = torch.randint(0, V, (B, T), device="cuda", generator=g)
    adv = torch.randn(B, device="cuda", generator=g)
    old = -8.0 + 0.1 * torch.randn(B, T, device="cuda", generator=g)
    mask = (torch.rand(B, T, device="cuda", generator=g) > 0.2).float()
    if path == "linear":
        leaves = (torch.randn(B, T, H, device="cuda", generator=g).requires_grad_(),
                  (torch.randn(V, H, device="cuda", generator=g) / H**0.5).requires_grad_())
    else:
        leaves = ((2 * torch.randn(B, T, V, device="cuda", generator=g)).requires_grad_(),)
    return leaves, (labels, adv, old, mask)


def _step(path: str, backend: str) -> Callable:
    import gspo_kernels as gk

    if path == "linear":
        def step(hidden, weight, labels, adv, old, mask):
            return gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, backend=backend).loss
    else:
        def step(logits, labels, adv, old, mask):
            return gk.gspo_loss(logits, labels, adv, old, mask=mask, backend=backend).loss
    return step


def _call(fn: Callable, leaves, rest) -> List:
    """Loss and gradients of one call, cloned (a CUDA-graph replay overwrites its outputs at the next one)."""
    import torch

    loss = fn(*leaves, *rest)
    grads = torch.autograd.grad(loss, leaves)
    return [loss.detach().clone()] + [g.clone() for g in grads]


def measure(backend: str, path: str, shape_name: str, repeats: int) -> Dict:
    """One backend, path and shape: each form's median ms, the largest difference from eager, the graphs skipped."""
    import torch
    from torch._dynamo.utils import counters

    step = _step(path, backend)
    torch._dynamo.reset()
    counters.clear()
    forms = {"eager": step, "compiled": torch.compile(step, fullgraph=True),
             "reduce-overhead": torch.compile(step, fullgraph=True, mode="reduce-overhead")}
    record: Dict = dict(backend=backend, path=path, shape=shape_name, **SHAPES[shape_name], ok=True)
    worst = {form: 0.0 for form in FORMS[1:]}
    for seed in range(3):  # the first calls compile and record the graphs, the later ones replay them
        leaves, rest = _inputs(path, SHAPES[shape_name], seed)
        eager = _call(step, leaves, rest)
        for form in FORMS[1:]:
            for got, want in zip(_call(forms[form], leaves, rest), eager):
                close = torch.allclose(got, want, rtol=RTOL, atol=ATOL)
                worst[form] = max(worst[form], (got - want).abs().max().item())
                record["ok"] = record["ok"] and close
    record["max_abs_diff"] = worst
    record["cudagraph_skips"] = int(sum(counters["inductor"].get(k, 0) for k in counters["inductor"]
                                        if k.startswith("cudagraph_skip")))
    record["ok"] = record["ok"] and record["cudagraph_skips"] == 0
    leaves, rest = _inputs(path, SHAPES[shape_name], 99)
    for form in FORMS:
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _call(forms[form], leaves, rest)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        record[f"{form}_ms"] = 1e3 * statistics.median(times[1:])
    return record


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check_graphs: no CUDA device: CUDA graphs cannot be captured here; nothing was measured",
              file=sys.stderr)
        return 2
    import gspo_kernels

    available = gspo_kernels.available_backends("cuda")  # loads the backends before anything is compiled
    records = []
    for backend in args.backends:
        for path in args.paths:
            for shape in args.shapes:
                if backend not in available:
                    records.append(dict(backend=backend, path=path, shape=shape, ok=None,
                                        skipped=f"backend {backend!r} unavailable on cuda"))
                    continue
                try:
                    records.append(measure(backend, path, shape, args.repeats))
                except Exception as exc:  # recorded, the others still run
                    records.append(dict(backend=backend, path=path, shape=shape, ok=False,
                                        error=f"{type(exc).__name__}: {exc}"[:500]))
                print(json.dumps(records[-1]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, records=records), f, indent=1)
    return 0 if all(r["ok"] is not False for r in records) else 1


def step(out_dir: str, limit_s: float, run_subprocess: Callable):
    """gpu-check's step: this module's ``main`` in a subprocess (``run_subprocess``: gpu-check's runner, giving its
    ``StepResult``) within ``limit_s``; the records go to ``<out_dir>/cuda_graphs.json`` and the result's data."""
    path = os.path.join(out_dir, RESULT_FILE)
    if os.path.exists(path):  # never a previous run's records
        os.remove(path)
    result = run_subprocess("cuda-graphs", [sys.executable, "-m", "gspo_kernels.tools.gpu_check_graphs",
                                            "--out", path], limit_s)
    result.data["file"] = path
    if os.path.exists(path):
        with open(path) as f:
            records = json.load(f)["records"]
        result.data["records"] = records
        bad = [f"{r['backend']}/{r['path']}/{r['shape']}" for r in records if r["ok"] is False]
        good = sum(r["ok"] is True for r in records)
        result.summary += f"; {good} of {len(records)} captured and equal to eager" + (
            f"; failed: {', '.join(bad)}" if bad else "")
    return result


if __name__ == "__main__":
    sys.exit(main())
