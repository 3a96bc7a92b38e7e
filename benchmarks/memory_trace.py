"""A device-agnostic memory accountant: the bytes of tensor storages alive above a start point, their peak,
and what was alive at the peak (shape, dtype, bytes, the op and the Python lines that made it).

    with MemoryTrace() as trace:          # the start point: storages that exist now are not counted
        loss = step(); loss.backward()
    print(trace.peak_bytes, trace.report())

How it counts. A ``TorchDispatchMode`` sees every op torch's dispatcher runs while it is active (factory
functions such as ``empty`` / ``zeros`` included, and the ops the autograd engine runs in the backward on
this thread, ``AccumulateGrad``'s among them). Each tensor an op returns is looked up by its *storage*
(``untyped_storage()``): a storage seen before (a view, an in-place op's result, an ``out=`` tensor) adds
nothing; a new one adds its ``nbytes`` and gets a ``weakref.finalize`` that subtracts them when torch frees
the storage. So the count is the sum of the distinct live storages allocated since the start, what
``torch.cuda.memory_allocated()`` minus its start value reports on a GPU up to the caching allocator's
rounding (blocks of 512 bytes) and the storages freed during the trace that existed before it (``adopt``
counts those: their frees are subtracted). Storages made outside the dispatcher (``torch.from_numpy``, a C
extension writing its own) are invisible; ``track(tensor, label)`` adds one by hand.

At every new peak the live records are copied (``peak_live``), each a :class:`Record`: ``bytes``,
``shape`` / ``dtype`` of the first tensor seen on the storage, ``op`` (the aten op), ``where`` (the last
``stack_depth`` Python frames outside torch and this file, innermost last) and ``seq`` (allocation order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
import weakref
from collections import defaultdict
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS = os.path.abspath(__file__)


@dataclasses.dataclass(frozen=True)
class Record:
    """One storage allocated since the start: its bytes and who made it."""

    bytes: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    op: str
    where: Tuple[str, ...]
    seq: int

    def line(self) -> str:
        where = " <- ".join(reversed(self.where)) if self.where else "?"
        return f"{self.bytes:>14,d}  {str(tuple(self.shape)):<22} {str(self.dtype):<15} {self.op:<28} {where}"


class MemoryTrace(TorchDispatchMode):
    """Live storage bytes allocated since ``__enter__`` (``current``), their ``peak_bytes`` and ``peak_live``.

    Args:
        stack_depth: Python frames kept per record (0: none, the fastest).
        skip_dirs: frames from files under these directories are left out of ``where`` (default: torch's own
            package, so the frames shown are the caller's and the library's).
    """

    def __init__(self, stack_depth: int = 4, skip_dirs: Iterable[str] = (_TORCH_DIR,)):
        super().__init__()
        if not isinstance(stack_depth, int) or isinstance(stack_depth, bool) or stack_depth < 0:
            raise ValueError(f"stack_depth must be an int >= 0, got {stack_depth!r}")
        self.stack_depth = stack_depth
        self.skip_dirs = tuple(os.path.abspath(d) for d in skip_dirs)
        self.live: Dict[int, Record] = {}
        self.current = 0
        self.peak_bytes = 0
        self.peak_live: Dict[int, Record] = {}
        self.peak_seq = 0
        self.allocated = 0  # bytes of every storage counted, freed or not
        self._seq = 0
        self._adopted: Dict[int, int] = {}
        self._finalizers: List[weakref.finalize] = []
        self._active = False
        self._paused = 0
        self.uncounted: Dict[int, int] = {}  # storages made while paused and still alive: key -> bytes

    # -- the start and the end -------------------------------------------------------------------------------
    def __enter__(self):
        if self._active:
            raise RuntimeError("MemoryTrace is already active; use a new one per trace")
        self._active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self._active = False
        return super().__exit__(*exc)

    # -- counting --------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.set_:
            return out  # points a tensor at a storage that exists (the Triton interpreter's argument copies)
        # an output on an input's storage (a view, an in-place or out= result) is no new storage, even when
        # that storage predates the start (a view of a parameter)
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (t.device.type == "meta" or t.untyped_storage()._cdata not in inputs):
                self._count(t, str(func.overloadpacket.__name__))
        return out

    def track(self, tensor: torch.Tensor, label: str) -> None:
        """Count ``tensor``'s storage (made outside the dispatcher) as allocated now, labelled ``label``."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"track needs a tensor, got {type(tensor).__name__}")
        self._count(tensor, label)

    def adopt(self, *tensors: torch.Tensor) -> None:
        """Storages that existed before the start whose frees during the trace count (subtracted from
        ``current``, as a GPU allocator's count goes down when they are freed)."""
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.live or key in self._adopted or storage.nbytes() == 0:
                continue
            self._adopted[key] = storage.nbytes()
            self._finalizers.append(weakref.finalize(storage, self._free_adopted, key))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Storages made inside are not counted (a CPU stand-in's temporaries for what a GPU does in place);
        those still alive are in ``uncounted`` (so that a caller can check the pause hid nothing that stays)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _count(self, t: torch.Tensor, op: str) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = storage._cdata
        if nbytes == 0 or key in self.live or key in self._adopted or key in self.uncounted:
            return
        if self._paused:
            self.uncounted[key] = nbytes
            self._finalizers.append(weakref.finalize(storage, self.uncounted.pop, key, None))
            return
        self._seq += 1
        self.live[key] = Record(nbytes, tuple(t.shape), t.dtype, op, self._where(), self._seq)
        self._finalizers.append(weakref.finalize(storage, self._free, key))
        self.current += nbytes
        self.allocated += nbytes
        if self.current > self.peak_bytes:
            self.peak_bytes = self.current
            self.peak_live = dict(self.live)
            self.peak_seq = self._seq

    def _free(self, key: int) -> None:
        record = self.live.pop(key, None)
        if record is not None:
            self.current -= record.bytes

    def _free_adopted(self, key: int) -> None:
        nbytes = self._adopted.pop(key, None)
        if nbytes is not None:
            self.current -= nbytes

    def _where(self) -> Tuple[str, ...]:
        if not self.stack_depth:
            return ()
        frames = []
        for frame in reversed(traceback.extract_stack(limit=40)):
            path = os.path.abspath(frame.filename)
            if path == _THIS or path.startswith(self.skip_dirs):
                continue
            frames.append(f"{os.path.basename(path)}:{frame.lineno} {frame.name}")
            if len(frames) == self.stack_depth:
                break
        return tuple(reversed(frames))

    # -- reading ---------------------------------------------------------------------------------------------
    def at_peak(self, min_bytes: int = 0) -> List[Record]:
        """The records alive at the peak, largest first (those of at least ``min_bytes``)."""
        return sorted((r for r in self.peak_live.values() if r.bytes >= min_bytes), key=lambda r: (-r.bytes, r.seq))

    def grouped(self, key=lambda r: (r.op, r.where[-1] if r.where else "?", r.dtype)) -> Dict[tuple, Tuple[int, int]]:
        """``{key(record): (count, bytes)}`` over the records alive at the peak."""
        out: Dict[tuple, List[int]] = defaultdict(lambda: [0, 0])
        for r in self.peak_live.values():
            out[key(r)][0] += 1
            out[key(r)][1] += r.bytes
        return {k: (c, b) for k, (c, b) in out.items()}

    def report(self, min_bytes: int = 1 << 16, title: Optional[str] = None) -> str:
        """A table of the peak: its bytes, then each live record of at least ``min_bytes``, then the rest summed."""
        rows = self.at_peak()
        big = [r for r in rows if r.bytes >= min_bytes]
        rest = sum(r.bytes for r in rows if r.bytes < min_bytes)
        lines = [] if title is None else [title]
        lines.append(f"peak {self.peak_bytes:,d} bytes ({self.peak_bytes / 2**20:.2f} MiB) above the start, "
                     f"{len(rows)} storages alive at it (allocation #{self.peak_seq})")
        lines += [r.line() for r in big]
        lines.append(f"{rest:>14,d}  ({len(rows) - len(big)} storages under {min_bytes:,d} bytes)")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The TRL loss step, stock against the drop-in, on CPU tensors (python benchmarks/memory_trace.py --help)
# ---------------------------------------------------------------------------------------------------------------

# The reduced shape's memory budgets: the client shape's on CUDA scaled as their rows x V (1/64): the one-pass
# route's 1 GiB (ONE_PASS_MEMORY_BUDGET), and the row-chunked two-pass backward's buffers (512 fp32 logits rows +
# 2048 bf16 dZ rows at V = 151936, 0.93 GB -> 64 + 256 rows), for a run that asks for that route's sizes.
SMALL_BUDGETS = {"two-pass": 64 * 18992 * 4 + 256 * 18992 * 2, "one-pass": (1 << 30) // 64}


@contextlib.contextmanager
def client_defaults_scaled(factor: int = 8) -> Iterator[None]:
    """While active, the drop-in's default route sizes its buffers at the reduced shape as on CUDA at the client
    shape, each dimension divided by ``factor``: no head budget (on CPU tensors the drop-in would pass its CPU one),
    the library's default byte budgets divided by ``factor ** 2`` and the vocabulary slices' column bounds by
    ``factor`` (the client's 5376-column slices of 8192 rows: 672 of 1024)."""
    from gspo_kernels.backends.triton import configs
    from gspo_kernels.integrations import trl as trl_integration

    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    rule = trl_integration.head_memory_budget
    patch(trl_integration, "head_memory_budget",
          lambda budget, device, one_pass=False: rule(budget, torch.device("cuda"), one_pass=one_pass))
    patch(configs, "DEFAULT_MEMORY_BUDGET", configs.DEFAULT_MEMORY_BUDGET // factor**2)
    patch(configs, "VOCAB_SLICE_BUDGET", configs.VOCAB_SLICE_BUDGET // factor**2)
    for name in ("VOCAB_SLICE_MULTIPLE", "VOCAB_SLICE_MIN_COLUMNS", "VOCAB_SLICE_MAX_COLUMNS"):
        patch(configs, name, getattr(configs, name) // factor)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


@contextlib.contextmanager
def as_on_cuda(trace: MemoryTrace, *, trl: bool = True) -> Iterator[MemoryTrace]:
    """While active, a CPU run allocates (for ``trace``) what the CUDA run allocates; ``trace`` itself is not
    entered here.

    - On CUDA the half-precision GEMMs write fp32 into their output (``out_dtype``), where the CPU stand-ins first
      copy the operands to fp32: those copies are made uncounted (``trace.paused``) in the library's
      ``chunk_logits`` / ``accumulate_dw`` and TRL's ``_addmm_fp32`` (each writes into a tensor it is given).
    - The Triton interpreter keeps every tensor a kernel was given alive until Python's cycle collector runs (its
      argument copying makes reference cycles; a GPU launch keeps nothing): a young-generation collection after
      each interpreted launch frees them when their last real reference goes.
    - ``trl``: TRL's chunked log-prob runs its Triton kernels (``_use_triton``) and scores only the completion
      positions, as on CUDA (with ``TRITON_INTERPRET=1``).
    """
    import gc

    from gspo_kernels.backends.triton import chunked_gemm, linear, linear_loss

    patched = []

    def patch(owner, name, value):
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def pause(owner, name):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            with trace.paused():
                return fn(*args, **kwargs)

        patch(owner, name, wrapper)

    for owner in (chunked_gemm, linear, linear_loss):  # each module's own binding of the engine's GEMMs
        for name in ("chunk_logits", "accumulate_dw"):
            if hasattr(owner, name):
                pause(owner, name)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted:
        from triton.runtime import interpreter

        launch = interpreter.GridExecutor.__call__

        def launch_then_collect(self, *args, **kwargs):
            try:
                return launch(self, *args, **kwargs)
            finally:
                gc.collect(1)

        patch(interpreter.GridExecutor, "__call__", launch_then_collect)
    if trl:
        import trl.kernels.chunked_logprob as trl_kernels
        import trl.trainer.utils as trl_utils

        pause(trl_kernels, "_addmm_fp32")
        if interpreted:
            for owner in (trl_kernels, trl_utils):
                patch(owner, "_use_triton", lambda device: True)
    try:
        yield trace
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)


def trace_trl_step(case: str, *, backend: str = "triton", one_pass: bool = False, shape: str = "client-small",
                   memory_budget: Optional[int] = None, stack_depth: int = 6, device: str = "cpu") -> dict:
    """Trace one loss step (``_compute_loss`` + ``backward``, after the old-log-prob pass, gradients None) of
    stock TRL (``case="trl"``) or the drop-in (``"gspo"``) on ``device``'s tensors (CPU: the Triton backend in the
    interpreter, allocating what CUDA does) under bf16 autocast.

    Returns ``peak`` (bytes above the step's start), ``components`` ({name: bytes} at the peak: each parameter's
    gradient by name, every other storage by the op and the innermost library / TRL / model frame that made it),
    ``report`` (the table), ``loss`` and ``uncounted`` (bytes of paused storages alive at the end: 0 expected)."""
    import gc

    from benchmarks.trl_step import build_case

    if case not in ("trl", "gspo"):
        raise ValueError(f"case must be 'trl' or 'gspo', got {case!r}")
    scaled = contextlib.nullcontext()
    if memory_budget is None and case == "gspo" and shape == "client-small":
        if one_pass:
            memory_budget = SMALL_BUDGETS["one-pass"]
        else:
            scaled = client_defaults_scaled()
    budget = "drop-in" if memory_budget is None else str(int(memory_budget))
    trainer, old_pass, step, shape = build_case(case, "bf16", backend, budget, device, shape, one_pass=one_pass)
    trace = MemoryTrace(stack_depth=stack_depth)
    with as_on_cuda(trace), scaled:
        old = old_pass()
        trainer.model.zero_grad(set_to_none=True)
        gc.collect()
        with trace:
            loss = step(old)
    grads = {}
    for name, param in trainer.model.named_parameters():
        if param.grad is not None:
            key = param.grad.untyped_storage()._cdata
            record = trace.live.get(key)
            if record is not None:
                grads[(key, record.seq)] = name
    components: Dict[str, int] = defaultdict(int)
    for key, record in trace.peak_live.items():
        name = grads.get((key, record.seq))
        if name is not None:
            components[f"grad {name}"] += record.bytes
        else:
            frame = next((f for f in reversed(record.where) if "memory_trace" not in f), "?")
            components[f"{record.op} {str(record.dtype).replace('torch.', '')} @ {frame}"] += record.bytes
    report = trace.report(min_bytes=1 << 16, title=f"{case}{' one-pass' if one_pass else ''} backend={backend} "
                          f"shape={shape} budget={budget}")
    return dict(case=case, backend=backend, one_pass=one_pass, shape=shape, budget=budget, peak=trace.peak_bytes,
                end=trace.current, loss=loss.detach().item(), components=dict(components), report=report,
                uncounted=sum(trace.uncounted.values()))


# What each storage alive at the peak is, from the op, dtype and innermost frame of its component name (see
# trace_trl_step): the first rule whose every substring is in the name wins.
CLASSES = (
    ("lm_head dW (fp32 gradient)", ("grad lm_head.weight",)),
    ("other parameter gradients", ("grad ",)),
    ("sliced: logits buffer (fp32)", ("empty float32 @ linear.py", "_slice_buffers")),
    ("sliced: dZ buffer (bf16)", ("empty bfloat16 @ linear.py", "_slice_buffers")),
    ("sliced: bf16 lm_head slice", ("_to_copy bfloat16 @ linear.py", "_vocab_sliced_backward")),
    ("sliced: fp32 dH", ("empty float32 @ linear.py", "_vocab_sliced_backward")),
    ("sliced: masked bf16 hidden rows", ("where bfloat16 @ linear.py", "_vocab_sliced_backward")),
    ("bf16 copy of the lm_head", ("_to_copy bfloat16 @ precision.py:80",)),
    ("logits chunk buffer (fp32)", ("empty float32 @ chunked_gemm.py", "__init__")),
    ("dZ store (bf16)", ("empty bfloat16 @ chunked_gemm.py", "__init__")),
    ("dH in the operand dtype", ("zeros_like bfloat16 @ linear.py",)),
    ("dH in the operand dtype", ("zeros_like bfloat16 @ linear_loss.py",)),
    ("dH cast to the hidden state's fp32", ("_to_copy float32 @ linear.py",)),
    ("dH cast to the hidden state's fp32", ("_to_copy float32 @ linear_loss.py",)),
    ("hidden states' bf16 copy", ("_to_copy bfloat16 @ precision.py:79",)),
    ("flush: masked copy of K hidden rows", ("where bfloat16 @ chunked_gemm.py",)),
    ("TRL tile buffer mm_buf", ("empty bfloat16 @ chunked_logprob.py",)),
    ("TRL lm_head tile cast w_chunk", ("_to_copy bfloat16 @ chunked_logprob.py:423",)),
    ("TRL hidden chunk cast", ("_to_copy bfloat16 @ chunked_logprob.py",)),
    ("TRL fp32 grad_hidden", ("zeros float32 @ chunked_logprob.py:407",)),
    ("TRL fp32 grad_weight", ("zeros float32 @ chunked_logprob.py:410",)),
    ("TRL hidden[mask] (fp32, saved)", ("index float32 @ utils.py",)),
    ("cpu backend: bf16 dW and dH (autograd casts dW to fp32)", ("linear_bwd bfloat16 @ ops.py",)),
    ("model activations (saved for backward)", ("modeling_",)),
    ("model activations (saved for backward)", ("activations.py",)),
    ("model activations (saved for backward)", ("sdpa_attention",)),
)


def classify(components: Dict[str, int]) -> Dict[str, int]:
    """``components`` (``trace_trl_step``'s) summed by :data:`CLASSES`; the rest as ``"small ([N] vectors,
    scalars, masks)"``."""
    out: Dict[str, int] = defaultdict(int)
    for name, nbytes in components.items():
        label = next((label for label, parts in CLASSES if all(p in name for p in parts)), None)
        out[label or "small ([N] vectors, scalars, masks)"] += nbytes
    return dict(out)


def predicted_peak(route: str, *, V: int, H: int, N: int, activations: int, rows: Tuple[int, int] = (0, 0),
                   vocab_tiles: int = 1, fixed: bool = True, slices: Tuple[int, int] = (0, 0),
                   forward_rows: int = 0, last_hidden: int = 0) -> Dict[str, int]:
    """The bytes alive at the loss step's peak, by component, under bf16 autocast on an fp32 policy (the formula
    of docs/trl.md, fitted to the traces of ``trace_trl_step``; a prediction wherever it is evaluated).

    ``route``: ``"trl"`` (stock TRL 1.16's chunked log-prob head: the peak in its backward), ``"two-pass"`` (the
    drop-in's default with the row-chunked backward, taken when ``V < 4 N``: in the backward of ``linear_logprobs``),
    ``"two-pass-sliced"`` (the same route with the vocabulary-sliced backward, ``V >= 4 N``: the larger of its
    forward's and its backward's peaks), ``"one-pass"`` (``gspo_one_pass``: at the end of the forward). ``N``:
    completion tokens; ``activations``: what the backbone keeps for its backward (measured); ``rows``: the
    row-chunked routes' ``(C, K)`` chunk rows (fp32 logits, bf16 dZ store); ``slices``: the sliced backward's
    ``(R, S)`` (rows per pass, columns per slice); ``forward_rows``: the sliced route's forward logits rows;
    ``last_hidden``: the bytes of the backbone's last hidden state, still referenced during the head's forward;
    ``vocab_tiles``: TRL's vocabulary tiles of 32768 (from 2 on, two bf16 tile casts are alive at once); ``fixed``:
    the row-chunked backward frees its buffers before casting dH to fp32 (since 2026-11-27)."""
    if route not in ("trl", "two-pass", "two-pass-sliced", "one-pass"):
        raise ValueError(f"route must be 'trl', 'two-pass', 'two-pass-sliced' or 'one-pass', got {route!r}")
    out = {"model activations (saved for backward)": activations, "lm_head dW (fp32 gradient)": 4 * V * H}
    if route == "trl":
        tokens, tile = min(N, 4096), 32768
        out["TRL tile buffer mm_buf"] = 2 * tokens * tile
        out["TRL lm_head tile cast w_chunk"] = 2 * min(V, tile) * H * (2 if vocab_tiles > 1 else 1)
        out["TRL hidden chunk cast"] = 2 * tokens * H
        out["TRL fp32 grad_hidden"] = 4 * N * H
        out["TRL hidden[mask] (fp32, saved)"] = 4 * N * H
        return out
    if route == "two-pass-sliced":
        r, s = slices
        out.update({"sliced: logits buffer (fp32)": 4 * r * s, "sliced: dZ buffer (bf16)": 2 * r * s,
                    "sliced: fp32 dH": 4 * N * H, "hidden states' bf16 copy": 2 * N * H,
                    "sliced: masked bf16 hidden rows": 2 * N * H, "sliced: bf16 lm_head slice": 2 * s * H})
        forward = {"model activations (saved for backward)": activations + last_hidden,
                   "bf16 copy of the lm_head": 2 * V * H, "logits chunk buffer (fp32)": 4 * forward_rows * V,
                   "hidden states' bf16 copy": 2 * N * H}
        return forward if sum(forward.values()) > sum(out.values()) else out
    c, k = rows
    out["bf16 copy of the lm_head"] = 2 * V * H
    out["logits chunk buffer (fp32)"] = 4 * c * V
    out["dZ store (bf16)"] = 2 * k * V
    out["hidden states' bf16 copy"] = 2 * N * H
    out["dH in the operand dtype"] = 2 * N * H
    if route == "two-pass":
        if fixed:
            out["flush: masked copy of K hidden rows"] = 2 * k * H
        else:
            out["dH cast to the hidden state's fp32"] = 4 * N * H
    return out


def main() -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="The TRL loss step's memory at its peak, stock against the drop-in "
                                     "(CPU tensors; set TRITON_INTERPRET=1 for backend triton)")
    parser.add_argument("--case", choices=("trl", "gspo"), required=True)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--one-pass", action="store_true")
    parser.add_argument("--shape", default="client-small")
    parser.add_argument("--memory-budget", type=int, default=None,
                        help="bytes (default: the client's CUDA budgets scaled to client-small)")
    parser.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    opts = parser.parse_args()
    out = trace_trl_step(opts.case, backend=opts.backend, one_pass=opts.one_pass, shape=opts.shape,
                         memory_budget=opts.memory_budget)
    if opts.json:
        print(json.dumps({k: v for k, v in out.items() if k != "report"}))
        return
    print(out["report"])
    print("classes at the peak:")
    for name, nbytes in sorted(classify(out["components"]).items(), key=lambda kv: -kv[1]):
        print(f"{nbytes:>14,d}  {name}")
    print("components at the peak:")
    for name, nbytes in sorted(out["components"].items(), key=lambda kv: -kv[1]):
        print(f"{nbytes:>14,d}  {name}")
    print(f"loss {out['loss']!r}; uncounted alive at the end: {out['uncounted']} bytes")


if __name__ == "__main__":
    main()
