"""The ``torch`` backend's two forms of the hidden-state path's row selection on CPU tensors, side by side in one run.

    PYTHONPATH=. python benchmarks/torch_row_selection.py                   # N=2048 H=256 V=8192, 50% / 90% rows
    PYTHONPATH=. python benchmarks/torch_row_selection.py --compile         # and the compiled step (inductor)

Eager picks the rows with a mask (``nonzero``: a data-dependent count) and computes only those, forward and
backward; under ``torch.compile`` (or CUDA-graph capture) there is no host read, and it computes every row with
the others masked to 0 (a shape known before the values: one graph). The full-size form is forced here in eager
by patching ``host_reads_allowed`` in the backend's module (this script only). Times are the median of
``--repeats`` forward + backward steps of ``fused_linear_gspo_loss`` (fp32), after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

import gspo_kernels as gk
from gspo_kernels.backends.torch import linear as torch_linear


def _step(hidden, weight, labels, adv, mask):
    return gk.fused_linear_gspo_loss(hidden, weight, labels, adv, mask=mask, backend="torch").loss


def _time(fn, hidden, weight, *args, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        t0 = time.perf_counter()
        fn(h, w, *args).backward()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also the compiled step (inductor; slow to compile)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    B = 8
    T = args.rows // B
    hidden, weight = torch.randn(B, T, args.hidden), torch.randn(args.vocab, args.hidden) * 0.05
    labels, adv = torch.randint(0, args.vocab, (B, T)), torch.randn(B)
    print(f"cpu, {torch.get_num_threads()} threads; N={B * T} H={args.hidden} V={args.vocab} fp32, "
          f"forward + backward of fused_linear_gspo_loss(backend='torch'), median of {args.repeats}")
    print(f"{'rows kept':>10} {'selected (eager)':>17} {'full-size masked':>17} {'ratio':>6}" +
          (f" {'compiled':>9}" if args.compile else ""))
    for kept in (0.5, 0.9):
        mask = (torch.rand(B, T) < kept).float()
        selected = _time(_step, hidden, weight, labels, adv, mask, repeats=args.repeats)
        with mock.patch.object(torch_linear, "host_reads_allowed", lambda: False):
            full = _time(_step, hidden, weight, labels, adv, mask, repeats=args.repeats)
        row = f"{kept:>10.0%} {selected * 1e3:>14.1f} ms {full * 1e3:>14.1f} ms {full / selected:>6.2f}"
        if args.compile:
            torch._dynamo.reset()
            compiled = _time(torch.compile(_step, fullgraph=True), hidden, weight, labels, adv, mask,
                             repeats=args.repeats)
            row += f" {compiled * 1e3:>6.1f} ms"
        print(row, flush=True)


if __name__ == "__main__":
    main()
