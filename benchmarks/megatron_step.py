"""The output layer of a Megatron step, TP = 2 over 2 gloo processes on the CPU: peak memory and time of three ways
to get the tokens' log-probs from the decoder's hidden states and this rank's ``[V/2, H]`` output-layer shard.

* ``megatron logits``: megatron's own path, ``hidden @ W_shard.T`` (the ``[T, V/2]`` logits) then
  ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` (it keeps its softmax for the backward);
* ``chunked logits``: NeMo-RL-style chunking, written here (not NeMo-RL's code): the same megatron calls on chunks of
  ``--chunk`` tokens, each chunk's logits recomputed in the backward (``torch.utils.checkpoint``);
* ``gspo_kernels``: ``gspo_kernels.linear_logprobs`` with ``VocabParallel`` on the shard: by default its CPU
  backend keeps up to 1 GiB of logits for the backward (here all of them); with ``memory_budget=0`` it keeps none
  and recomputes them.

Each runs forward + backward of ``sum(w * logp)`` (``w`` a fixed random weight per token); the peak counts the
tensor storages allocated during the step (``benchmarks/memory_trace.py``: the inputs and the weight shard excluded;
the shard's gradient and ``dH`` included). Megatron's two CUDA-only calls (``torch.cuda.current_device`` and the
CUDA RNG tracker) are bypassed in these processes, as in the tests. The hidden states are random ``[T, 1, H]``
fp32 rows, the same on both ranks (what a non-sequence-parallel decoder hands its output layer).

Then a **predicted** per-rank figure for a realistic shape from allocation arithmetic (no measurement).

    PYTHONPATH=$PWD python benchmarks/megatron_step.py [--tokens 4096 --hidden 256 --vocab 32000 --chunk 1024]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_trace import MemoryTrace  # noqa: E402

GIB = 1024 ** 3
METHODS = ("megatron logits", "chunked logits", "gspo_kernels", "gspo_kernels, memory_budget=0")


def _megatron_logp(hidden, weight, labels):
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, vocab_parallel_cross_entropy

    logits = copy_to_tensor_model_parallel_region(hidden) @ weight.t()  # [T, 1, V/tp]
    return -vocab_parallel_cross_entropy(logits, labels.t().contiguous())[:, 0]


def _chunked_logp(hidden, weight, labels, chunk):
    from torch.utils.checkpoint import checkpoint

    pieces = [checkpoint(_megatron_logp, hidden[i:i + chunk], weight, labels[:, i:i + chunk], use_reentrant=False)
              for i in range(0, hidden.shape[0], chunk)]
    return torch.cat(pieces)


def _library_logp(hidden, weight, labels, vp, budget=None):
    from gspo_kernels import linear_logprobs

    return linear_logprobs(hidden[:, 0], weight, labels[0], vocab_parallel=vp, memory_budget=budget)


def _worker(rank: int, port: int, args, outdir: str) -> None:
    from megatron.core import parallel_state, tensor_parallel

    from gspo_kernels import VocabParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.cuda.current_device = lambda: torch.device("cpu")
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    local = args.vocab // 2
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, 1, args.hidden, generator=gen)
    labels = torch.randint(0, args.vocab, (1, args.tokens), generator=gen)
    w = torch.randn(args.tokens, generator=gen)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden ** 0.5)[rank * local:(rank + 1) * local]
    vp = VocabParallel(parallel_state.get_tensor_model_parallel_group(), rank * local, (rank + 1) * local)
    calls = {"megatron logits": lambda h, W: _megatron_logp(h, W, labels),
             "chunked logits": lambda h, W: _chunked_logp(h, W, labels, args.chunk),
             "gspo_kernels": lambda h, W: _library_logp(h, W, labels, vp),
             "gspo_kernels, memory_budget=0": lambda h, W: _library_logp(h, W, labels, vp, 0)}
    rows = []
    for name in METHODS:
        h, W = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        dist.barrier()
        start = time.perf_counter()
        with MemoryTrace() as trace:
            logp = calls[name](h, W)
            (logp * w).sum().backward()
        rows.append((name, trace.peak_bytes, time.perf_counter() - start, float((logp.detach() * w).sum())))
        del logp, h, W
    with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
        f.write(repr(rows))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def predicted(tokens: int, hidden: int, vocab: int, tp: int, chunk: int, budget: int) -> list:
    """Per-rank bytes above the inputs and parameters for log-probs + backward of a bf16 model's output layer
    (allocation arithmetic, not measured). ``L = T V/tp`` logits per rank.

    megatron logits: the bf16 logits (2 L) and the fp32 copy that ``vocab_parallel_cross_entropy`` is given and
    keeps as its softmax (4 L), then the fp32 gradient of the logits in the backward (4 L) and its bf16 cast (2 L),
    at most 12 L alive at once, plus ``dH`` (bf16, 2 T H); chunked logits: the same per chunk of ``chunk`` tokens;
    gspo_kernels: its chunk buffers, exactly ``memory_budget`` bytes when one is given, plus ``dH`` and O(T) fp32
    row statistics (see docs/gpu.md)."""
    per_token = 12 * vocab // tp
    dh = 2 * tokens * hidden
    return [("megatron logits", per_token * tokens + dh),
            (f"chunked logits ({chunk} tokens)", per_token * chunk + dh),
            (f"gspo_kernels (memory_budget={budget / GIB:g} GiB)", budget + dh + 16 * tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk", type=int, default=1024)
    args = parser.parse_args()
    if args.vocab % 2:
        parser.error("--vocab must be even (2 tensor-parallel ranks)")
    import megatron.core
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_worker, args=(port, args, outdir), nprocs=2, start_method="spawn")
        ranks = [eval(open(os.path.join(outdir, f"rank{r}.txt")).read()) for r in range(2)]  # our own repr
    print(f"# Megatron output layer, TP=2 over 2 gloo processes (one thread each), {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"# T={args.tokens} tokens, H={args.hidden}, V={args.vocab} ({args.vocab // 2} rows per rank), fp32, "
          f"log-probs forward + backward; peak = tensor storages allocated during the step, per rank")
    print("| method | rank | peak (MiB) | vs megatron logits | step (s) | sum(w logp) |")
    print("|---|---|---|---|---|---|")
    for rank, rows in enumerate(ranks):
        base = rows[0][1]
        for name, peak, seconds, value in rows:
            print(f"| {name} | {rank} | {peak / 2 ** 20:.1f} | {peak / base:.2f}x | {seconds:.2f} | {value:.6f} |")
    shape = dict(tokens=32768, hidden=8192, tp=8, chunk=1024, budget=GIB)
    print(f"\n# PREDICTED (allocation arithmetic, not measured): T={shape['tokens']}, H={shape['hidden']}, "
          f"TP={shape['tp']}, bf16 parameters, per rank")
    print("| V | method | predicted peak (GiB) |")
    print("|---|---|---|")
    for vocab in (151936, 248320):
        for name, nbytes in predicted(vocab=vocab, **shape):
            print(f"| {vocab} | {name} | {nbytes / GIB:.2f} |")


if __name__ == "__main__":
    main()
