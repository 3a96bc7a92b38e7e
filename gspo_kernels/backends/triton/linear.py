"""The hidden-state path on the vendor GEMMs (the default): ``hidden @ weight.T (+ bias)`` in chunks of rows.

The FLOPs go where their speed is known: every product is a ``torch.mm`` / ``torch.addmm`` (cuBLAS on
CUDA, with fp32 accumulation; fp32 operands take cuBLAS's fp32 path and follow
``torch.backends.cuda.matmul.allow_tf32``). Triton does only the memory-bound part, in place on the
chunk's fp32 logits buffer, with the logits path's kernels (:mod:`.logits`): the online log-sum-exp,
the label's logit and the entropy in the forward, and ``dZ = dL/dZ`` in the backward. The ``[N, V]`` logits
never exist: one chunk of ``C`` rows does, ``C`` set by the memory budget (:func:`configs.gemm_chunk_rows`).

Per chunk of rows ``r``:

* forward: ``Z = H[r] @ W.T + b`` (fp32 out), ``logprobs_forward(Z)`` -> ``logp, entropy, row_stats``;
* backward (only the rows whose incoming gradient is not zero): ``Z`` again, ``dZ = logprobs_backward(Z)``
  written in the operand dtype (one rounding), ``dH[r] = dZ @ W``, ``dW += dZ.T @ H[r]`` into an fp32
  accumulator (the GEMM's beta on CUDA; see :func:`accumulate_dw`), ``db += sum_r dZ``.

That is ``8 N H V`` FLOPs for a forward and a backward (the logits are computed twice). The one-call loss
(:func:`fused_linear_loss`) needs the gradient while the chunk's logits are still there: it runs over
chunks of *whole responses*, so that the sequence stage can produce ``dL/dlogp`` for the chunk's tokens
before ``dZ`` is formed, and does ``6 N H V`` (``2 N H V`` plus ``4 H V`` per row that carries a gradient).

Rows whose gradient is zero (masked, clipped, zero advantage) enter no backward GEMM: they are compacted
away (``torch.nonzero``: one host read of the count per chunk). Inside CUDA-graph capture (and
``torch.compile``) nothing is read back: every row of the chunk goes through the GEMMs (zero rows give zero
products), so a step can be captured.

Results are deterministic run to run but not batch invariant (cuBLAS picks its kernels by shape): a row's
bits may depend on how many rows share its GEMM. ``batch_invariant=True`` selects :mod:`.linear_invariant`.
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels import checks
from gspo_kernels.backends.triton import configs, linear_invariant
from gspo_kernels.backends.triton.linear_invariant import kernel_bias
from gspo_kernels.backends.triton.logits import logprobs_backward, logprobs_forward, softcap_value
from gspo_kernels.precision import compute_dtype

logger = logging.getLogger("gspo_kernels")

_fp32_out_gemm: dict = {}  # device type -> whether mm(out_dtype=float32) runs for half operands


def _half_fp32_out(device: torch.device) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for bf16 / fp16 operands here (CUDA: yes on
    current PyTorch; probed once per device type, logged when it does not)."""
    key = device.type
    if key not in _fp32_out_gemm:
        try:
            a = torch.ones((2, 2), device=device, dtype=torch.bfloat16)
            torch.mm(a, a, out_dtype=torch.float32)
            _fp32_out_gemm[key] = True
        except (RuntimeError, TypeError, NotImplementedError):  # an older torch or a device without the kernel:
            _fp32_out_gemm[key] = False  # not a stub; chunk_logits takes its exact fp32-copy route instead
            if key == "cuda":
                logger.warning("gspo_kernels: torch.mm(out_dtype=float32) is unavailable for half operands; the "
                               "logits chunk is formed from an fp32 copy of the operands (slower)")
    return _fp32_out_gemm[key]


def chunk_logits(h: Tensor, weight: Tensor, bias: Optional[Tensor], out: Tensor) -> Tensor:
    """``out[:n] = h @ weight.T + bias`` in ``out``'s dtype (fp32, or fp64 for fp64 operands), fp32 accumulation.

    Half operands: one GEMM with an fp32 output (``out_dtype``) where PyTorch has it (CUDA); elsewhere
    (the Triton interpreter's CPU tensors) the operands are converted to fp32 first, which is exact, so
    the products are the same as the tensor cores' and only the summation order differs.
    """
    z = out[: h.shape[0]]
    if h.dtype == out.dtype:
        if bias is None:
            torch.mm(h, weight.t(), out=z)
        else:
            torch.addmm(bias.to(out.dtype), h, weight.t(), out=z)
        return z
    if _half_fp32_out(h.device):
        z.copy_(torch.mm(h, weight.t(), out_dtype=out.dtype))
    else:
        torch.mm(h.to(out.dtype), weight.t().to(out.dtype), out=z)
    if bias is not None:
        z.add_(bias.to(out.dtype))
    return z


def accumulate_dw(dw: Tensor, dz: Tensor, h: Tensor) -> None:
    """``dw += dz.T @ h`` with ``dw`` fp32 (or fp64) and ``dz``, ``h`` in the operand dtype.

    Half operands on CUDA: one ``addmm`` into the fp32 accumulator (``out_dtype``: cuBLAS's beta = 1), so
    ``dW`` is summed in fp32 across chunks and rounded once, at the end, to the weight's dtype.
    """
    if dz.dtype == dw.dtype:
        dw.addmm_(dz.t(), h)
    elif _half_fp32_out(dz.device):
        torch.addmm(dw, dz.t(), h, out_dtype=dw.dtype, out=dw)
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


def _rows_with_gradient(carries: Tensor, start: int, stop: int, device: torch.device) -> Tensor:
    """The rows of ``start:stop`` that carry a gradient: their indices (a host read of the count), or, where no
    host read is allowed, the ``[n]`` bool mask itself (every row then goes through the GEMMs)."""
    if not checks.host_reads_allowed():
        return carries[start:stop]
    return torch.nonzero(carries[start:stop]).reshape(-1)  # the host read of the count


def backward_rows(
    rows: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, row_stats: Tensor, entropy: Optional[Tensor],
    grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], temperature: float, buffers: _Buffers,
    dh: Optional[Tensor], dw: Optional[Tensor], db: Optional[Tensor], index: Optional[Tensor], logits: Optional[Tensor],
    softcap: Optional[float] = None,
) -> None:
    """The backward of one chunk: ``dZ`` from the chunk's logits (recomputed unless ``logits`` is given),
    then the two GEMMs. ``rows``, ``labels``, ... are the chunk's (``row_stats [2, n]``); ``index``: the rows to
    visit, as indices (the others are skipped), or as a bool mask (no host read: every row is multiplied, the
    others as zero rows, so that garbage in rows without gradient, e.g. NaN padding, cannot reach ``dW``)."""
    if index is not None and index.dtype == torch.bool:
        rows = torch.where(index[:, None], rows, torch.zeros((), device=rows.device, dtype=rows.dtype))
        index = None
    if index is not None and index.numel() == rows.shape[0]:
        index = None  # every row carries a gradient: no gather
    if index is not None:
        if index.numel() == 0:
            return
        pick = lambda t: None if t is None else t.index_select(-1, index)  # noqa: E731
        rows = rows.index_select(0, index)
        labels, row_stats, entropy = pick(labels), pick(row_stats), pick(entropy)
        grad_logp, grad_entropy = pick(grad_logp), pick(grad_entropy)
        logits = None if logits is None else logits.index_select(0, index)
    n = rows.shape[0]
    row_stats = row_stats.contiguous()  # the kernel reads a dense [2, n] block
    z = logits if logits is not None else chunk_logits(rows, weight, bias, buffers.logits)
    if db is not None:  # dZ in fp32 first (the bias gradient sums it), then one rounding to the operand dtype
        logprobs_backward(z, labels, row_stats, entropy, grad_logp, grad_entropy, temperature=temperature,
                          inplace=True, softcap=softcap)
        db.add_(z.sum(0, dtype=db.dtype))
        dz = buffers.dz[:n]
        if dz.data_ptr() != z.data_ptr():
            dz.copy_(z)
    else:
        dz = logprobs_backward(z, labels, row_stats, entropy, grad_logp, grad_entropy, temperature=temperature,
                               out=buffers.dz[:n], softcap=softcap)
    if dh is not None:
        part = dz @ weight
        if index is None:
            dh.copy_(part)
        else:
            dh.index_copy_(0, index, part)
    if dw is not None:
        accumulate_dw(dw, dz, rows)


def _operands(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], softcap: Optional[float] = None):
    rows = hidden.reshape(-1, hidden.shape[-1])
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    return rows, w, kernel_bias(bias, softcap, compute_dtype(weight.dtype))


class VendorLinearLogprobs(torch.autograd.Function):
    """``(hidden, weight, bias, labels, active, temperature, memory_budget, softcap) -> (logp, entropy)``, two
    passes (the backward recomputes each chunk's logits). Saves ``hidden``, ``weight``, ``bias`` and ``[N]``
    tensors."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, active, temperature, memory_budget, softcap=None):
        rows, w, b = _operands(hidden.detach(), weight.detach(), None if bias is None else bias.detach(), softcap)
        n, vocab = rows.shape[0], w.shape[0]
        acc = compute_dtype(w.dtype)
        logp = torch.zeros(n, device=rows.device, dtype=acc)
        entropy = torch.zeros_like(logp)
        row_stats = torch.zeros((2, n), device=rows.device, dtype=acc)
        chunk = configs.gemm_chunk_rows(n, vocab, w.dtype, memory_budget, need_dz=False)
        buffers = _Buffers(min(chunk, n), vocab, w.dtype, rows.device, need_dz=False) if n else None
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            z = chunk_logits(rows[r0:r1], w, b, buffers.logits)
            _chunk_statistics(z, labels[r0:r1], None if active is None else active[r0:r1], temperature,
                              logp[r0:r1], entropy[r0:r1], row_stats[:, r0:r1], softcap)
        computed = torch.ones(n, device=rows.device, dtype=torch.bool) if active is None else active
        ctx.save_for_backward(hidden, weight, bias, labels, computed, row_stats, entropy)
        ctx.temperature, ctx.memory_budget, ctx.softcap = temperature, memory_budget, softcap
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, labels, computed, row_stats, entropy = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        if grad_logp is None and grad_entropy is None:
            return (None,) * 8
        rows, w, b = _operands(hidden.detach(), weight.detach(), None if bias is None else bias.detach(),
                               ctx.softcap)
        n, vocab = rows.shape[0], w.shape[0]
        acc = compute_dtype(w.dtype)
        carries = torch.zeros_like(computed)
        for g in (grad_logp, grad_entropy):
            if g is not None:
                carries |= g != 0
        carries &= computed
        grad_logp = None if grad_logp is None else grad_logp.to(acc)
        grad_entropy = None if grad_entropy is None else grad_entropy.to(acc)
        dh = torch.zeros_like(rows) if need_dh else None
        dw = torch.zeros(w.shape, device=w.device, dtype=acc) if need_dw else None
        db = torch.zeros(vocab, device=w.device, dtype=acc) if (need_db and bias is not None) else None
        chunk = configs.gemm_chunk_rows(n, vocab, w.dtype, ctx.memory_budget, need_dz=True)
        buffers = _Buffers(min(chunk, n), vocab, w.dtype, w.device, need_dz=True) if n else None
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            index = _rows_with_gradient(carries, r0, r1, w.device)
            sl = slice(r0, r1)
            backward_rows(rows[sl], w, b, labels[sl], row_stats[:, sl], entropy[sl],
                          None if grad_logp is None else torch.where(carries[sl], grad_logp[sl], 0),
                          None if grad_entropy is None else torch.where(carries[sl], grad_entropy[sl], 0),
                          ctx.temperature, buffers, None if dh is None else dh[sl], dw, db, index, None, ctx.softcap)
        return (None if dh is None else dh.reshape(hidden.shape).to(hidden.dtype),
                None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None, None, None, None, None)


# ---------------------------------------------------------------------------------------------
# One call, one pass: the loss and its gradient over chunks of whole responses (6 N H V).
# ---------------------------------------------------------------------------------------------


class _GradientsKnown(torch.autograd.Function):
    """``loss`` whose gradients with respect to ``inputs`` were computed in the forward (``grads``)."""

    @staticmethod
    def forward(ctx, loss, grads, *inputs):
        ctx.grads = grads
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_loss):
        grads = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.grads]
        ctx.grads = None
        return (None, None, *grads)


def response_chunks(inputs, chunk_rows: int) -> Optional[List[Tuple[int, int, bool]]]:
    """``(token_start, token_stop, whole)`` chunks of whole responses, each at most ``chunk_rows`` tokens;
    a response longer than that is a chunk of its own with ``whole=False`` (two passes for it alone).
    None when the boundaries cannot be read without a host synchronisation (packed layout under capture)."""
    batch = inputs.batch
    if len(batch.token_shape) == 2:  # padded: S responses of T tokens, no read needed
        S, T = batch.token_shape
        if T == 0 or S == 0:
            return []
        if T > chunk_rows:
            return [(i * T, (i + 1) * T, False) for i in range(S)]
        per = max(1, chunk_rows // T)
        return [(i * T, min(S, i + per) * T, True) for i in range(0, S, per)]
    if not checks.host_reads_allowed():
        return None
    cu = batch.cu_seqlens.tolist()  # the packed layout's one host read
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


def fused_linear_loss(
    objective: Callable, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], inputs, config, *,
    memory_budget: Optional[int] = None, softcap: Optional[float] = None,
):
    """The loss of ``objective`` over ``hidden @ weight.T + bias`` with its gradient formed in the same pass.

    ``objective(logp [N], entropy [N], inputs, config) -> LossOutput`` (the backend's sequence stage) must be
    separable by response: the gradient for a response's tokens depends only on that response's log-probs
    (true of every objective of :class:`GSPOConfig`: the aggregation constants come from the mask). For each
    chunk of whole responses the stage runs on the whole batch with the chunk's log-probs in place and the
    other tokens at a finite stand-in, and its gradient for the chunk is exact. At the end it runs once more
    on all the log-probs for the loss and the metrics (the numbers the two-pass path reports). Returns None
    when no gradient is wanted, or when the chunks cannot be planned without a host read (packed layout under
    capture): the caller then runs the two-pass path. The gradients are computed here and held until the
    backward (the fp32 ``dW`` accumulator only during this call). ``softcap``: the logits are capped,
    ``z -> c tanh(z / c)``, before the temperature (None: no cap).
    """
    softcap = softcap_value(softcap)
    rows, w, b = _operands(hidden.detach(), weight.detach(), None if bias is None else bias.detach(), softcap)
    n, vocab = rows.shape[0], w.shape[0]
    acc = compute_dtype(w.dtype)
    chunk = configs.gemm_chunk_rows(n, vocab, w.dtype, memory_budget, need_dz=True)
    plan = response_chunks(inputs, chunk)
    if plan is None:
        return None
    labels, valid = inputs.labels, inputs.batch.mask > 0
    temperature = config.temperature
    need = [t.requires_grad for t in (hidden, weight)] + [bias is not None and bias.requires_grad]
    if not (torch.is_grad_enabled() and any(need)):
        return None  # no gradient wanted (evaluation, torch.no_grad): the forward alone is the two-pass form's
    dh = torch.zeros_like(rows) if need[0] else None
    dw = torch.zeros(w.shape, device=w.device, dtype=acc) if need[1] else None
    db = torch.zeros(vocab, device=w.device, dtype=acc) if need[2] else None
    logp = torch.zeros(n, device=w.device, dtype=acc)
    entropy = torch.zeros_like(logp)
    row_stats = torch.zeros((2, n), device=w.device, dtype=acc)
    stand_in = torch.zeros_like(logp) if inputs.old_logprobs is None else inputs.old_logprobs.to(acc).clone()
    buffers = _Buffers(min(chunk, n), vocab, w.dtype, w.device, need_dz=True) if n else None
    two_pass_tokens = 0
    for t0, t1, whole in plan:
        sl = slice(t0, t1)
        parts = [(t0, t1)] if whole else [(s, min(t1, s + chunk)) for s in range(t0, t1, chunk)]
        z = None
        for s0, s1 in parts:  # forward: the chunk's (or, for a long response, each part's) statistics
            z = chunk_logits(rows[s0:s1], w, b, buffers.logits)
            _chunk_statistics(z, labels[s0:s1], valid[s0:s1], temperature, logp[s0:s1], entropy[s0:s1],
                              row_stats[:, s0:s1], softcap)
        g, ge = _chunk_gradient(objective, logp, entropy, stand_in, sl, inputs, config)
        carries = (g != 0) if ge is None else ((g != 0) | (ge != 0))
        if not whole:
            two_pass_tokens += t1 - t0
        for s0, s1 in parts:  # backward: dZ from the logits still in the buffer (whole) or recomputed (parts)
            local = slice(s0 - t0, s1 - t0)
            index = _rows_with_gradient(carries[local], 0, s1 - s0, w.device)
            backward_rows(rows[s0:s1], w, b, labels[s0:s1], row_stats[:, s0:s1], entropy[s0:s1], g[local],
                          None if ge is None else ge[local], temperature, buffers,
                          None if dh is None else dh[s0:s1], dw, db, index, z if whole else None, softcap)
        stand_in[sl] = logp[sl]
    with torch.no_grad():
        out = objective(logp, entropy, inputs, config)
    metrics = dict(out.metrics)
    metrics["fused_linear/two_pass_tokens"] = logp.new_full((), float(two_pass_tokens), dtype=torch.float32)
    grads = (None if dh is None else dh.reshape(hidden.shape).to(hidden.dtype),
             None if dw is None else dw.to(weight.dtype),
             None if db is None else db.to(bias.dtype))
    inputs_ = (hidden, weight) if bias is None else (hidden, weight, bias)
    loss = _GradientsKnown.apply(out.loss, grads[: len(inputs_)], *inputs_)
    return type(out)(loss, metrics)


def _chunk_gradient(objective, logp, entropy, stand_in, sl, inputs, config) -> Tuple[Tensor, Optional[Tensor]]:
    """``dL/dlogp`` (and ``dL/dentropy`` when the loss has an entropy term) for the tokens ``sl``: the stage on
    the whole batch, the chunk's values in place, the other tokens at their stand-ins."""
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
) -> Tuple[Tensor, Optional[Tensor]]:
    """The backend contract's ``linear_logprobs``: the vendor GEMMs (this module) by default; the batch-invariant
    Triton GEMMs (:mod:`.linear_invariant`) with ``batch_invariant=True``.

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
    logp, entropy = VendorLinearLogprobs.apply(hidden, weight, bias, labels.reshape(-1).to(torch.int64), active,
                                               float(temperature), memory_budget, softcap)
    return logp, (entropy if return_entropy else None)
