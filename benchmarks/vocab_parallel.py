"""Vocabulary-parallel hidden-state step (2 gloo processes) against one process, on the CPU.

    PYTHONPATH=$PWD python benchmarks/vocab_parallel.py                   # N=1024, H=896, V=151936
    PYTHONPATH=$PWD python benchmarks/vocab_parallel.py --world 2 3 --backend torch

The step is ``fused_linear_gspo_loss(...)`` forward + backward (GSPO, fp32, 4 responses of 256 tokens).
With ``world > 1`` each process holds ``V / world`` lm_head rows (``VocabParallel``) and uses
``threads / world`` threads, so every configuration runs on the same cores. Per rank: the median step
time over ``--repeats`` steps after one warm-up step, and "peak extra", the process's peak RSS during the
steps minus its RSS once its inputs exist (Linux: the peak is reset through ``/proc/self/clear_refs``) (it includes this rank's weight gradient and dH). Every
configuration computes the same loss (printed). Not a test:
timings on a shared machine are noisy; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gspo_kernels as gk  # noqa: E402
from gspo_kernels.tools.table import Column, text_header, text_row  # noqa: E402


def _worker(rank: int, world: int, port: int, args, results) -> None:
    torch.set_num_threads(max(1, args.threads // world))
    vp = None
    V, H, N, S = args.vocab, args.hidden, args.tokens, 4
    start, end = rank * V // world, (rank + 1) * V // world
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        vp = gk.VocabParallel(None, start, end)
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(S, N // S, H, generator=gen) * 0.5).requires_grad_()
    labels = torch.randint(0, V, (S, N // S), generator=gen)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    weight = _weight_rows(start, end, H).requires_grad_()
    old = torch.full((S, N // S), -12.0)
    config = gk.GSPOConfig(epsilon_low=0.2, epsilon_high=0.28)
    base = _reset_peak_rss()
    times = []
    for step in range(args.repeats + 1):
        hidden.grad = weight.grad = None
        if vp is not None:
            dist.barrier()
        t0 = time.perf_counter()
        out = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, config=config, backend=args.backend,
                                        vocab_parallel=vp)
        out.loss.backward()
        if step:
            times.append(time.perf_counter() - t0)
    peak = _status_kib("VmHWM")
    results.put((world, rank, statistics.median(times), (peak - base) / 1024 ** 2, float(out.loss.detach())))
    if vp is not None:
        dist.destroy_process_group()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> int:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux); returns that RSS in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def _weight_rows(start: int, end: int, H: int, block: int = 1024) -> torch.Tensor:
    """Rows [start, end) of one fixed [V, H] weight, made block by block (no rank builds the whole)."""
    parts = []
    for b in range(start // block, (end + block - 1) // block):
        rows = torch.randn(block, H, generator=torch.Generator().manual_seed(100 + b)) * 0.02
        lo, hi = max(start, b * block), min(end, (b + 1) * block)
        parts.append(rows[lo - b * block:hi - b * block])
    return torch.cat(parts)


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for world in [1, *[w for w in args.world if w > 1]]:
        results = ctx.Queue()
        port = _port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, args, results)) for r in range(world)]
        for p in procs:
            p.start()
        got = [results.get() for _ in procs]
        for p in procs:
            p.join()
        rows.extend(sorted(got))
    print(f"fused_linear_gspo_loss fwd+bwd, N={args.tokens} H={args.hidden} V={args.vocab} fp32, backend "
          f"{args.backend}, {args.threads} threads in all")
    columns = (Column("processes", 9), Column("rank", 4), Column("rows of W", 10), Column("step s", 8, spec=".2f"),
               Column("peak extra GiB", 15, spec=".2f"), Column("loss", 12, spec=".6f"))
    print(text_header(columns))
    for world, rank, seconds, gib, loss in rows:
        print(text_row(columns, [world, rank, args.vocab // world, seconds, gib, loss]))


if __name__ == "__main__":
    main()
