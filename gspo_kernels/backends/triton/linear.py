"""The hidden-state path on the vendor GEMMs (the default): ``hidden @ weight.T (+ bias)`` in chunks of rows.

The FLOPs go where their speed is known: every product is a ``torch.mm`` / ``torch.addmm`` (cuBLAS on
CUDA, with fp32 accumulation; fp32 operands take cuBLAS's fp32 path and follow
``torch.backends.cuda.matmul.allow_tf32``). Triton does only the memory-bound part, in place on the
chunk's fp32 logits buffer, with the logits path's kernels (:mod:`.logits`): the online log-sum-exp,
the label's logit and the entropy in the forward, and ``dZ = dL/dZ`` in the backward. The ``[N, V]`` logits
never exist: one chunk of ``C`` rows does (:func:`configs.one_pass_chunk_rows`).

Per chunk of rows ``r``:

* forward: ``Z = H[r] @ W.T + b`` (fp32, written by the GEMM into the chunk's buffer), ``logprobs_forward(Z)``
  -> ``logp, entropy, row_stats``;
* backward: ``Z`` again, ``dZ = logprobs_backward(Z)`` written in the operand dtype (one rounding) into a store
  of ``K`` rows; once per full store ``dH[rows] = dZ @ W`` and ``dW += dZ.T @ H[rows]`` into an fp32 accumulator
  (the GEMM's beta on CUDA, 0 for the first; see :func:`accumulate_dw`), so the ``[V, H]`` accumulator is read
  and written once per ``K`` rows, not once per chunk; ``db += sum_r dZ``.

With few rows against the vocabulary (``V >= 4 N``, :func:`configs.vocab_sliced`) the backward runs over slices of
the vocabulary instead (:func:`_vocab_sliced_backward`): per slice, the head's rows cast to the operand dtype (no
whole-head copy kept from the forward), the logits of every row, ``dZ``, ``dW[slice]`` written once and ``dH``
accumulated in fp32 (the accumulator re-read per pass is the ``[N, H]`` one, not the ``[V, H]`` one).

That is ``8 N H V`` FLOPs for a forward and a backward (the logits are computed twice). The one-call loss
(:func:`fused_linear_loss`) needs the gradient while the chunk's logits are still there: it runs over
chunks of *whole responses*, so that the sequence stage can produce ``dL/dlogp`` for the chunk's tokens
before ``dZ`` is formed, and does ``6 N H V`` (``2 N H V`` per counted row plus ``4 H V`` per row that carries
a gradient).

Host reads: none here. The one-call loss plans its rows from ``inputs.host`` (read with the value checks, once
per call): masked rows enter no GEMM, rows of responses without a gradient enter no backward GEMM, rows found
clipped in the forward enter them as zero rows. The two-pass backward visits every row, those without gradient
as zero rows (their hidden rows zeroed, so garbage such as NaN padding cannot reach ``dW``). Inside CUDA-graph
capture (and ``torch.compile``) there is no host layout: every row of a chunk goes through the GEMMs, so a step
can be captured.

Results are deterministic run to run but not batch invariant (cuBLAS picks its kernels by shape): a row's
bits may depend on how many rows share its GEMM. ``batch_invariant=True`` selects :mod:`.linear_invariant`.
"""

from __future__ import annotations

import bisect
import logging
from typing import Callable, List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from gspo_kernels import checks
from gspo_kernels.backends.triton import configs, linear_invariant, sequence
from gspo_kernels.backends.triton.launch import device_guard
from gspo_kernels.backends.triton.linear_invariant import kernel_bias
from gspo_kernels.backends.triton.logits import logprobs_backward, logprobs_forward, softcap_value
from gspo_kernels.precision import compute_dtype

logger = logging.getLogger("gspo_kernels")

_fp32_out_gemm: dict = {}  # device type -> "out" | "new" | None: how mm(out_dtype=float32) runs for half operands


def _half_fp32_out(device: torch.device) -> Optional[str]:
    """How ``torch.mm(a, b, out_dtype=torch.float32)`` runs for bf16 / fp16 operands here: ``"out"``, into a
    given fp32 tensor (``out=``; CUDA on current PyTorch), ``"new"``, only into a new tensor, or None, not at all
    (probed once per device type, logged when it is not ``"out"`` on CUDA)."""
    key = device.type
    if key not in _fp32_out_gemm:
        a = torch.ones((2, 2), device=device, dtype=torch.bfloat16)
        mode = None
        try:
            torch.mm(a, a, out_dtype=torch.float32, out=torch.empty((2, 2), device=device, dtype=torch.float32))
            mode = "out"
        except (RuntimeError, TypeError, NotImplementedError):
            try:
                torch.mm(a, a, out_dtype=torch.float32)
                mode = "new"
            except (RuntimeError, TypeError, NotImplementedError):  # an older torch or a device without the kernel:
                mode = None  # not a stub; chunk_logits takes its exact fp32-copy route instead
        _fp32_out_gemm[key] = mode
        if key == "cuda" and mode != "out":
            logger.warning("gspo_kernels: torch.mm(out_dtype=float32, out=...) is unavailable for half operands; the "
                           "logits chunk is %s (slower)", "copied into its buffer" if mode else
                           "formed from an fp32 copy of the operands")
    return _fp32_out_gemm[key]


def chunk_logits(h: Tensor, weight: Tensor, bias: Optional[Tensor], out: Tensor) -> Tensor:
    """``out[:n] = h @ weight.T + bias`` in ``out``'s dtype (fp32, or fp64 for fp64 operands), fp32 accumulation.

    Half operands: one GEMM that writes its fp32 output into the buffer (``out_dtype`` with ``out=``) where
    PyTorch has it (CUDA); elsewhere (the Triton interpreter's CPU tensors) the operands are converted to fp32
    first, which is exact, so the products are the same as the tensor cores' and only the summation order differs.
    """
    z = out[: h.shape[0]]
    if h.dtype == out.dtype:
        if bias is None:
            torch.mm(h, weight.t(), out=z)
        else:
            torch.addmm(bias.to(out.dtype), h, weight.t(), out=z)
        return z
    mode = _half_fp32_out(h.device)
    if mode == "out":
        torch.mm(h, weight.t(), out_dtype=out.dtype, out=z)
    elif mode == "new":
        z.copy_(torch.mm(h, weight.t(), out_dtype=out.dtype))
    else:
        torch.mm(h.to(out.dtype), weight.t().to(out.dtype), out=z)
    if bias is not None:
        z.add_(bias.to(out.dtype))
    return z


def accumulate_dw(dw: Tensor, dz: Tensor, h: Tensor, *, first: bool = False) -> None:
    """``dw += dz.T @ h`` (``first``: ``dw = dz.T @ h``, nothing read) with ``dw`` fp32 (or fp64) and ``dz``, ``h``
    in the operand dtype.

    Half operands on CUDA: one GEMM into the fp32 accumulator (``out_dtype``: cuBLAS's beta = 1, or 0 for the
    first), so ``dW`` is summed in fp32 across chunks and rounded once, at the end, to the weight's dtype.
    """
    if dz.dtype == dw.dtype:
        if first:
            torch.mm(dz.t(), h, out=dw)
        else:
            dw.addmm_(dz.t(), h)
    elif _half_fp32_out(dz.device) == "out":
        if first:
            torch.mm(dz.t(), h, out_dtype=dw.dtype, out=dw)
        else:
            torch.addmm(dw, dz.t(), h, out_dtype=dw.dtype, out=dw)
    elif first:
        torch.mm(dz.t().to(dw.dtype), h.to(dw.dtype), out=dw)
    else:
        dw.addmm_(dz.t().to(dw.dtype), h.to(dw.dtype))


class _Buffers:
    """The chunk's logits buffer (fp32) and its ``dZ`` in the operand dtype (a view of the same storage
    when the operand dtype is the compute dtype)."""

    def __init__(self, rows: int, vocab: int, operand: torch.dtype, device: torch.device, need_dz: bool):
        acc = compute_dtype(operand)
        self.logits = torch.empty((rows, vocab), device=device, dtype=acc)
        self.dz = None
        if need_dz:
            self.dz = self.logits if operand == acc else torch.empty((rows, vocab), device=device, dtype=operand)



def _chunk_statistics(z: Tensor, labels: Tensor, active: Optional[Tensor], temperature: float, logp: Tensor,
                      entropy: Tensor, row_stats: Tensor, softcap: Optional[float] = None) -> None:
    """The forward kernel on one chunk's logits, its outputs written into the slices given (the kernel
    writes ``row_stats`` as a dense ``[2, n]`` block: the chunk's own, then copied into its columns)."""
    stats = torch.empty((2, z.shape[0]), device=z.device, dtype=row_stats.dtype)
    logprobs_forward(z, labels, active=active, temperature=temperature, return_entropy=True,
                     out=(logp, entropy, stats), softcap=softcap)
    row_stats.copy_(stats)


def _operands(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], softcap: Optional[float] = None):
    rows = hidden.reshape(-1, hidden.shape[-1])
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    return rows, w, kernel_bias(bias, softcap, compute_dtype(weight.dtype))


class VendorLinearLogprobs(torch.autograd.Function):
    """``(hidden, weight, bias, labels, active, temperature, memory_budget, softcap) -> (logp, entropy)``, two
    passes (the backward recomputes each chunk's logits). Saves ``hidden``, ``weight``, ``bias`` and ``[N]``
    tensors."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, active, temperature, memory_budget, softcap=None, operands=None):
        # operands: the tensors the GEMMs multiply (detached), when the inputs are the caller's tensors before the
        # precision policy's cast; the gradients then go to the inputs directly, in their dtypes
        ctx.leaves = [None if t is None else (t.shape, t.dtype) for t in (hidden, weight, bias)]
        caller_weight = weight
        if operands is not None:
            hidden, weight, bias = operands
        rows, w, b = _operands(hidden.detach(), weight.detach(), None if bias is None else bias.detach(), softcap)
        n, vocab = rows.shape[0], w.shape[0]
        acc = compute_dtype(w.dtype)
        logp = torch.zeros(n, device=rows.device, dtype=acc)
        entropy = torch.zeros_like(logp)
        row_stats = torch.zeros((2, n), device=rows.device, dtype=acc)
        # Few rows against the vocabulary: the backward runs over slices of it (and keeps no copy of the head); a
        # forward whose backward will run sits beside the backbone's activations as that backward does, and gets
        # its smaller default buffer (the no-grad pass, the old / reference log-probs, keeps the larger one).
        ctx.sliced = configs.vocab_sliced(n, vocab)
        budget = memory_budget
        if budget is None and ctx.sliced and any(ctx.needs_input_grad[:3]):
            budget = configs.VOCAB_SLICE_BUDGET
        chunk = configs.gemm_chunk_rows(n, vocab, w.dtype, budget, need_dz=False)
        buffers = _Buffers(min(chunk, n), vocab, w.dtype, rows.device, need_dz=False) if n else None
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            z = chunk_logits(rows[r0:r1], w, b, buffers.logits)
            _chunk_statistics(z=z, labels=labels[r0:r1], active=None if active is None else active[r0:r1],
                              temperature=temperature, logp=logp[r0:r1], entropy=entropy[r0:r1],
                              row_stats=row_stats[:, r0:r1], softcap=softcap)
        computed = torch.ones(n, device=rows.device, dtype=torch.bool) if active is None else active
        # The sliced backward casts the head slice by slice from the caller's tensor: the operand copy of the head
        # (the precision policy's cast) is not kept.
        ctx.operand = w.dtype
        kept_weight = caller_weight if ctx.sliced and operands is not None else weight
        ctx.save_for_backward(hidden.detach(), kept_weight.detach(), None if bias is None else bias.detach(), labels,
                              computed, row_stats, entropy)
        ctx.temperature, ctx.memory_budget, ctx.softcap = temperature, memory_budget, softcap
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, labels, computed, row_stats, entropy = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        if grad_logp is None and grad_entropy is None:
            return (None,) * 9
        acc = compute_dtype(ctx.operand)
        carries = torch.zeros_like(computed)
        for g in (grad_logp, grad_entropy):
            if g is not None:
                carries |= g != 0
        carries &= computed
        grad_logp = None if grad_logp is None else torch.where(carries, grad_logp.to(acc), 0)
        grad_entropy = None if grad_entropy is None else torch.where(carries, grad_entropy.to(acc), 0)
        # either form returns [dH, dW, dB] in the compute dtype, its chunk buffers freed on return: before the
        # gradients are cast to the leaves' dtypes (an fp32 hidden state's dH copy, N x H x 4 bytes), not beside it
        form = _vocab_sliced_backward if ctx.sliced else _row_chunked_backward
        grads = form(rows=hidden.detach().reshape(-1, hidden.shape[-1]), weight=weight.detach(), operand=ctx.operand,
                     bias=None if bias is None else kernel_bias(bias.detach(), ctx.softcap, acc), labels=labels,
                     carries=carries, grad_logp=grad_logp, grad_entropy=grad_entropy, row_stats=row_stats,
                     entropy=entropy, temperature=ctx.temperature, softcap=ctx.softcap,
                     memory_budget=ctx.memory_budget, need=(need_dh, need_dw, need_db and bias is not None))
        grads = [None if g is None else g.reshape(leaf[0]).to(leaf[1]) for g, leaf in zip(grads, ctx.leaves)]
        return (*grads, None, None, None, None, None, None)


def _row_chunked_backward(rows: Tensor, weight: Tensor, operand: torch.dtype, bias: Optional[Tensor], labels: Tensor,
                          carries: Tensor, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor],
                          row_stats: Tensor, entropy: Tensor, temperature: float, softcap: Optional[float],
                          memory_budget: Optional[int], need) -> List[Optional[Tensor]]:
    """The two-pass backward over chunks of rows (more rows than a quarter of the vocabulary): each chunk's logits
    recomputed, its ``dZ`` into a store whose full loads go through the ``dH`` / ``dW`` GEMMs (``dW`` accumulated
    in fp32 across stores); ``[dH (operand dtype), dW, dB]``, None where ``need`` says no. No host read: every
    row goes through the GEMMs, those without gradient as zero rows (masked in the store)."""
    w = weight if weight.stride(-1) == 1 else weight.contiguous()  # the operand itself (saved by the forward)
    n, vocab = rows.shape[0], w.shape[0]
    acc = compute_dtype(operand)
    dh = torch.zeros_like(rows) if need[0] else None
    dw = torch.empty(w.shape, device=w.device, dtype=acc) if need[1] else None
    db = torch.zeros(vocab, device=w.device, dtype=acc) if need[2] else None
    free = None
    if memory_budget is None and w.is_cuda and checks.host_reads_allowed():
        free = torch.cuda.mem_get_info(w.device)[0]
    chunk, store_rows = configs.one_pass_chunk_rows(n, vocab, w.dtype, memory_budget, free, two_pass=True)
    separate = w.dtype != acc
    buffers = _Buffers(min(chunk, n), vocab, w.dtype, w.device, need_dz=not separate) if n else None
    store = _GradientStore(max(store_rows, chunk) if separate else chunk, vocab, buffers, w.dtype,
                           w.device) if n else None
    for r0 in range(0, n, chunk):
        sl = slice(r0, min(n, r0 + chunk))
        z = chunk_logits(rows[sl], w, bias, buffers.logits)
        store.backward(z=z, index=None, t0=r0, keep=carries[sl], labels=labels[sl],
                       stats=row_stats[:, sl].contiguous(), entropy=entropy[sl],
                       g=None if grad_logp is None else grad_logp[sl],
                       ge=None if grad_entropy is None else grad_entropy[sl], temperature=temperature,
                       softcap=softcap, db=db, gemms=(rows, w, dh, dw))
    if store is not None:
        store.flush(rows, w, dh, dw)
    if dw is not None and (store is None or store.flushes == 0):
        dw.zero_()
    return [dh, dw, db]


def _slice_buffers(count: int, acc: torch.dtype, operand: torch.dtype, device: torch.device) -> Tuple[Tensor, Tensor]:
    """The vocabulary-sliced backward's flat buffers: ``count`` logits in ``acc`` and ``count`` ``dZ`` entries in
    ``operand`` (the same storage when they are one dtype)."""
    logits = torch.empty(count, device=device, dtype=acc)
    return logits, (logits if operand == acc else torch.empty(count, device=device, dtype=operand))


def _vocab_sliced_backward(rows: Tensor, weight: Tensor, operand: torch.dtype, bias: Optional[Tensor], labels: Tensor,
                           carries: Tensor, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor],
                           row_stats: Tensor, entropy: Tensor, temperature: float, softcap: Optional[float],
                           memory_budget: Optional[int], need) -> List[Optional[Tensor]]:
    """The two-pass backward over slices of ``S`` vocabulary columns (:func:`configs.vocab_slice_sizes`), for few
    rows against the vocabulary (:func:`configs.vocab_sliced`): ``[dH, dW, dB]`` in the compute dtype (None where
    ``need`` says no).

    Per slice: ``weight``'s rows cast to ``operand`` (the caller's head when the precision policy cast it: no
    whole-head copy lives through the backward), then per pass of ``R`` rows (all of them unless the budget is
    small) the slice's logits, ``dZ`` from the forward's whole-row stats (the backward kernel's vocabulary window),
    ``dW[slice]`` (+)= ``dZ.T @ H`` straight into the fp32 gradient, ``dH`` += ``dZ @ W[slice]`` into an fp32
    accumulator, ``dB[slice]`` = the columns' sums. Rows without gradient are zero ``dZ`` rows with their hidden
    rows zeroed for ``dW`` (garbage such as NaN padding cannot reach it). No host read."""
    n, vocab = rows.shape[0], weight.shape[0]
    acc = compute_dtype(operand)
    r_rows, s_cols = configs.vocab_slice_sizes(n, vocab, operand, memory_budget)
    dh = torch.empty(rows.shape, device=rows.device, dtype=acc) if need[0] else None
    dw = torch.empty(weight.shape, device=weight.device, dtype=acc) if need[1] else None
    db = torch.zeros(vocab, device=weight.device, dtype=acc) if need[2] else None
    if n == 0 or vocab == 0:
        return [None if t is None else t.zero_() for t in (dh, dw, db)]
    kept = torch.where(carries[:, None], rows, torch.zeros((), device=rows.device, dtype=rows.dtype)) if need[1] \
        else None
    logits_buf, dz_buf = _slice_buffers(r_rows * s_cols, acc, operand, rows.device)
    for v0 in range(0, vocab, s_cols):
        v1 = min(vocab, v0 + s_cols)
        w = weight[v0:v1].to(operand).contiguous()  # a view when the head is already in the operand dtype
        b = None if bias is None else bias[v0:v1]
        for r0 in range(0, n, r_rows):
            r1 = min(n, r0 + r_rows)
            width, count = v1 - v0, r1 - r0
            z = chunk_logits(rows[r0:r1], w, b, logits_buf[: count * width].view(count, width))
            dz = dz_buf[: count * width].view(count, width)
            stats = row_stats if count == n else row_stats[:, r0:r1].contiguous()
            form_dz(z, dz, labels[r0:r1], stats, entropy[r0:r1], None if grad_logp is None else grad_logp[r0:r1],
                    None if grad_entropy is None else grad_entropy[r0:r1], None if db is None else db[v0:v1],
                    temperature=temperature, softcap=softcap, vocab_window=(v0, vocab))
            if dh is not None:
                accumulate_dw(dh[r0:r1], dz.t(), w, first=v0 == 0)  # dH[rows] (+)= dZ @ W[slice]
            if dw is not None:
                accumulate_dw(dw[v0:v1], dz, kept[r0:r1], first=r0 == 0)  # dW[slice] (+)= dZ.T @ H[rows]
        w = None  # this slice's cast goes before the next one is made, not beside it
    return [dh, dw, db]


# ---------------------------------------------------------------------------------------------
# One call, one pass: the loss and its gradient over chunks of whole responses (6 N H V).
# ---------------------------------------------------------------------------------------------


@triton.jit
def scale_gradient_kernel(g_ptr, scale_ptr, n, BLOCK: tl.constexpr, FP64: tl.constexpr):
    """``g *= scale`` in place over ``n`` contiguous elements, ``scale`` a 0-dim tensor read on the device (the
    loss's incoming gradient), the product in fp32 (fp64 for fp64 ``g``) and rounded once to ``g``'s dtype.

    When ``scale`` is exactly 1 (a plain ``loss.backward()``) nothing is read or written: ``g * 1`` is ``g`` bit
    for bit. The programs stride over the blocks (grid: a few per SM), so that case costs one launch."""
    s = tl.load(scale_ptr)
    if s != 1.0:
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        blocks = tl.cdiv(n, BLOCK)
        for block in range(pid, blocks, step):
            offs = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)
            keep = offs < n
            x = tl.load(g_ptr + offs, mask=keep)
            if FP64:
                y = x.to(tl.float64) * s.to(tl.float64)
            else:
                y = x.to(tl.float32) * s.to(tl.float32)
            tl.store(g_ptr + offs, y.to(g_ptr.dtype.element_ty), mask=keep)


_SM_COUNT: dict = {}  # CUDA device index -> multiprocessors


def scale_gradient_(g: Tensor, scale: Tensor) -> Tensor:
    """``g *= scale`` (``scale``: a 0-dim tensor on ``g``'s device) without a host read and, when ``scale`` is 1,
    without touching ``g`` (:func:`scale_gradient_kernel`). A ``g`` that is not contiguous (or a scale elsewhere)
    takes torch ops with the same rounding: the product in fp32 (fp64) through a temporary, rounded once."""
    n = g.numel()
    if n == 0:
        return g
    if not g.is_contiguous() or scale.numel() != 1 or scale.device != g.device:
        wide = torch.float64 if g.dtype == torch.float64 else torch.float32
        return g.copy_(g.to(wide) * scale.to(device=g.device, dtype=wide).reshape(()))
    block = configs.SCALE_BLOCK
    if g.is_cuda:
        index = g.device.index if g.device.index is not None else torch.cuda.current_device()
        if index not in _SM_COUNT:
            _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
        programs = _SM_COUNT[index] * configs.SCALE_PROGRAMS_PER_SM
    else:
        programs = 4  # the interpreter
    grid = (max(1, min(triton.cdiv(n, block), programs)),)
    with device_guard(g):
        scale_gradient_kernel[grid](g, scale.reshape(()), n, BLOCK=block, FP64=g.dtype == torch.float64,
                                    num_warps=configs.SCALE_NUM_WARPS)
    return g


class _GradientsKnown(torch.autograd.Function):
    """``loss`` whose gradients with respect to ``inputs`` were computed in the forward (``grads``).

    The backward scales them by the incoming gradient in place (:func:`scale_gradient_`: nothing moves when it
    is 1) and hands them over (no second copy of ``dW`` or ``dH``): they are handed over once. A second backward
    through the same graph (``retain_graph=True``) gets them from ``again()``, which runs the pass once more on
    the same operands (the same gradients, at the cost of the pass, paid only by a second backward)."""

    @staticmethod
    def forward(ctx, loss, grads, again, *inputs):
        ctx.grads, ctx.again = grads, again
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_loss):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            if ctx.again is None:
                raise RuntimeError("fused_linear_gspo_loss: the gradients of this loss were already handed over "
                                   "and cannot be formed again; call the loss again for another backward")
            grads = ctx.again()
        return (None, None, None, *[None if g is None else scale_gradient_(g, grad_loss) for g in grads])


def response_chunks(cu: List[int], chunk_rows: int) -> List[Tuple[int, int, bool]]:
    """``(token_start, token_stop, whole)`` chunks of whole responses (boundaries ``cu``, on the host), each at
    most ``chunk_rows`` tokens; a response longer than that is a chunk of its own with ``whole=False`` (two
    passes for it alone)."""
    chunks, start = [], 0
    for i in range(1, len(cu)):
        length = cu[i] - cu[i - 1]
        if length > chunk_rows:
            if cu[i - 1] > start:
                chunks.append((start, cu[i - 1], True))
            chunks.append((cu[i - 1], cu[i], False))
            start = cu[i]
        elif cu[i] - start > chunk_rows:
            chunks.append((start, cu[i - 1], True))
            start = cu[i - 1]
    if cu and cu[-1] > start:
        chunks.append((start, cu[-1], True))
    return chunks


class _RowPlan:
    """Which rows of the one-pass loss the GEMMs visit, decided on the host before any GEMM.

    From the :class:`~gspo_kernels.layout.HostLayout` read with the value checks (no other read): a chunk's rows
    are its *counted* rows (unmasked), of which the *carrying* ones (the rows of a response with a nonzero
    advantage, or every counted row when the loss has a KL or entropy term) enter the backward GEMMs; a row found
    clipped during the forward goes through them as a zero row. Without a host layout (CUDA-graph capture,
    ``torch.compile``: padded layout only) every row is visited and the rows without gradient are zero rows.
    """

    def __init__(self, inputs, config, chunk_rows: int):
        batch, host = inputs.batch, inputs.host
        if host is None:
            S, T = batch.token_shape  # padded (the caller checked): the boundaries need no read
            cu = [i * T for i in range(S + 1)]
            counted = carrying = None
        else:
            cu = host.cu_seqlens
            every = config.beta != 0 or config.entropy_coef != 0  # terms without the advantage as a factor
            counted = host.counted
            carrying = [c if (every or a > 0) else 0 for c, a in zip(counted, host.advantaged)]
        self.chunks = []  # (t0, t1, whole, n_counted, n_carrying); None counts: not known (every row)
        for t0, t1, whole in response_chunks(cu, chunk_rows):
            if counted is None:
                self.chunks.append((t0, t1, whole, None, None))
                continue
            first = bisect.bisect_right(cu, t0) - 1
            last = bisect.bisect_left(cu, t1)
            self.chunks.append((t0, t1, whole, sum(counted[first:last]), sum(carrying[first:last])))
        if host is not None:
            carries_response = host.on_device[0 if every else 1] > 0
            # 0: carries a gradient, 1: counted without one, 2: masked (the order of the rows inside a chunk)
            self.category = torch.where(batch.mask > 0, (~carries_response[batch.seq_index]).to(torch.int8),
                                        torch.full((), 2, dtype=torch.int8, device=batch.mask.device))


def form_dz(z: Tensor, dz: Tensor, labels: Tensor, stats: Tensor, entropy: Tensor, g: Optional[Tensor],
            ge: Optional[Tensor], db: Optional[Tensor], *, temperature: float, softcap: Optional[float],
            vocab_window: Optional[Tuple[int, int]] = None) -> None:
    """``dZ`` of the logits ``z`` into ``dz`` (the operand dtype; ``z`` itself for fp32 / fp64 operands), adding
    its column sums to ``db`` when given: then ``dZ`` is formed in fp32 over ``z`` first (the bias gradient sums
    it) and rounded once into ``dz``; else the kernel writes ``dz`` directly."""
    if db is not None or dz.data_ptr() == z.data_ptr():
        logprobs_backward(z, labels, stats, entropy, g, ge, temperature=temperature, inplace=True, softcap=softcap,
                          vocab_window=vocab_window)
        if db is not None:
            db.add_(z.sum(0, dtype=db.dtype))
        if dz.data_ptr() != z.data_ptr():
            dz.copy_(z)
    else:
        logprobs_backward(z, labels, stats, entropy, g, ge, temperature=temperature, out=dz, softcap=softcap,
                          vocab_window=vocab_window)


class _GradientStore:
    """``dZ`` rows (operand dtype) waiting for the ``dH`` / ``dW`` GEMMs, with the token index of each; flushed
    when full and at the end, so that the fp32 ``dW`` accumulator is read and written once per store.

    Rows added with a ``keep`` mask (rows whose plan is not known on the host) enter the GEMMs with their hidden
    rows zeroed where ``keep`` is False: garbage there (e.g. NaN padding) cannot reach ``dW``."""

    def __init__(self, rows: int, vocab: int, buffers: _Buffers, operand: torch.dtype, device: torch.device):
        self.separate = buffers.dz is None  # else dZ is written over the logits buffer (fp32 / fp64 operands)
        self.dz = torch.empty((rows, vocab), device=device, dtype=operand) if self.separate else buffers.dz
        self.index = torch.empty(rows, device=device, dtype=torch.int64)
        self.keep = torch.empty(rows, device=device, dtype=torch.bool)
        self.masked = False  # some row of the store came with a keep mask
        self.rows, self.used, self.flushes = rows, 0, 0
        self.span: Optional[Tuple[int, int]] = None  # (first token, count) while the rows are one token range

    def backward(self, z: Tensor, index: Optional[Tensor], t0: int, keep: Optional[Tensor], labels: Tensor,
                 stats: Tensor, entropy: Tensor, g: Optional[Tensor], ge: Optional[Tensor], temperature: float,
                 softcap: Optional[float], db: Optional[Tensor], gemms) -> None:
        """``dZ`` of the logits ``z`` (``n`` rows: tokens ``index``, or ``t0, t0 + 1, ...``) into the store, the
        store's GEMMs first when it is full (``gemms``: ``flush``'s arguments), and at once when ``dZ`` is
        written over the logits (which the next chunk needs)."""
        n = z.shape[0]
        if self.used + n > self.rows:
            self.flush(*gemms)
        dz = self.add(n, index, t0, keep)
        form_dz(z, dz, labels, stats, entropy, g, ge, db, temperature=temperature, softcap=softcap)
        if not self.separate:
            self.flush(*gemms)

    def add(self, n: int, index: Optional[Tensor], t0: int, keep: Optional[Tensor] = None) -> Tensor:
        """Reserve ``n`` rows for tokens ``index`` (None: ``t0, t0 + 1, ...``; ``keep``: which of them carry a
        gradient, None: all); returns their ``dZ`` rows."""
        k = self.used
        if keep is None:
            self.keep[k:k + n].fill_(True)
        else:
            self.keep[k:k + n].copy_(keep)
            self.masked = True
        if index is None:
            if self.span is not None and self.span[0] + self.span[1] == t0 and k == self.span[1]:
                self.span = (self.span[0], k + n)
            elif k == 0:
                self.span = (t0, n)
            else:
                self.span = None
            torch.arange(t0, t0 + n, device=self.index.device, out=self.index[k:k + n])
        else:
            self.span = None
            self.index[k:k + n].copy_(index)
        self.used = k + n
        return self.dz[k:k + n]
    def flush(self, rows: Tensor, weight: Tensor, dh: Optional[Tensor], dw: Optional[Tensor]) -> None:
        k = self.used
        if k == 0:
            return
        dz = self.dz[:k]
        if self.span is not None:
            a = self.span[0]
            h = rows[a:a + k]
            if dh is not None:
                torch.mm(dz, weight, out=dh[a:a + k])
        else:
            index = self.index[:k]
            h = rows.index_select(0, index)
            if dh is not None:
                dh.index_copy_(0, index, dz @ weight)
        if dw is not None:
            if self.masked:
                h = torch.where(self.keep[:k, None], h, torch.zeros((), device=h.device, dtype=h.dtype))
            accumulate_dw(dw, dz, h, first=self.flushes == 0)
        self.used, self.span, self.masked = 0, None, False
        self.flushes += 1


def fused_linear_loss(
    objective: Callable, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], inputs, config, *,
    memory_budget: Optional[int] = None, softcap: Optional[float] = None, leaves=None,
    logprobs_out: Optional[Tensor] = None,
):
    """The loss of ``objective`` over ``hidden @ weight.T + bias`` with its gradient formed in the same pass.

    ``objective(logp [N], entropy [N], inputs, config) -> LossOutput`` (the backend's sequence stage) must be
    separable by response: the gradient for a response's tokens depends only on that response's log-probs
    (true of every objective of :class:`GSPOConfig`: the aggregation constants come from the mask). For each
    chunk of whole responses the stage runs on the whole batch with the chunk's log-probs in place and the
    other tokens at a finite stand-in, and its gradient for the chunk is exact. At the end it runs once more
    on all the log-probs for the loss and the metrics (the numbers the two-pass path reports).

    Work per chunk (``C`` rows of fp32 logits, :func:`configs.one_pass_chunk_rows`): the chunk's counted rows
    (gathered when some are masked) through the logits GEMM, the forward epilogue, the stage's gradient, the
    backward epilogue on the rows that carry a gradient (first in the chunk's order), whose ``dZ`` goes to a
    store of ``K`` rows; the ``dH`` and ``dW`` GEMMs run once per full store. No host read: the plan comes from
    ``inputs.host`` (read with the value checks); without it, every row is visited.

    Returns None when no gradient is wanted, or when the chunks cannot be planned without a host read (packed
    layout under capture): the caller then runs the two-pass path. The gradients are computed here and held
    until the backward, in the dtypes of ``leaves`` (the caller's tensors, which the precision policy cast into
    ``hidden`` / ``weight`` / ``bias``; default: those) to which they are returned directly. ``softcap``: the
    logits are capped, ``z -> c tanh(z / c)``, before the temperature (None: no cap). ``logprobs_out [N]``
    receives the per-token log-probs (0 where the mask is 0) when the pass runs (not when it returns None).
    """
    softcap = softcap_value(softcap)
    leaves = (hidden, weight, bias) if leaves is None else leaves
    need = [t is not None and t.requires_grad for t in leaves]
    if not (torch.is_grad_enabled() and any(need)):
        return None  # no gradient wanted (evaluation, torch.no_grad): the forward alone is the two-pass form's
    if inputs.host is None and len(inputs.batch.token_shape) != 2:
        return None  # packed layout with no boundaries on the host (capture): the two-pass form
    free = None
    if memory_budget is None and weight.is_cuda and checks.host_reads_allowed():
        free = torch.cuda.mem_get_info(weight.device)[0]
    sizes = configs.one_pass_chunk_rows(hidden.reshape(-1, hidden.shape[-1]).shape[0], weight.shape[0], weight.dtype,
                                        memory_budget, free, longest=_longest_response(inputs))
    out, grads = _one_pass(objective=objective, hidden=hidden, weight=weight, bias=bias, inputs=inputs, config=config,
                           sizes=sizes, need=need, softcap=softcap, logprobs_out=logprobs_out)
    present = tuple(leaf for leaf in leaves if leaf is not None)
    # what a second pass needs (not the operands themselves: an fp32 head's bf16 copy is not kept for it)
    shapes = [(leaf.shape, leaf.dtype) for leaf in present]
    casts = [(t.shape, t.dtype) for t in (hidden, weight, bias) if t is not None]

    def leaf_grads(grads):
        grads = [g for g, leaf in zip(grads, leaves) if leaf is not None]
        return [None if g is None else g.reshape(shape).to(dtype) for g, (shape, dtype) in zip(grads, shapes)]

    def again():  # a second backward through the loss: the same pass on the same operands and sizes
        ops = [leaf.detach().to(dtype).reshape(shape) for leaf, (shape, dtype) in zip(present, casts)]
        ops += [None] * (3 - len(ops))
        return leaf_grads(_one_pass(objective, *ops, inputs, config, sizes, need, softcap)[1])

    loss = _GradientsKnown.apply(out.loss, leaf_grads(grads), again, *present)
    return type(out)(loss, out.metrics)


def _longest_response(inputs) -> int:
    """The most tokens of one response: from the host layout (read with the value checks), else the padded T."""
    if inputs.host is not None:
        cu = inputs.host.cu_seqlens
        return max((b - a for a, b in zip(cu[:-1], cu[1:])), default=0)
    return inputs.batch.token_shape[-1]  # padded (the caller returns early for packed without a host layout)


def _one_pass(objective, hidden, weight, bias, inputs, config, sizes, need, softcap, logprobs_out=None):
    """The pass of :func:`fused_linear_loss`: ``(LossOutput with its metrics, [dH, dW, dB])`` (fp32 / operand
    dtypes; None where ``need`` says no), over chunks of ``sizes = (C, K)`` rows; the log-probs into
    ``logprobs_out`` when given."""
    rows, w, b = _operands(hidden.detach(), weight.detach(), None if bias is None else bias.detach(), softcap)
    n, vocab = rows.shape[0], w.shape[0]
    acc = compute_dtype(w.dtype)
    separate = w.dtype != acc
    chunk, store_rows = sizes
    plan = _RowPlan(inputs, config, chunk)
    labels, valid = inputs.labels, inputs.batch.mask > 0
    temperature = config.temperature
    dh = torch.zeros_like(rows) if need[0] else None
    dw = torch.empty(w.shape, device=w.device, dtype=acc) if need[1] else None
    db = torch.zeros(vocab, device=w.device, dtype=acc) if need[2] else None
    logp = torch.zeros(n, device=w.device, dtype=acc)
    entropy = torch.zeros_like(logp)
    row_stats = torch.zeros((2, n), device=w.device, dtype=acc)
    stand_in = torch.zeros_like(logp) if inputs.old_logprobs is None else inputs.old_logprobs.to(acc).clone()
    buffers = _Buffers(min(chunk, n), vocab, w.dtype, w.device, need_dz=not separate) if n else None
    store = _GradientStore(max(store_rows, chunk) if separate else chunk, vocab, buffers, w.dtype,
                           w.device) if n else None
    two_pass_tokens = 0
    for t0, t1, whole, n_counted, n_carrying in plan.chunks:
        sl = slice(t0, t1)
        if not whole:  # one response longer than a chunk: in parts, the logits recomputed in the backward
            two_pass_tokens += t1 - t0
            _long_response(objective=objective, rows=rows, w=w, b=b, labels=labels, valid=valid, t0=t0, t1=t1,
                           chunk=chunk, n_carrying=n_carrying, logp=logp, entropy=entropy, row_stats=row_stats,
                           stand_in=stand_in, inputs=inputs, config=config, buffers=buffers, store=store, dh=dh, dw=dw,
                           db=db, softcap=softcap)
            stand_in[sl] = logp[sl]
            continue
        order = None  # the chunk's rows to visit, carrying rows first (None: all, in token order)
        if n_counted is not None and (n_counted < t1 - t0 or 0 < n_carrying < n_counted):
            order = torch.sort(plan.category[sl], stable=True).indices[:n_counted]
        m = (t1 - t0) if n_counted is None else n_counted
        if m == 0:
            stand_in[sl] = logp[sl]
            continue
        h_rows = rows[sl] if order is None else rows[sl].index_select(0, order)
        lab = labels[sl] if order is None else labels[sl].index_select(0, order)
        z = chunk_logits(h_rows, w, b, buffers.logits)
        if order is None:
            c_logp, c_ent, c_stats = logp[sl], entropy[sl], row_stats[:, sl]
            stats = torch.empty((2, m), device=w.device, dtype=acc)
            logprobs_forward(z, lab, active=None if n_counted is not None else valid[sl], temperature=temperature,
                             return_entropy=True, out=(c_logp, c_ent, stats), softcap=softcap)
            c_stats.copy_(stats)
        else:
            c_logp, c_ent = torch.empty(m, device=w.device, dtype=acc), torch.empty(m, device=w.device, dtype=acc)
            stats = torch.empty((2, m), device=w.device, dtype=acc)
            logprobs_forward(z, lab, temperature=temperature, return_entropy=True, out=(c_logp, c_ent, stats),
                             softcap=softcap)
            idx = order + t0
            logp.index_copy_(0, idx, c_logp)
            entropy.index_copy_(0, idx, c_ent)
            row_stats.index_copy_(1, idx, stats)
        g, ge = _chunk_gradient(objective=objective, logp=logp, entropy=entropy, stand_in=stand_in, sl=sl,
                                inputs=inputs, config=config)
        stand_in[sl] = logp[sl]
        k = m if n_carrying is None else n_carrying
        if k == 0:
            continue
        if order is not None:
            g = g.index_select(0, order[:k])
            ge = None if ge is None else ge.index_select(0, order[:k])
        keep = None
        if n_counted is None:  # rows not planned on the host: those without gradient are zero rows
            g = torch.where(valid[sl], g, 0)
            ge = None if ge is None else torch.where(valid[sl], ge, 0)
            keep = (g != 0) if ge is None else ((g != 0) | (ge != 0))
        store.backward(z=z[:k], index=None if order is None else order[:k] + t0, t0=t0, keep=keep, labels=lab[:k],
                       stats=stats if k == m else stats[:, :k].contiguous(), entropy=c_ent[:k], g=g, ge=ge,
                       temperature=temperature, softcap=softcap, db=db, gemms=(rows, w, dh, dw))
    if store is not None:
        store.flush(rows, w, dh, dw)
    if dw is not None and (store is None or store.flushes == 0):
        dw.zero_()
    with torch.no_grad():
        out = objective(logp, entropy, inputs, config)
        if logprobs_out is not None:
            logprobs_out.copy_(torch.where(valid, logp, 0))
    metrics = dict(out.metrics)
    metrics["fused_linear/two_pass_tokens"] = logp.new_full((), float(two_pass_tokens), dtype=torch.float32)
    return type(out)(out.loss, metrics), [dh, dw, db]


def _long_response(objective, rows, w, b, labels, valid, t0, t1, chunk, n_carrying, logp, entropy, row_stats,
                   stand_in, inputs, config, buffers, store, dh, dw, db, softcap) -> None:
    """One response longer than a chunk: its forward in parts, the stage's gradient, then each part again
    (logits recomputed) through the backward; its masked rows are zero rows (no host read)."""
    temperature = config.temperature
    parts = [(s, min(t1, s + chunk)) for s in range(t0, t1, chunk)]
    for s0, s1 in parts:
        z = chunk_logits(rows[s0:s1], w, b, buffers.logits)
        _chunk_statistics(z=z, labels=labels[s0:s1], active=valid[s0:s1], temperature=temperature, logp=logp[s0:s1],
                          entropy=entropy[s0:s1], row_stats=row_stats[:, s0:s1], softcap=softcap)
    if n_carrying == 0:
        return
    g, ge = _chunk_gradient(objective=objective, logp=logp, entropy=entropy, stand_in=stand_in, sl=slice(t0, t1),
                            inputs=inputs, config=config)
    for s0, s1 in parts:
        local = slice(s0 - t0, s1 - t0)
        z = chunk_logits(rows[s0:s1], w, b, buffers.logits)
        store.backward(z=z, index=None, t0=s0, keep=valid[s0:s1], labels=labels[s0:s1],
                       stats=row_stats[:, s0:s1].contiguous(), entropy=entropy[s0:s1], g=g[local],
                       ge=None if ge is None else ge[local], temperature=temperature, softcap=softcap, db=db,
                       gemms=(rows, w, dh, dw))


def _chunk_gradient(objective, logp, entropy, stand_in, sl, inputs, config) -> Tuple[Tensor, Optional[Tensor]]:
    """``dL/dlogp`` (and ``dL/dentropy`` when the loss has an entropy term) for the tokens ``sl``: the stage on
    the whole batch, the chunk's values in place, the other tokens at their stand-ins (the Triton stage's gradient
    without the autograd engine: no graph, no host-side work between its launches)."""
    if objective is sequence.fused_objective:
        lp = stand_in.clone()
        lp[sl] = logp[sl]
        g, ge = sequence.fused_objective_gradient(lp, entropy, inputs, config)
        return g[sl], (None if ge is None else ge[sl])
    with torch.enable_grad():
        lp = stand_in.clone()
        lp[sl] = logp[sl]
        lp.requires_grad_(True)
        ent = entropy.clone().requires_grad_(config.entropy_coef != 0)
        out = objective(lp, ent, inputs, config)
        wrt = (lp, ent) if config.entropy_coef != 0 else (lp,)
        grads = torch.autograd.grad(out.loss, wrt, allow_unused=True)
    g = grads[0][sl] if grads[0] is not None else torch.zeros_like(logp[sl])
    ge = None
    if config.entropy_coef != 0:
        ge = grads[1][sl] if grads[1] is not None else torch.zeros_like(logp[sl])
    return g, ge


# ---------------------------------------------------------------------------------------------
# The backend's entry points.
# ---------------------------------------------------------------------------------------------


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    labels: Tensor,
    *,
    active: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    memory_budget: Optional[int] = None,
    batch_invariant: bool = False,
    softcap: Optional[float] = None,
    leaves: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The backend contract's ``linear_logprobs``: the vendor GEMMs (this module) by default; the batch-invariant
    Triton GEMMs (:mod:`.linear_invariant`) with ``batch_invariant=True``.

    ``leaves``: the caller's ``(hidden, weight, bias)`` that the precision policy cast into the operands; the
    vendor path then returns the gradients to them directly in their dtypes (an fp32 weight gets the fp32 ``dW``
    accumulator itself: no rounding to the operand dtype and back, no second ``[V, H]`` copy).

    ``hidden [N, H]`` / ``[B, T, H]``, ``weight [V, H]`` in one dtype (the precision policy has cast them);
    fp64 runs in fp64 here (cuBLAS's fp64 GEMM; fp32 in the invariant path). Returns fp32 ``(logp, entropy)``
    (fp64 for fp64 operands here). ``softcap = c``: the logits are capped, ``z -> c tanh(z / c)``, before the
    temperature, in both modes (None: no cap).
    """
    softcap = softcap_value(softcap)
    if batch_invariant:
        return linear_invariant.linear_logprobs(hidden, weight, bias, labels, active=active, temperature=temperature,
                                                return_entropy=return_entropy, memory_budget=memory_budget,
                                                softcap=softcap)
    args = (labels.reshape(-1).to(torch.int64), active, float(temperature), memory_budget, softcap)
    if leaves is None or (leaves[2] is None) != (bias is None):
        logp, entropy = VendorLinearLogprobs.apply(hidden, weight, bias, *args)
    else:
        operands = (hidden.detach(), weight.detach(), None if bias is None else bias.detach())
        logp, entropy = VendorLinearLogprobs.apply(*leaves, *args, operands)
    return logp, (entropy if return_entropy else None)
