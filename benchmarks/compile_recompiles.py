"""How many compilations a run of varying sequence lengths costs under ``torch.compile``, per ``dynamic`` setting.

    PYTHONPATH=. python benchmarks/compile_recompiles.py                 # backend cpu, aot_eager, 8 steps
    PYTHONPATH=. python benchmarks/compile_recompiles.py --backend torch --compiler inductor

A step is ``fused_linear_gspo_loss`` forward + backward on ``[B, T, H]`` hidden states whose ``T`` changes from step
to step (as an RL run's rollouts do: the longest response sets it); ``B`` and the mask's zeros change too. Counted:
the frames Dynamo compiled (``torch._dynamo.utils.counters["frames"]["ok"]``: the first compilation plus each
recompilation), and the wall time of the steps that compiled against those that did not.
"""

from __future__ import annotations

import argparse
import time

import torch

import gspo_kernels as gk

LENGTHS = (37, 53, 41, 64, 29, 58, 47, 61)


def _step(hidden, weight, labels, adv, old, mask, backend):
    return gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, backend=backend).loss


def run(backend: str, compiler: str, dynamic, H: int = 64, V: int = 512) -> dict:
    from torch._dynamo.utils import counters

    gk.available_backends("cpu")  # loaded before compiling (a first use imports it: not traceable)
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(_step, backend=compiler, dynamic=dynamic)
    weight = torch.randn(V, H) * 0.1
    compiled_steps, times = [], []
    for i, T in enumerate(LENGTHS):
        B = 4 + i % 2
        hidden = torch.randn(B, T, H, requires_grad=True)
        labels = torch.randint(0, V, (B, T))
        mask = (torch.rand(B, T) > 0.2).float()
        before = counters["frames"]["ok"]
        t0 = time.perf_counter()
        fn(hidden, weight.requires_grad_(), labels, torch.randn(B), -6.2 + 0.1 * torch.randn(B, T), mask,
           backend).backward()
        times.append(time.perf_counter() - t0)
        compiled_steps.append(counters["frames"]["ok"] > before)
    return {"compilations": int(counters["frames"]["ok"]), "compiled_steps": compiled_steps, "times": times}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--compiler", default="aot_eager")
    args = parser.parse_args(argv)
    print(f"cpu, {torch.get_num_threads()} threads, torch {torch.__version__}; backend={args.backend!r}, "
          f"torch.compile(backend={args.compiler!r}); {len(LENGTHS)} steps, T = {LENGTHS}, B alternating 4 / 5")
    print(f"{'dynamic':>8} {'compilations':>13} {'steps that compiled':>20} {'compiling step':>15} {'other steps':>12}")
    for dynamic in (None, True, False):
        r = run(args.backend, args.compiler, dynamic)
        hot = [t for t, c in zip(r["times"], r["compiled_steps"]) if c]
        cold = [t for t, c in zip(r["times"], r["compiled_steps"]) if not c]
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        print(f"{str(dynamic):>8} {r['compilations']:>13} {sum(r['compiled_steps']):>20} "
              f"{mean(hot) * 1e3:>12.0f} ms {mean(cold) * 1e3:>9.1f} ms", flush=True)


if __name__ == "__main__":
    main()
