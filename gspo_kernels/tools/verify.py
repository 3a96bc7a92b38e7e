"""``gspo-kernels verify``: every available backend against the float64 reference.

For each backend x path (``logits``: ``gspo_loss``; ``linear``: ``fused_linear_gspo_loss``, one pass on the Triton
backend; ``two-pass``: ``linear_logprobs`` with autograd then ``policy_loss``, the TRL drop-in's and verl's head, at a
vocabulary and budget that make its backward run over several vocabulary slices) x importance level x loss type x
dtype (fp32, bf16),
on fresh random inputs: the loss, the metrics and the input gradients are compared with
:mod:`gspo_kernels.reference` run in float64 on the same (dtype-rounded) values.

Tolerances (gradients relative to their largest reference entry; the loss, a sum of terms of either
sign, relative to ``max(|loss|, 1)``; metrics absolute):

* fp32: 1e-5 for the loss, the metrics and the gradients;
* bf16: the math runs in fp32 (products accumulated in fp32, log-probs fp32), so the loss and the
  metrics keep the fp32 tolerance; a gradient comes back in bf16, so it may differ by the fp32
  tolerance plus its roundings to bf16: one on the logits path (the output), two on the hidden-state
  paths (the logits gradient rounded to the bf16 operand of the backward matmuls, then the output);
  ``backend="torch"`` on CUDA rounds a bf16 logits gradient's entries off the label column twice (``p``, then
  the product: :func:`gspo_kernels.backends.torch.logits.logits_gradient_roundings`).
  One rounding is 2^-8 relative (round to nearest even; the Triton interpreter's fp32 -> bf16 cast,
  which truncates, is made to round as the GPU does: :func:`gspo_kernels.testing.setup_triton_interpreter`). No tolerance
  exceeds 2^-6: a 5% gradient error fails.

The plain bf16 PyTorch path is never the bar: its GSPO gradient is wrong by ~100% (a bf16 log-prob
has 3 significant digits, the clip band is 3e-4 wide).
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List

from gspo_kernels.config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES
from gspo_kernels.testing import FP32_RTOL, gradient_tolerance, rel_err, setup_triton_interpreter
from gspo_kernels.tools.table import Column, text_header, text_row

if TYPE_CHECKING:
    import torch

@dataclass
class Row:
    backend: str
    path: str
    level: str
    loss_type: str
    dtype: str
    layout: str
    loss_err: float
    grad_err: float
    metric_err: float
    loss_tol: float
    grad_tol: float
    metric_tol: float
    seconds: float

    @property
    def ok(self) -> bool:
        return self.loss_err <= self.loss_tol and self.grad_err <= self.grad_tol and self.metric_err <= self.metric_tol


def _loss_err(loss, expected) -> float:
    return float((loss.detach().double() - expected.detach()).abs() / expected.detach().abs().clamp(min=1.0))


def log_weight_offsets(n: int, gen) -> "torch.Tensor":
    """``n`` float64 log-weights (``log w = logp - old``), half well inside the default clip band and half
    well outside it, each at least 5e-5 from its edges (``log(1 - 3e-4)``, ``log(1 + 4e-4)``).

    A log-weight within ~1e-6 of an edge (the fp32 rounding of a log-prob near 7) would clip in the float64
    oracle and not in fp32, or the reverse: a discontinuous difference (that response's whole gradient) which
    no tolerance should absorb. Offsets drawn as ``3e-4 * randn`` put one there in one of about ten ``verify``
    runs (a gradient error of 0.77 and a clip-ratio error of 0.056 at seed 64396)."""
    import torch

    inside = torch.rand(n, generator=gen, dtype=torch.float64) * 2.5e-4  # |log w| <= 2.5e-4 < 3.0e-4
    outside = 5e-4 + torch.rand(n, generator=gen, dtype=torch.float64) * 5e-4  # |log w| >= 5e-4 > 4.0e-4
    pick = torch.rand(n, generator=gen) < 0.5
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return sign * torch.where(pick, inside, outside)


def check_case(backend: str, path: str, level: str, loss_type: str, dtype_name: str, *, seed: int,
               B: int = 4, T: int = 10, V: int = 1000, H: int = 48) -> Row:
    """One comparison; returns the errors and the tolerances they are held to."""
    import torch

    import gspo_kernels as gk
    from gspo_kernels import reference

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(seed)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    packed = loss_type in ("bnpo", "dapo")
    cfg = gk.GSPOConfig(importance_sampling_level=level, loss_type=loss_type, max_completion_length=T,
                        beta=0.04 if loss_type in ("grpo", "dapo") else 0.0,
                        entropy_coef=0.01 if loss_type == "bnpo" else 0.0)

    lengths = [T, 1, 0] + [T - 3] * (B - 3)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()
    labels = torch.randint(0, V, (B, T), generator=gen)
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    # two-pass: a vocabulary wider than its backward's narrowest slice (2048 columns), with a budget that makes
    # the slices that narrow: several slices, a ragged last one, a forward in several chunks (the sliced backward
    # is the one taken: V >= 4 B T)
    budget = None
    if path == "two-pass":
        V = max(V, 5000)
        budget = B * T * 2048 * 6
    if path == "logits":
        inputs = [(torch.randn(B, T, V, generator=gen) * 3).to(dtype)]
        as_logits = lambda xs: xs[0]  # noqa: E731
    else:
        inputs = [torch.randn(B, T, H, generator=gen).to(dtype), (torch.randn(V, H, generator=gen) * 0.3).to(dtype)]
        as_logits = lambda xs: xs[0] @ xs[1].T  # noqa: E731
    base = [x.double() for x in inputs]
    current = reference.token_logprobs(as_logits(base), labels)
    old = (current - log_weight_offsets(B, gen)[:, None]).float()
    # Reference log-probs 0.3 apart from the policy's: the KL gradient (1 - e^d) is then well above the
    # fp32 rounding of logp (|logp| ~ 7 here, an ulp of 5e-7), which sets the floor of its relative error.
    ref_lp = (current + 0.3 * torch.randn(B, T, generator=gen).double()).float()
    adv = torch.randn(B, generator=gen)
    kw: Dict = dict(ref_logprobs=ref_lp if cfg.beta > 0 else None)
    if packed:  # the same tokens as one packed stream
        keep = mask.reshape(-1) > 0
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        labels = labels.reshape(-1)[keep]
        old, kw["ref_logprobs"] = old.reshape(-1)[keep], ref_lp.reshape(-1)[keep] if cfg.beta > 0 else None
        inputs = [inputs[0].reshape(-1, inputs[0].shape[-1])[keep]] + inputs[1:]
        base = [x.double() for x in inputs]
        kw.update(cu_seqlens=cu)
    else:
        kw.update(mask=mask)

    def run(fn, xs):
        leaves = [x.clone().requires_grad_() for x in xs]
        out = fn(leaves)
        grads = torch.autograd.grad(out.loss, leaves)
        return out, grads

    def ours(xs):
        xs = [x.to(device) for x in xs]
        dev_kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        args = (labels.to(device), adv.to(device), old.to(device))
        if path == "logits":
            return gk.gspo_loss(xs[0], *args, config=cfg, backend=backend, **dev_kw)
        if path == "two-pass":  # the TRL drop-in's and verl's head: log-probs with autograd, then the stage
            logp, entropy = gk.linear_logprobs(xs[0], xs[1], args[0], backend=backend, return_entropy=True,
                                               temperature=cfg.temperature, memory_budget=budget)
            return gk.policy_loss(logp, *args[1:], entropy=entropy, config=cfg, backend=backend, **dev_kw)
        return gk.fused_linear_gspo_loss(xs[0], xs[1], *args, config=cfg, backend=backend, **dev_kw)

    def oracle(xs):
        return reference.gspo_loss(as_logits(xs), labels, adv, old, config=cfg, **kw)

    start = time.perf_counter()
    out, grads = run(ours, inputs)
    seconds = time.perf_counter() - start
    expected, ref_grads = run(oracle, base)
    loss_err = _loss_err(out.loss.cpu(), expected.loss)
    grad_err = max(rel_err(g.cpu(), r) for g, r in zip(grads, ref_grads))
    metric_err = max(abs(float(out.metrics[k]) - float(v)) for k, v in expected.metrics.items())
    grad_tol = gradient_tolerance(dtype_name, "linear" if path == "two-pass" else path, backend=backend, device=device)
    return Row(backend=backend, path=path, level=level, loss_type=loss_type, dtype=dtype_name,
               layout="packed" if packed else "padded", loss_err=loss_err, grad_err=grad_err, metric_err=metric_err,
               loss_tol=FP32_RTOL, grad_tol=grad_tol, metric_tol=FP32_RTOL, seconds=seconds)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", nargs="*", default=None, help="backends to check (default: all available)")
    parser.add_argument("--paths", nargs="*", default=list(PATHS), choices=PATHS,
                        help="logits: gspo_loss; linear: fused_linear_gspo_loss (one pass on triton); two-pass: "
                             "linear_logprobs with autograd, then policy_loss (the TRL drop-in's and verl's head)")
    parser.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                        help="input dtypes to check (default: fp32 bf16)")
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh seed, printed")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke subset in seconds: per backend, path and dtype, GSPO (sequence level) with "
                             "one padded (grpo) and one packed (dapo) aggregation; same tolerances")


PATHS = ("logits", "linear", "two-pass")
# --quick: the GSPO level, one aggregation of each layout (grpo: padded, with KL; dapo: packed, with KL).
QUICK_LEVELS = ("sequence",)
QUICK_LOSS_TYPES = ("grpo", "dapo")


COLUMNS = (Column("backend", 8, "<"), Column("path", 8, "<"), Column("level", 14, "<"), Column("loss", 8, "<"),
           Column("dtype", 5, "<"), Column("layout", 6, "<"), Column("loss err", 9, spec=".2e"),
           Column("tol", 8, spec=".1e"), Column("grad err", 9, spec=".2e"), Column("tol", 8, spec=".1e"),
           Column("metric", 8, spec=".1e"), Column("s", 6, spec=".2f"))


def run(args: argparse.Namespace) -> int:
    where = setup_triton_interpreter()
    import torch

    from gspo_kernels import backends

    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"gspo-kernels verify: device {where}; torch {torch.__version__}; seed {seed}")
    names = args.backends or backends.available(device)
    for name in backends.BACKENDS:
        if name not in names:
            reason = backends.unavailable_reason(name) or f"does not run on {device.type}"
            print(f"  backend {name!r} not checked: {reason}")
    rows: List[Row] = []
    quick = getattr(args, "quick", False)
    levels, loss_types = (QUICK_LEVELS, QUICK_LOSS_TYPES) if quick else (IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES)
    cases = list(itertools.product(names, args.paths, levels, loss_types, args.dtypes))
    print(text_header(COLUMNS, tail="result"))
    for i, (name, path, level, loss_type, dtype) in enumerate(cases):
        row = check_case(name, path, level, loss_type, dtype, seed=seed + i)
        rows.append(row)
        print(text_row(COLUMNS, [row.backend, row.path, row.level, row.loss_type, row.dtype, row.layout, row.loss_err,
                                 row.loss_tol, row.grad_err, row.grad_tol, row.metric_err, row.seconds],
                       tail="pass" if row.ok else "FAIL"), flush=True)
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
