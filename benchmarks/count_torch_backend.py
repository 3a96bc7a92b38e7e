"""Count what ``backend="torch"``'s CUDA route and plain PyTorch dispatch per loss step, and predict H200 times.

    PYTHONPATH=. python benchmarks/count_torch_backend.py            # both paths, bf16, the bench's shapes scaled down
    PYTHONPATH=. python benchmarks/count_torch_backend.py --no-half-softmax   # no CUDA softmax reads bf16 into fp32

The CUDA route of the torch backend is forced on CPU tensors (``_accelerated`` patched here, in this script
only). Two features that CUDA has and the CPU lacks are emulated: ``aten::_softmax(bf16, half_to_float=True)``
(one pass from bf16 rows to fp32; whether the installed CUDA PyTorch has it for bf16 is probed at run time by the
backend, so both cases are reported) and ``mm`` / ``addmm`` with ``out_dtype=float32`` (one GEMM from bf16
operands into fp32). Each emulated op is computed in fp32 and counted as the one op CUDA runs.

Per op (a ``TorchDispatchMode``): the op (about one kernel launch on CUDA; views and host scalars left out), the
bytes it reads and writes (the inputs' and outputs' accessed extents; an in-place op's tensor counted read and
written; ``out=`` written only; ``gather`` / ``scatter_add_`` / ``index_select`` / ``index_copy_`` by the
elements they touch; ``zero_`` / ``fill_`` / ``copy_``'s destination written only), the FLOPs of GEMMs (2mnk),
and host reads (``_local_scalar_dense`` = ``.item()`` / ``bool()``, ``nonzero``, ``masked_select``, ``equal``,
``is_nonzero``, and the backend's ``_to_host``). A PyTorch softmax / log_softmax kernel over rows longer than its
shared memory (V = 151936 fp32 or bf16) reads its input three times (max, sum, then the write pass), and the
backward of ``log_softmax`` reads the incoming gradient twice: the counts charge those extra reads
("kernel passes"); the "logical" bytes do not.

Prediction for one H200 (PREDICTED, not measured): ``bytes / 4.2 TB/s + FLOPs / 700 TFLOP/s + launches x 5 us``
(the launches term only matters where the host is behind the device; each row also gives the time without it).
"""

from __future__ import annotations

import argparse
import math
from collections import Counter as Tally
from contextlib import contextmanager
from typing import Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import gspo_kernels as gk
from gspo_kernels.backends.torch import linear as tb_linear
from gspo_kernels.backends.torch import logits as tb_logits
from gspo_kernels.backends.torch import rows as tb_rows
from gspo_kernels.tools.bench_gpu import gspo_formula

BANDWIDTH = 4.2e12  # B/s, the H200's measured device-to-device copy rate
GEMM_RATE = 700e12  # FLOP/s, cuBLAS bf16 on an H200 (700-780 measured)
LAUNCH_S = 5e-6

NOT_KERNELS = {"slice", "select", "view", "unsqueeze", "squeeze", "detach", "as_strided", "alias", "expand", "t",
               "split", "split_with_sizes", "scalar_tensor", "empty", "empty_like", "lift_fresh", "_unsafe_view",
               "reshape", "transpose", "permute", "_reshape_alias", "unbind", "empty_strided", "new_empty",
               "resize_", "set_", "_to_copy_noop", "view_as", "expand_as", "unfold", "diagonal", "narrow", "clone_noop"}
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "nonzero_static", "item"}
WRITE_ONLY = {"zero_", "fill_", "copy_", "normal_", "uniform_", "random_"}


def _extent(t: torch.Tensor) -> int:
    """Bytes ``t`` spans as a view: ``(1 + sum (size - 1) * stride)`` elements, at most its numel."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return min(span, t.numel()) * t.element_size()


class OpCounter(TorchDispatchMode):
    """Records ``(name, bytes, extra_bytes, flops)`` of each aten op; ``emulate`` computes CUDA-only overloads."""

    def __init__(self, emulate: bool = True) -> None:
        super().__init__()
        self.ops: List[tuple] = []
        self.paused = 0
        self.emulate = emulate
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        overload = func._overloadname
        out = self._run(func, name, overload, args, kwargs)
        if not self.paused:
            self.ops.append(self._cost(name, overload, args, kwargs, out))
        return out

    def _run(self, func, name, overload, args, kwargs):
        if self.emulate and name == "_softmax" and args[2] and args[0].dtype in (torch.bfloat16, torch.float16):
            res = torch.softmax(args[0].float(), args[1])
            if "out" in kwargs:
                return kwargs["out"].copy_(res)
            return res
        if self.emulate and name in ("mm", "addmm") and overload in ("dtype", "dtype_out"):
            dt = args[-1] if not isinstance(args[-1], torch.Tensor) else kwargs.get("out_dtype")
            tensors = [a.to(dt) if isinstance(a, torch.Tensor) else a for a in args if not isinstance(a, torch.dtype)]
            res = torch.mm(*tensors) if name == "mm" else torch.addmm(*tensors[:3])
            if "out" in kwargs:
                return kwargs["out"].copy_(res)
            return res
        return func(*args, **kwargs)

    def _cost(self, name, overload, args, kwargs, out):
        ins = [t for t in tree_flatten((args, {k: v for k, v in kwargs.items() if k != "out"}))[0]
               if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        flops = 0
        if name in HOST_READS:
            self.host_reads += 1
        if name in ("gather", "index_select"):  # reads the picked elements and the index, writes the output
            picked = sum(t.numel() for t in outs) * ins[0].element_size()
            nbytes = picked + sum(_extent(t) for t in ins[1:]) + sum(_extent(t) for t in outs)
        elif name in ("scatter_add_", "scatter_add", "scatter_", "scatter", "index_copy_", "index_copy"):  # src.s count, r+w
            src = ins[-1]
            nbytes = 2 * src.numel() * ins[0].element_size() + sum(_extent(t) for t in ins[1:])
        elif name in WRITE_ONLY:
            nbytes = _extent(ins[0]) + (sum(_extent(t) for t in ins[1:]) if name == "copy_" else 0)
        else:
            nbytes = sum(_extent(t) for t in ins) + sum(_extent(t) for t in outs)
        if name in ("_softmax", "_log_softmax", "softmax", "log_softmax"):  # max pass and sum pass before the write pass
            extra = 2 * _extent(ins[0])
        elif name == "_softmax_backward_data":  # sum(grad * out), then the write pass
            extra = _extent(ins[0]) + _extent(ins[1])
        elif name == "_log_softmax_backward_data":  # sum(grad), then the write pass
            extra = _extent(ins[0])
        else:
            extra = 0
        gemm = None
        if name in ("mm", "addmm", "addmm_"):
            a, b = (ins[-2], ins[-1]) if name != "mm" else (ins[0], ins[1])
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[-1]
            c = outs[0]
            gemm = dict(dims=(a.shape[0], a.shape[1], b.shape[1]), sizes=(a.element_size(), b.element_size(),
                        c.element_size()), reads_c=name != "mm")
        return name, nbytes, extra, flops, gemm


def kernel_ops(ops) -> List[tuple]:
    return [op for op in ops if op[0] not in NOT_KERNELS and op[0] not in HOST_READS]


@contextmanager
def cuda_route(half_softmax: bool, mm_fp32: bool, counter: OpCounter, budget: int):
    """The torch backend's CUDA route on CPU tensors: ``_accelerated`` True, the CUDA probes' answers set, host-side
    planning (``_row_plan``, ``_active_index``) left out of the counts and its ``_to_host`` calls counted."""
    modules = (tb_rows, tb_logits, tb_linear)  # a name from rows.py is looked up in each module that calls it
    saved = {(m, name): getattr(m, name) for m in modules for name in
             ("_accelerated", "_to_host", "_row_plan", "_active_index", "ACCELERATOR_BUDGET") if hasattr(m, name)}
    half, mm = dict(tb_rows._half_softmax_ok), dict(tb_linear._mm_fp32_out_ok)

    def put(name, value):
        for m in modules:
            if hasattr(m, name):
                setattr(m, name, value)

    put("_accelerated", lambda device: True)
    put("ACCELERATOR_BUDGET", budget)
    for dt in (torch.bfloat16, torch.float16):
        tb_rows._half_softmax_ok[("cpu", dt)] = half_softmax
        tb_linear._mm_fp32_out_ok[("cpu", dt)] = mm_fp32
    original_to_host = tb_rows._to_host

    def to_host(mask):
        counter.host_reads += 1
        return original_to_host(mask)

    def paused(fn):
        def run(*a, **k):
            counter.paused += 1
            try:
                return fn(*a, **k)
            finally:
                counter.paused -= 1
        return run

    put("_to_host", to_host)
    put("_row_plan", paused(tb_logits._row_plan))
    put("_active_index", paused(tb_linear._active_index))
    try:
        yield
    finally:
        for (m, name), value in saved.items():
            setattr(m, name, value)
        tb_rows._half_softmax_ok.clear()
        tb_rows._half_softmax_ok.update(half)
        tb_linear._mm_fp32_out_ok.clear()
        tb_linear._mm_fp32_out_ok.update(mm)


def summarize(counter: OpCounter, logits: int) -> Dict:
    """Totals of the kernel ops: bytes (logical, and with the softmax kernels' repeated reads) per logit, FLOPs, and
    the GEMMs' bytes apart (a GEMM takes the longer of its FLOPs and its bytes: :func:`predict_ms`)."""
    ks = kernel_ops(counter.ops)
    logical = sum(op[1] for op in ks)
    passes = logical + sum(op[2] for op in ks)
    gemm = [op for op in ks if op[3]]
    return dict(gemms=[op[4] for op in gemm], launches=len(ks), host_reads=counter.host_reads, bytes_per_logit=logical / logits,
                kernel_bytes_per_logit=passes / logits, flops=sum(op[3] for op in ks),
                gemm_bytes=[op[1] for op in gemm], gemm_flops=[op[3] for op in gemm],
                other_bytes_per_logit=(passes - sum(op[1] for op in gemm)) / logits,
                by_op=Tally(op[0] for op in ks))


def predict_ms(s: Dict, real_logits: float, real_launches: float, gemm_scale=(1.0, 1.0)) -> float:
    """PREDICTED H200 ms: the non-GEMM ops' bytes at the copy rate, each GEMM at the longer of its FLOPs at the cuBLAS
    rate and its bytes at the copy rate (``gemm_scale``: (bytes, FLOPs) factors to the real shape), plus launches."""
    gemms = sum(max(b * gemm_scale[0] / BANDWIDTH, f * gemm_scale[1] / GEMM_RATE)
                for b, f in zip(s["gemm_bytes"], s["gemm_flops"]))
    return 1e3 * (s["other_bytes_per_logit"] * real_logits / BANDWIDTH + gemms + real_launches * LAUNCH_S)


# --- the logits path: bench --gpu's torch-backend case, bf16 [B, T + 1, V] ------------------------------------


def logits_inputs(B: int, T: int, V: int):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(B, T + 1, V, generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen)
    adv = torch.randn(B, generator=gen)
    mask = torch.ones(B, T)
    with torch.no_grad():
        old = gk.token_logprobs(logits.detach()[:, :-1], labels, backend="torch").float()
    return logits, labels, adv, old, mask


def count_logits(B: int, T: int, V: int, chunks_per_response: int, half_softmax: bool, ours: bool) -> Dict:
    logits, labels, adv, old, mask = logits_inputs(B, T, V)
    counter = OpCounter()
    rows = -(-T // chunks_per_response)
    tiles = 3  # 2 scratch blocks + the active mask's block
    budget = rows * tiles * V * 4
    if ours:
        with cuda_route(half_softmax, True, counter, budget):
            with counter:
                loss = gk.gspo_loss(logits[:, :-1], labels, adv, old, mask=mask, backend="torch").loss
                loss.backward()
    else:
        with counter:
            logp = logits[:, :-1].float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
            loss = gspo_formula(logp, old, adv, mask)
            loss.backward()
    return summarize(counter, B * T * V)


# --- the hidden path: N rows, H, V, bf16 -----------------------------------------------------------------------


def count_hidden(B: int, T: int, H: int, V: int, chunks: int, half_softmax: bool, mm_fp32: bool, ours: bool) -> Dict:
    gen = torch.Generator().manual_seed(2)
    hidden = (torch.randn(B, T, H, generator=gen) * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * H**-0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen)
    adv = torch.randn(B, generator=gen)
    mask = torch.ones(B, T)
    with torch.no_grad():
        old = gk.linear_logprobs(hidden, weight, labels, backend="torch").float()
    counter = OpCounter()
    n = B * T
    rows = -(-n // chunks)
    if ours:
        with cuda_route(half_softmax, mm_fp32, counter, None):
            with counter:
                loss = gk.fused_linear_gspo_loss(hidden, weight, labels, adv, old, mask=mask, backend="torch",
                                                 memory_budget=rows * 2 * V * 4).loss
                loss.backward()
    else:
        with counter:
            logp = (hidden @ weight.t()).float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
            loss = gspo_formula(logp, old, adv, mask)
            loss.backward()
    return summarize(counter, n * V)


def gemm_ms(gemms, scale_dim) -> float:
    """PREDICTED ms of GEMMs: each the longer of its FLOPs at the cuBLAS rate and its operands' and output's bytes
    (the output read too when accumulated) at the copy rate, dimensions mapped to the real shape by ``scale_dim``."""
    total = 0.0
    for g in gemms:
        m, k, n = (scale_dim(d) for d in g["dims"])
        ia, ib, ic = g["sizes"]
        nbytes = m * k * ia + k * n * ib + m * n * ic * (2 if g["reads_c"] else 1)
        total += max(2 * m * k * n / GEMM_RATE, nbytes / BANDWIDTH)
    return 1e3 * total


def _row(label: str, s: Dict, ms: float) -> str:
    return (f"{label:44} launches {s['launches']:5d}  host reads {s['host_reads']:2d}  "
            f"B/logit {s['bytes_per_logit']:6.1f} logical, {s['kernel_bytes_per_logit']:6.1f} kernel passes  "
            f"GFLOP {s['flops'] / 1e9:8.2f}  PREDICTED H200 {ms:6.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-half-softmax", action="store_true", help="CUDA's softmax does not read bf16 rows itself")
    ap.add_argument("--ops", action="store_true", help="print the kernel ops of each run")
    a = ap.parse_args()
    half = not a.no_half_softmax
    torch.set_num_threads(max(1, torch.get_num_threads()))

    # logits path: bench shape [8, 1025, 151936]; 1 GiB / (3 tiles x V x 4 B) = 589 rows: 2 chunks per response
    V = 151936
    B, T, real = 2, 64, dict(B=8, T=1024)
    real_logits = real["B"] * real["T"] * V
    res = {}
    for ours in (True, False):
        s2 = count_logits(B, T, V, 2, half, ours)
        s4 = count_logits(B, T, V, 4, half, ours)
        per_chunk = (s4["launches"] - s2["launches"]) / (B * 2)
        fixed = s2["launches"] - per_chunk * B * 2
        real_launches = fixed + per_chunk * real["B"] * 2
        ms = predict_ms(s2, real_logits, real_launches)
        bound = predict_ms(s2, real_logits, 0)
        label = "ours backend='torch' (CUDA route)" if ours else "plain PyTorch"
        print(_row(f"logits {label}", s2, ms) + f" ({bound:.2f} without launches)  [{per_chunk:.1f} launches/chunk, "
              f"{fixed:.0f} per call; {real_launches:.0f} at the bench shape]")
        if a.ops:
            print("   ", dict(s2["by_op"]))
        res[ours] = ms
    print(f"logits path PREDICTED ratio ours / plain: {res[True] / res[False]:.2f}  (measured last session: 1.61)")

    # hidden path: bench shape N = 4096, H = 4096, V = 151936; 1 GiB / (2 tiles x V x 4 B) = 883 rows: 5 chunks
    n, h = 160, 96
    realN, realH = 4096, 4096
    chunks = -(-realN // tb_linear._linear_rows(realN, V, torch.float32, 2, None))
    res = {}
    for ours in (True, False):
        s = count_hidden(2, n // 2, h, V, chunks, half, True, ours)
        s_h = count_hidden(2, n // 2, 2 * h, V, chunks, half, True, ours)
        # non-GEMM bytes: a per-logit part (N*V) and a per-weight part (V*H), separated by doubling H
        w_bytes = (s_h["other_bytes_per_logit"] - s["other_bytes_per_logit"]) * n * V  # V*h bytes more
        per_logit = s["other_bytes_per_logit"] - w_bytes / (n * V)
        per_weight = w_bytes / (V * h)
        flops = s["flops"] * (realN * realH) / (n * h)

        def scale_dim(d):
            return d if d == V else realH if d == h else d * realN / n

        ms = 1e3 * ((per_logit * realN * V + per_weight * V * realH) / BANDWIDTH + s["launches"] * LAUNCH_S)
        ms += gemm_ms(s["gemms"], scale_dim)
        label = "ours backend='torch' (CUDA route)" if ours else "plain PyTorch"
        print(f"hidden {label:37} launches {s['launches']:5d}  host reads {s['host_reads']:2d}  "
              f"non-GEMM B/logit {per_logit:5.1f} + {per_weight:5.1f} B per weight element  "
              f"GEMMs {len(s['gemms']):2d} {gemm_ms(s['gemms'], scale_dim):5.1f} ms  "
              f"FLOP {flops / (realN * realH * V):.1f} NHV  PREDICTED H200 {ms:6.2f} ms "
              f"({ms - s['launches'] * LAUNCH_S * 1e3:.2f} without launches)")
        if a.ops:
            print("   ", dict(s["by_op"]))
        res[ours] = ms
    print(f"hidden path PREDICTED ratio ours / plain: {res[True] / res[False]:.2f}  (measured last session: 1.63)")
    print(f"(model: non-GEMM bytes / {BANDWIDTH / 1e12:.1f} TB/s + each GEMM max(FLOPs / {GEMM_RATE / 1e12:.0f} TFLOP/s, "
          f"bytes / {BANDWIDTH / 1e12:.1f} TB/s) + launches x {LAUNCH_S * 1e6:.0f} us; softmax kernels' repeated reads of "
          "rows longer than shared memory included)")
    assert math.isfinite(res[True])


if __name__ == "__main__":
    main()
