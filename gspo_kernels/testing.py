"""What the library's own checks share (``gspo-kernels verify``, ``gpu-check``, the test suite): the
tolerances against the float64 reference, and the Triton interpreter's setup on machines without a GPU.

Like ``torch.testing``, this module is for checking the library, not for computing losses; importing it
imports neither triton nor any kernel.

Tolerances (see ``docs/kernels.md``): fp32 results within :data:`FP32_RTOL` of float64; a gradient
returned in bf16 / fp16 may add one rounding to that dtype per rounding its path performs
(:data:`PATH_ROUNDINGS`: the logits path rounds once, the hidden-state path twice). One exception, named by
the backend itself: ``backend="torch"`` on an accelerator writes fp16 / bf16 logits' gradient from a softmax in
their own dtype where no softmax kernel reads them into fp32 (bf16 on CUDA), so an entry off the label column is
rounded twice there (``gradient_tolerance(..., backend=, device=)``).
"""

from __future__ import annotations

import importlib.util
import os
import sys

FP32_RTOL = 1e-5
# One rounding of a result to the dtype, relative: half an ulp (round to nearest even).
UNIT_ROUNDOFF = {"fp32": 0.0, "bf16": 2.0**-8, "fp16": 2.0**-11}
PATH_ROUNDINGS = {"logits": 1, "linear": 2}


def gradient_tolerance(dtype_name: str, path: str, *, backend: "str | None" = None, device=None) -> float:
    """Relative tolerance of a gradient returned in ``dtype_name`` (see the module docstring); ``backend`` and
    ``device`` (where the gradient was computed) name the one case that rounds more (None: the path's rule)."""
    roundings = PATH_ROUNDINGS[path]
    if path == "logits" and backend == "torch" and device is not None and dtype_name in ("bf16", "fp16"):
        import torch

        from gspo_kernels.backends.torch.logits import logits_gradient_roundings

        dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float16
        roundings = logits_gradient_roundings(torch.device(device), dtype)
    return FP32_RTOL + roundings * UNIT_ROUNDOFF[dtype_name]


def rel_err(a, b) -> float:
    """Largest absolute difference relative to the largest entry of the reference ``b``."""
    a, b = a.detach().double(), b.detach().double().to(a.device)
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def setup_triton_interpreter() -> str:
    """Without a CUDA device, run Triton kernels in the interpreter (must precede importing triton), with
    its fp32 -> bf16 casts rounding to nearest even as the GPU's do (:func:`round_interpreter_bf16_casts`)."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if importlib.util.find_spec("triton") is None:  # an install without triton: no Triton backend to check
        return "cpu"
    if "triton" not in sys.modules and os.environ.get("TRITON_INTERPRET") is None:
        os.environ["TRITON_INTERPRET"] = "1"
    if os.environ.get("TRITON_INTERPRET") == "1":
        round_interpreter_bf16_casts()
        return "cpu (Triton kernels run in the Triton interpreter: correctness only, no GPU timing)"
    return "cpu"


def round_interpreter_bf16_casts() -> None:
    """Make the Triton interpreter's fp32 -> bf16 casts round to nearest even, as the GPU's ``cvt.rn`` does.

    The interpreter (triton 3.7 - 3.9) drops the low 16 bits (truncation toward zero: up to one ulp, always
    toward zero), and its ``fp_downcast_rounding="rtne"`` path mishandles the carry into the exponent. Every
    implicit or explicit fp32 -> bf16 conversion of a kernel (``.to(tl.bfloat16)``, a store through a bf16
    pointer) goes through ``InterpreterBuilder.cast_impl``; this wraps it. Without the wrapper, bf16 results
    of the Triton backend under the interpreter err up to twice as much as on a GPU, biased toward zero.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "rounds_bf16_to_nearest", False):
        return
    truncating = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # ties to even; overflow rounds to inf
            quiet_nan = (bits >> 16) | 0x40
            out = np.where(np.isnan(src.data), quiet_nan, rounded).astype(np.uint16)
            return interpreter.TensorHandle(out.reshape(np.shape(src.data)), tl.bfloat16)
        return truncating(self, src, dst_type)

    cast_impl.rounds_bf16_to_nearest = True
    builder.cast_impl = cast_impl


# Program orders of :func:`guard_interpreter_launches` (each a map from the loop's index to the program id).
PROGRAM_ORDERS = ("parity", "reverse", "forward")


def guard_interpreter_launches(order: str = "parity", fail_out_of_bounds: bool = True) -> None:
    """Make the Triton interpreter show two faults that a GPU hides differently and the plain interpreter hides
    completely: an access outside the kernel's tensors, and a write into a neighbouring program's range.

    - **Bounds**: every masked-in address of every load and store of a launch must lie inside one of its tensor
      arguments (a tensor's extent: from its first to its last element, strides included). An access outside is
      not performed (a store writes nothing there, a load reads ``other``); when the launch has run, it fails
      with an ``AssertionError`` naming the kernel, the program, the access and the nearest argument (with
      ``fail_out_of_bounds=False`` it is only left out: to see what the values alone show). Without this a store
      one element past the end writes into the CPU heap: at best a later crash, at worst nothing.
    - **Order**: the interpreter runs the programs one after another, ``0, 1, 2, ...``, so a program that writes
      into the range of the next one (``idx <= end``) is overwritten by it and every result is exact. With
      ``order="parity"`` the programs of each grid axis run odds first, then evens (``1, 3, ..., 0, 2, ...``):
      every even program runs after both of its neighbours (program 0 after program 1 on any grid of two or
      more), so what it writes into their ranges stays and changes a value a test compares (``"reverse"``: the
      last program first; ``"forward"``: the interpreter's own order).

    Also, for speed: the interpreter patches ``triton.language`` at every call of a ``@triton.jit`` helper, the
    same attributes each time; during a launch each module's helpers patch it once (interpreted kernels with many
    helpers, as the sequence stage's, run about 2.5x faster). It keeps the older interpreters' signatures
    (triton 3.4 - 3.9).

    Neither check sees what only concurrent programs do (races, a read of a neighbour's result before it is
    written) nor what a compiled kernel does differently (registers, shared memory, vectorized accesses): on a
    GPU, ``gspo-kernels gpu-check`` runs every Triton launch under ``compute-sanitizer --tool memcheck``
    (docs/testing.md). Idempotent; call it after :func:`setup_triton_interpreter`.
    """
    import inspect

    import numpy as np
    from triton.runtime import interpreter

    if order not in PROGRAM_ORDERS:
        raise ValueError(f"order must be one of {PROGRAM_ORDERS}, got {order!r}")
    builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    if getattr(executor.__call__, "guarded", None) == (order, fail_out_of_bounds):
        return
    plain_call = getattr(executor.__call__, "plain", executor.__call__)
    plain_set_idx = getattr(builder.set_grid_idx, "plain", builder.set_grid_idx)
    plain_load = getattr(builder.create_masked_load, "plain", builder.create_masked_load)
    plain_store = getattr(builder.create_masked_store, "plain", builder.create_masked_store)
    state = {"launch": None}  # the running launch: (kernel name, [(name, lo, hi)], lows, highs, violations)

    def program(index: int, count: int) -> int:
        if order == "reverse":
            return count - 1 - index
        if order == "parity":  # 1, 3, 5, ..., then 0, 2, 4, ...
            odd = count // 2
            return 2 * index + 1 if index < odd else 2 * (index - odd)
        return index

    def set_grid_idx(self, x, y, z):
        dims = self.grid_dim
        return plain_set_idx(self, program(x, dims[0]), program(y, dims[1]), program(z, dims[2]))

    def extents(name, value, out):
        if isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                extents(f"{name}[{i}]", item, out)
            return
        tensor = getattr(value, "base", value) if not hasattr(value, "untyped_storage") else value
        if not hasattr(tensor, "untyped_storage") or tensor.numel() == 0:
            return
        span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
        lo = tensor.data_ptr()
        out.append((name, lo, lo + span * tensor.element_size()))

    def checked(ptrs, mask, itemsize, what):
        """``mask`` with the accesses outside every argument removed (and recorded)."""
        launch = state["launch"]
        if launch is None:
            return mask
        addrs = np.asarray(ptrs.data).astype(np.int64, copy=False)
        live = np.broadcast_to(np.asarray(mask.data, dtype=bool), addrs.shape)
        used = addrs[live] if not live.all() else addrs
        if used.size == 0:
            return mask
        lows, highs = launch[2], launch[3]
        if ((lows <= used.min()) & (used.max() + itemsize <= highs)).any():  # all inside one argument
            return mask
        inside = ((addrs[..., None] >= lows) & (addrs[..., None] + itemsize <= highs)).any(-1)
        bad = live & ~inside
        if not bad.any():
            return mask
        first = int(addrs[bad].reshape(-1)[0])
        name, lo, hi = min(launch[1], key=lambda r: min(abs(first - r[1]), abs(first - r[2])))
        launch[4].append(f"program {tuple(state['builder'].grid_idx)} {what} {int(bad.sum())} element(s) outside "
                         f"every tensor argument, the first at byte {first - lo} of '{name}' ({hi - lo} bytes)")
        return interpreter.TensorHandle(live & inside, mask.dtype)

    def create_masked_load(self, ptrs, mask, other, *rest):
        state["builder"] = self
        itemsize = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        return plain_load(self, ptrs, checked(ptrs, mask, itemsize, "loaded"), other, *rest)

    def create_masked_store(self, ptrs, value, mask, *rest):
        state["builder"] = self
        return plain_store(self, ptrs, value, checked(ptrs, mask, np.asarray(value.data).dtype.itemsize, "stored"),
                           *rest)

    def call(self, *args, **kwargs):
        ranges = []
        params = inspect.signature(self.fn).parameters
        try:
            bound = inspect.signature(self.fn).bind_partial(
                *args, **{k: v for k, v in kwargs.items() if k in params}).arguments
        except TypeError:
            bound = {f"arg{i}": a for i, a in enumerate(args)}
        for name, value in bound.items():
            extents(name, value, ranges)
        name = getattr(self.fn, "__name__", "kernel")
        lows = np.array([r[1] for r in ranges], dtype=np.int64)
        highs = np.array([r[2] for r in ranges], dtype=np.int64)
        outer, state["launch"], state["seen"] = state["launch"], (name, ranges, lows, highs, []), set()
        try:
            result = plain_call(self, *args, **kwargs)
            violations = state["launch"][4]
        finally:
            state["launch"], state["seen"] = outer, None
        if violations and fail_out_of_bounds:
            more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
            raise AssertionError(f"Triton kernel {name}: {violations[0]}{more}")
        return result

    plain_patch_lang = getattr(interpreter._patch_lang, "plain", interpreter._patch_lang)

    def patch_lang(fn):
        # The interpreter patches the triton.language modules a function can see at the launch and again at every
        # call of a @triton.jit helper (never restoring the helpers' patches): the same attributes each time, so
        # during a launch each module's functions patch them once (a third of an interpreted kernel's time).
        seen = state.get("seen")
        if seen is not None and id(fn.__globals__) in seen:
            scope_type = state.get("scope_type")  # triton >= 3.5 returns a scope to restore (not these calls')
            return None if scope_type is None else scope_type()
        scope = plain_patch_lang(fn)
        state["scope_type"] = None if scope is None else type(scope)
        if seen is not None:
            seen.add(id(fn.__globals__))
        return scope

    for wrapper, plain in ((call, plain_call), (set_grid_idx, plain_set_idx), (create_masked_load, plain_load),
                           (create_masked_store, plain_store), (patch_lang, plain_patch_lang)):
        wrapper.plain = plain
    call.guarded = (order, fail_out_of_bounds)
    executor.__call__ = call
    builder.set_grid_idx = set_grid_idx
    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store
    interpreter._patch_lang = patch_lang
