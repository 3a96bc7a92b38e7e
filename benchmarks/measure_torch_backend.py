"""Peak memory and fwd/bwd time of backend="torch" vs the float64 reference, hidden-state input.

    python benchmarks/measure_torch_backend.py torch none      # all responses carry gradient
    python benchmarks/measure_torch_backend.py torch half      # responses 2 and 3 of 4 clipped
    python benchmarks/measure_torch_backend.py reference none

N = 1024 tokens (4 x 256), H = 896, V = 151936, fp32, on the CPU. One process per measurement:
"peak extra" is the process's peak RSS after the step minus its peak RSS before it (inputs
already allocated), so it includes the weight gradient (V*H*4 = 0.54 GB) and dH.
"""

import resource
import sys
import time

import torch

import gspo_kernels as gk
from gspo_kernels import reference


def main(impl: str, clip: str) -> None:
    torch.manual_seed(0)
    N, H, V, S = 1024, 896, 151936, 4
    hidden = torch.randn(S, N // S, H) * 0.5
    weight = torch.randn(V, H) * 0.02
    labels = torch.randint(0, V, (S, N // S))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    with torch.no_grad():
        current = gk.linear_logprobs(hidden, weight, labels, backend="torch")
    # a shift of 1e-2 in the mean log-ratio puts w far outside the 3e-4 / 4e-4 band
    shift = torch.tensor([0.0, 0.0, 1e-2, -1e-2]) if clip == "half" else torch.zeros(S)
    old = current - shift[:, None]
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if impl == "reference":
        out = reference.fused_linear_gspo_loss(h, w, labels, adv, old)
    else:
        out = gk.fused_linear_gspo_loss(h, w, labels, adv, old, backend=impl)
    t1 = time.perf_counter()
    out.loss.backward()
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{impl:9} clipped={clip:4} fwd {t1 - t0:.2f} s  bwd {t2 - t1:.2f} s  "
          f"peak extra {(peak - base) / 1024**2:.2f} GiB  clip_ratio {out.metrics['clip_ratio/region_mean'].item():.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "torch", sys.argv[2] if len(sys.argv) > 2 else "none")
