"""The chunked-GEMM engine of the hidden-state routes that never form the ``[N, V]`` logits: the two-pass
path (:mod:`.linear`) and the one-pass loss (:mod:`.linear_loss`) both run on it.

What it holds: the chunk's logits GEMM (:func:`chunk_logits`: ``hidden[r] @ weight.T + bias`` written in fp32 into
the chunk's buffer), the ``dW`` accumulation (:func:`accumulate_dw`: fp32 across chunks, rounded once), the chunk
buffers (:class:`ChunkBuffers`), the forward epilogue on one chunk (:func:`chunk_statistics`), the ``dZ``
formation (:func:`form_dz`: the logits path's backward kernel, in place or into the operand dtype) and the store
of ``dZ`` rows whose full loads go through the ``dH`` / ``dW`` GEMMs (:class:`GradientStore`). The Triton kernels
are the logits path's (:mod:`.logits`); every product is a ``torch.mm`` / ``torch.addmm`` (cuBLAS on CUDA).

Host reads: none.
"""


from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels.backends.triton.kernel_math import kernel_bias
from gspo_kernels.backends.triton.logits import logprobs_backward, logprobs_forward
from gspo_kernels.precision import compute_dtype

logger = logging.getLogger("gspo_kernels")


@dataclass(frozen=True)
class ChunkGradient:
    """What one chunk's ``dZ`` needs (``n`` rows): its logits ``z [n, V]`` (compute dtype: the chunk buffer's
    rows), ``labels [n]`` int64, the forward's ``stats [2, n]`` (contiguous) and ``entropy [n]``, the incoming
    ``g = dL/dlogp [n]`` and ``ge = dL/dentropy [n]`` (compute dtype; None: zero). Where the rows go in the store:
    the tokens ``index [n]`` (None: ``t0, t0 + 1, ...``) and ``keep [n]`` bool, which of them carry a gradient
    (None: all; see :class:`GradientStore`)."""

    z: Tensor
    labels: Tensor
    stats: Tensor
    entropy: Tensor
    g: Optional[Tensor]
    ge: Optional[Tensor]
    index: Optional[Tensor] = None
    t0: int = 0
    keep: Optional[Tensor] = None


@dataclass(frozen=True)
class GradientTargets:
    """What the ``dZ`` store's GEMMs read and write, and the options of the ``dZ`` kernel: the operands ``rows
    [N, H]`` and ``weight [V, H]`` (operand dtype, ``weight`` contiguous), the gradients ``dh [N, H]`` (operand
    dtype), ``dw [V, H]`` and ``db [V]`` (compute dtype; None: not wanted), ``temperature`` and ``softcap`` (None:
    no cap)."""

    rows: Tensor
    weight: Tensor
    dh: Optional[Tensor]
    dw: Optional[Tensor]
    db: Optional[Tensor]
    temperature: float
    softcap: Optional[float]

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


class ChunkBuffers:
    """The chunk's logits buffer (fp32) and its ``dZ`` in the operand dtype (a view of the same storage
    when the operand dtype is the compute dtype)."""

    def __init__(self, rows: int, vocab: int, operand: torch.dtype, device: torch.device, need_dz: bool):
        acc = compute_dtype(operand)
        self.logits = torch.empty((rows, vocab), device=device, dtype=acc)
        self.dz = None
        if need_dz:
            self.dz = self.logits if operand == acc else torch.empty((rows, vocab), device=device, dtype=operand)


def chunk_statistics(z: Tensor, labels: Tensor, active: Optional[Tensor], temperature: float, logp: Tensor,
                      entropy: Tensor, row_stats: Tensor, softcap: Optional[float] = None) -> None:
    """The forward kernel on one chunk's logits, its outputs written into the slices given (the kernel
    writes ``row_stats`` as a dense ``[2, n]`` block: the chunk's own, then copied into its columns)."""
    stats = torch.empty((2, z.shape[0]), device=z.device, dtype=row_stats.dtype)
    logprobs_forward(z, labels, active=active, temperature=temperature, return_entropy=True,
                     out=(logp, entropy, stats), softcap=softcap)
    row_stats.copy_(stats)


def gemm_operands(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], softcap: Optional[float] = None):
    rows = hidden.reshape(-1, hidden.shape[-1])
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    return rows, w, kernel_bias(bias, softcap, compute_dtype(weight.dtype))


def form_dz(chunk: ChunkGradient, dz: Tensor, db: Optional[Tensor], *, temperature: float, softcap: Optional[float],
            vocab_window: Optional[Tuple[int, int]] = None) -> None:
    """``dZ`` of the chunk's logits ``chunk.z`` into ``dz`` (the operand dtype; ``z`` itself for fp32 / fp64
    operands), adding its column sums to ``db`` when given: then ``dZ`` is formed in fp32 over ``z`` first (the
    bias gradient sums it) and rounded once into ``dz``; else the kernel writes ``dz`` directly. ``vocab_window``:
    as :func:`.logits.logprobs_backward`'s (``z`` holds a slice of the vocabulary's columns)."""
    z = chunk.z
    forward = (chunk.labels, chunk.stats, chunk.entropy, chunk.g, chunk.ge)
    if db is not None or dz.data_ptr() == z.data_ptr():
        logprobs_backward(z, *forward, temperature=temperature, inplace=True, softcap=softcap,
                          vocab_window=vocab_window)
        if db is not None:
            db.add_(z.sum(0, dtype=db.dtype))
        if dz.data_ptr() != z.data_ptr():
            dz.copy_(z)
    else:
        logprobs_backward(z, *forward, temperature=temperature, out=dz, softcap=softcap, vocab_window=vocab_window)


class GradientStore:
    """``dZ`` rows (operand dtype) waiting for the ``dH`` / ``dW`` GEMMs, with the token index of each; flushed
    when full and at the end, so that the fp32 ``dW`` accumulator is read and written once per store.

    Rows added with a ``keep`` mask (rows whose plan is not known on the host) enter the GEMMs with their hidden
    rows zeroed where ``keep`` is False: garbage there (e.g. NaN padding) cannot reach ``dW``."""

    def __init__(self, rows: int, vocab: int, buffers: ChunkBuffers, operand: torch.dtype, device: torch.device):
        self.separate = buffers.dz is None  # else dZ is written over the logits buffer (fp32 / fp64 operands)
        self.dz = torch.empty((rows, vocab), device=device, dtype=operand) if self.separate else buffers.dz
        self.index = torch.empty(rows, device=device, dtype=torch.int64)
        self.keep = torch.empty(rows, device=device, dtype=torch.bool)
        self.masked = False  # some row of the store came with a keep mask
        self.rows, self.used, self.flushes = rows, 0, 0
        self.span: Optional[Tuple[int, int]] = None  # (first token, count) while the rows are one token range

    def backward(self, chunk: ChunkGradient, targets: GradientTargets) -> None:
        """``dZ`` of the chunk (``n`` rows: tokens ``chunk.index``, or ``chunk.t0, chunk.t0 + 1, ...``) into the
        store, its column sums into ``targets.db``; the store's GEMMs first when it is full, and at once when
        ``dZ`` is written over the logits (which the next chunk needs)."""
        n = chunk.z.shape[0]
        if self.used + n > self.rows:
            self.flush(targets)
        dz = self.add(n, chunk.index, chunk.t0, chunk.keep)
        form_dz(chunk, dz, targets.db, temperature=targets.temperature, softcap=targets.softcap)
        if not self.separate:
            self.flush(targets)

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

    def flush(self, targets: GradientTargets) -> None:
        """The store's rows through the GEMMs: ``dH[tokens] = dZ @ W``, ``dW (+)= dZ.T @ H[tokens]`` (``=`` at the
        first flush); then the store is empty."""
        rows, weight, dh, dw = targets.rows, targets.weight, targets.dh, targets.dw
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


def open_store(n: int, sizes: Tuple[int, int], weight: Tensor) -> Tuple[Optional[ChunkBuffers], Optional[GradientStore]]:
    """The buffers of a pass over ``n`` rows in chunks of ``sizes = (C, K)`` rows (:func:`configs.one_pass_chunk_rows`):
    the chunk's logits buffer and the ``dZ`` store of ``K`` rows (``C`` when ``dZ`` is written over the logits,
    fp32 / fp64 operands); ``(None, None)`` without rows."""
    if not n:
        return None, None
    chunk, store_rows = sizes
    separate = weight.dtype != compute_dtype(weight.dtype)
    buffers = ChunkBuffers(min(chunk, n), weight.shape[0], weight.dtype, weight.device, need_dz=not separate)
    return buffers, GradientStore(max(store_rows, chunk) if separate else chunk, weight.shape[0], buffers,
                                  weight.dtype, weight.device)


def close_store(store: Optional[GradientStore], targets: GradientTargets) -> None:
    """The last rows of the store through the GEMMs; ``dW`` zeroed when no row ever went through them."""
    if store is not None:
        store.flush(targets)
    if targets.dw is not None and (store is None or store.flushes == 0):
        targets.dw.zero_()
