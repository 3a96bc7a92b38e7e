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

That is ``8 N H V`` FLOPs for a forward and a backward (the logits are computed twice). The chunk GEMM, the
buffers, the ``dZ`` formation and the ``dZ`` store are the engine's (:mod:`.chunked_gemm`), which the one-pass loss
(:mod:`.linear_loss`, ``6 N H V``) runs on too. The backward's inputs travel as two frozen objects:
:class:`SavedForward` (what the forward kept, and the call's options) and :class:`BackwardPlan` (the rows'
gradients and which of ``dH``, ``dW``, ``dB`` to form).

Host reads: none. The two-pass backward visits every row, those without gradient as zero rows (their hidden rows
zeroed, so garbage such as NaN padding cannot reach ``dW``), so a step can be captured in a CUDA graph.

Results are deterministic run to run but not batch invariant (cuBLAS picks its kernels by shape): a row's
bits may depend on how many rows share its GEMM. ``batch_invariant=True`` selects :mod:`.linear_invariant`
instead (the package's ``linear_logprobs`` picks; this module imports nothing from it).
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from gspo_kernels import checks
from gspo_kernels.backends.triton import configs
from gspo_kernels.backends.triton.chunked_gemm import (
    ChunkBuffers,
    ChunkGradient,
    GradientTargets,
    accumulate_dw,
    chunk_logits,
    chunk_statistics,
    close_store,
    form_dz,
    gemm_operands,
    open_store,
)
from gspo_kernels.backends.triton.kernel_math import kernel_bias
from gspo_kernels.options import DEFAULT_OPTIONS, CallOptions
from gspo_kernels.precision import compute_dtype


@dataclass(frozen=True)
class SavedForward:
    """What the two-pass backward (:func:`vendor_backward`) needs of its forward: the operands ``hidden [N, H]``
    (or ``[..., H]``), ``weight [V, H]`` (the caller's head when the backward is ``sliced`` and casts it slice by
    slice to ``operand``) and ``bias [V]`` (None: none), ``labels [N]`` int64, ``computed [N]`` bool (the rows the
    forward computed), its ``row_stats [2, N]`` and ``entropy [N]`` (compute dtype); the call's ``temperature``,
    ``softcap`` (None: no cap) and ``memory_budget`` (None: the default)."""

    hidden: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    labels: Tensor
    computed: Tensor
    row_stats: Tensor
    entropy: Tensor
    operand: torch.dtype
    sliced: bool
    temperature: float
    softcap: Optional[float]
    memory_budget: Optional[int]


@dataclass(frozen=True)
class BackwardPlan:
    """One two-pass backward as its two forms read it: the operands ``rows [N, H]`` (operand dtype) and ``weight
    [V, H]``, the kernel's ``bias [V]`` (compute dtype, capped when ``softcap``; None: none), ``carries [N]`` bool
    (the rows with a gradient), ``grad_logp`` / ``grad_entropy`` ``[N]`` (compute dtype, 0 where not ``carries``;
    None: zero), ``need``: which of ``[dH, dW, dB]`` to form; the rest as in :class:`SavedForward`."""

    rows: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    saved: SavedForward
    carries: Tensor
    grad_logp: Optional[Tensor]
    grad_entropy: Optional[Tensor]
    need: Tuple[bool, bool, bool]

    def chunk(self, r0: int, r1: int, z: Tensor, stats: Tensor) -> ChunkGradient:
        """Rows ``r0:r1`` of the backward (their logits ``z``, their ``stats [2, r1 - r0]``) for ``dZ``."""
        g, ge = self.grad_logp, self.grad_entropy
        return ChunkGradient(z=z, labels=self.saved.labels[r0:r1], stats=stats, entropy=self.saved.entropy[r0:r1],
                             g=None if g is None else g[r0:r1], ge=None if ge is None else ge[r0:r1], t0=r0,
                             keep=self.carries[r0:r1])


def _row_chunked_backward(plan: BackwardPlan) -> List[Optional[Tensor]]:
    """The two-pass backward over chunks of rows (more rows than a quarter of the vocabulary): each chunk's logits
    recomputed, its ``dZ`` into a store whose full loads go through the ``dH`` / ``dW`` GEMMs (``dW`` accumulated
    in fp32 across stores); ``[dH (operand dtype), dW, dB]``, None where ``need`` says no. No host read: every
    row goes through the GEMMs, those without gradient as zero rows (masked in the store)."""
    rows, weight, saved, need = plan.rows, plan.weight, plan.saved, plan.need
    w = weight if weight.stride(-1) == 1 else weight.contiguous()  # the operand itself (saved by the forward)
    n, vocab = rows.shape[0], w.shape[0]
    acc = compute_dtype(saved.operand)
    dh = torch.zeros_like(rows) if need[0] else None
    dw = torch.empty(w.shape, device=w.device, dtype=acc) if need[1] else None
    db = torch.zeros(vocab, device=w.device, dtype=acc) if need[2] else None
    targets = GradientTargets(rows=rows, weight=w, dh=dh, dw=dw, db=db, temperature=saved.temperature,
                              softcap=saved.softcap)
    free = None
    if saved.memory_budget is None and w.is_cuda and checks.host_reads_allowed():
        free = torch.cuda.mem_get_info(w.device)[0]
    sizes = configs.one_pass_chunk_rows(n, vocab, w.dtype, saved.memory_budget, free, two_pass=True)
    chunk = sizes[0]
    buffers, store = open_store(n, sizes, w)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        z = chunk_logits(rows[r0:r1], w, plan.bias, buffers.logits)
        store.backward(plan.chunk(r0, r1, z, saved.row_stats[:, r0:r1].contiguous()), targets)
    close_store(store, targets)
    return [dh, dw, db]


def _slice_buffers(count: int, acc: torch.dtype, operand: torch.dtype, device: torch.device) -> Tuple[Tensor, Tensor]:
    """The vocabulary-sliced backward's flat buffers: ``count`` logits in ``acc`` and ``count`` ``dZ`` entries in
    ``operand`` (the same storage when they are one dtype)."""
    logits = torch.empty(count, device=device, dtype=acc)
    return logits, (logits if operand == acc else torch.empty(count, device=device, dtype=operand))


def _vocab_sliced_backward(plan: BackwardPlan) -> List[Optional[Tensor]]:
    """The two-pass backward over slices of ``S`` vocabulary columns (:func:`configs.vocab_slice_sizes`), for few
    rows against the vocabulary (:func:`configs.vocab_sliced`): ``[dH, dW, dB]`` in the compute dtype (None where
    ``need`` says no).

    Per slice: ``weight``'s rows cast to ``operand`` (the caller's head when the precision policy cast it: no
    whole-head copy lives through the backward), then per pass of ``R`` rows (all of them unless the budget is
    small) the slice's logits, ``dZ`` from the forward's whole-row stats (the backward kernel's vocabulary window),
    ``dW[slice]`` (+)= ``dZ.T @ H`` straight into the fp32 gradient, ``dH`` += ``dZ @ W[slice]`` into an fp32
    accumulator, ``dB[slice]`` = the columns' sums. Rows without gradient are zero ``dZ`` rows with their hidden
    rows zeroed for ``dW`` (garbage such as NaN padding cannot reach it). No host read."""
    rows, weight, bias, saved, need = plan.rows, plan.weight, plan.bias, plan.saved, plan.need
    operand, row_stats = saved.operand, saved.row_stats
    n, vocab = rows.shape[0], weight.shape[0]
    acc = compute_dtype(operand)
    r_rows, s_cols = configs.vocab_slice_sizes(n, vocab, operand, saved.memory_budget)
    dh = torch.empty(rows.shape, device=rows.device, dtype=acc) if need[0] else None
    dw = torch.empty(weight.shape, device=weight.device, dtype=acc) if need[1] else None
    db = torch.zeros(vocab, device=weight.device, dtype=acc) if need[2] else None
    if n == 0 or vocab == 0:
        return [None if t is None else t.zero_() for t in (dh, dw, db)]
    kept = torch.where(plan.carries[:, None], rows, torch.zeros((), device=rows.device, dtype=rows.dtype)) if need[1] \
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
            form_dz(plan.chunk(r0, r1, z, stats), dz, None if db is None else db[v0:v1],
                    temperature=saved.temperature, softcap=saved.softcap, vocab_window=(v0, vocab))
            if dh is not None:
                accumulate_dw(dh[r0:r1], dz.t(), w, first=v0 == 0)  # dH[rows] (+)= dZ @ W[slice]
            if dw is not None:
                accumulate_dw(dw[v0:v1], dz, kept[r0:r1], first=r0 == 0)  # dW[slice] (+)= dZ.T @ H[rows]
        w = None  # this slice's cast goes before the next one is made, not beside it
    return [dh, dw, db]


def vendor_forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, active: Optional[Tensor], *,
                   temperature: float, memory_budget: Optional[int], softcap: Optional[float],
                   grad: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """The forward of the vendor path: ``(logp [N], entropy [N], row_stats [2, N])`` in the compute dtype, over row
    chunks (the logits GEMM, then the forward epilogue). ``grad``: whether a backward will follow (it sizes the
    buffers of a vocabulary-sliced call). Rows with ``active`` False get 0 outputs."""
    rows, w, b = gemm_operands(hidden.detach(), weight.detach(), None if bias is None else bias.detach(), softcap)
    n, vocab = rows.shape[0], w.shape[0]
    acc = compute_dtype(w.dtype)
    logp = torch.zeros(n, device=rows.device, dtype=acc)
    entropy = torch.zeros_like(logp)
    row_stats = torch.zeros((2, n), device=rows.device, dtype=acc)
    # Few rows against the vocabulary: the backward runs over slices of it (and keeps no copy of the head); a
    # forward whose backward will run sits beside the backbone's activations as that backward does, and gets
    # its smaller default buffer (the no-grad pass, the old / reference log-probs, keeps the larger one).
    budget = memory_budget
    if budget is None and configs.vocab_sliced(n, vocab) and grad:
        budget = configs.VOCAB_SLICE_BUDGET
    chunk = configs.gemm_chunk_rows(n, vocab, w.dtype, budget, need_dz=False)
    buffers = ChunkBuffers(min(chunk, n), vocab, w.dtype, rows.device, need_dz=False) if n else None
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        z = chunk_logits(rows[r0:r1], w, b, buffers.logits)
        chunk_statistics(z=z, labels=labels[r0:r1], active=None if active is None else active[r0:r1],
                         temperature=temperature, logp=logp[r0:r1], entropy=entropy[r0:r1],
                         row_stats=row_stats[:, r0:r1], softcap=softcap)
    return logp, entropy, row_stats


def vendor_backward(saved: SavedForward, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor],
                    need: Tuple[bool, bool, bool]) -> List[Optional[Tensor]]:
    """The backward of the vendor path: ``[dH [N, H], dW, dB]`` in the compute dtype (None where ``need`` says
    not wanted); the rows that are not ``saved.computed`` or carry a zero gradient do no work."""
    acc = compute_dtype(saved.operand)
    carries = torch.zeros_like(saved.computed)
    for g in (grad_logp, grad_entropy):
        if g is not None:
            carries |= g != 0
    carries &= saved.computed
    hidden, bias = saved.hidden, saved.bias
    plan = BackwardPlan(rows=hidden.detach().reshape(-1, hidden.shape[-1]), weight=saved.weight.detach(),
                        bias=None if bias is None else kernel_bias(bias.detach(), saved.softcap, acc), saved=saved,
                        carries=carries,
                        grad_logp=None if grad_logp is None else torch.where(carries, grad_logp.to(acc), 0),
                        grad_entropy=None if grad_entropy is None else torch.where(carries, grad_entropy.to(acc), 0),
                        need=need)
    return (_vocab_sliced_backward if saved.sliced else _row_chunked_backward)(plan)


class VendorLinearLogprobs(torch.autograd.Function):
    """``(hidden, weight, bias, labels, active, options, operands) -> (logp, entropy)``, two passes (the backward
    recomputes each chunk's logits); ``options``: the call's :class:`~gspo_kernels.options.CallOptions`
    (``temperature``, ``memory_budget`` and ``softcap`` read). Saves ``hidden``, ``weight``, ``bias`` and ``[N]``
    tensors."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, active, options: CallOptions, operands=None):
        # operands: the tensors the GEMMs multiply (detached), when the inputs are the caller's tensors before the
        # precision policy's cast; the gradients then go to the inputs directly, in their dtypes
        ctx.leaves = [None if t is None else (t.shape, t.dtype) for t in (hidden, weight, bias)]
        caller_weight = weight
        if operands is not None:
            hidden, weight, bias = operands
        logp, entropy, row_stats = vendor_forward(hidden, weight, bias, labels, active,
                                                  temperature=options.temperature,
                                                  memory_budget=options.memory_budget, softcap=options.softcap,
                                                  grad=any(ctx.needs_input_grad[:3]))
        n = logp.shape[0]
        ctx.sliced = configs.vocab_sliced(n, weight.shape[0])
        computed = torch.ones(n, device=logp.device, dtype=torch.bool) if active is None else active
        # The sliced backward casts the head slice by slice from the caller's tensor: the operand copy of the head
        # (the precision policy's cast) is not kept.
        ctx.operand = weight.dtype
        kept_weight = caller_weight if ctx.sliced and operands is not None else weight
        ctx.save_for_backward(hidden.detach(), kept_weight.detach(), None if bias is None else bias.detach(), labels,
                              computed, row_stats, entropy)
        ctx.options = options
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, labels, computed, row_stats, entropy = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        if grad_logp is None and grad_entropy is None:
            return (None,) * 7
        # [dH, dW, dB] in the compute dtype, the chunk buffers freed on return: before the gradients are cast to
        # the leaves' dtypes (an fp32 hidden state's dH copy, N x H x 4 bytes), not beside it
        options = ctx.options
        saved = SavedForward(hidden=hidden, weight=weight, bias=bias, labels=labels, computed=computed,
                             row_stats=row_stats, entropy=entropy, operand=ctx.operand, sliced=ctx.sliced,
                             temperature=options.temperature, softcap=options.softcap,
                             memory_budget=options.memory_budget)
        grads = vendor_backward(saved, grad_logp, grad_entropy, (need_dh, need_dw, need_db and bias is not None))
        grads = [None if g is None else g.reshape(leaf[0]).to(leaf[1]) for g, leaf in zip(grads, ctx.leaves)]
        return (*grads, None, None, None, None)


def linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                    active: Optional[Tensor] = None, options: CallOptions = DEFAULT_OPTIONS, *,
                    leaves: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """The backend contract's ``linear_logprobs`` on the vendor GEMMs, the backend's default: the package's
    ``linear_logprobs`` calls it unless ``options.batch_invariant`` (then :mod:`.linear_invariant`'s).

    ``leaves``: the caller's ``(hidden, weight, bias)`` that the precision policy cast into the operands; the
    vendor path then returns the gradients to them directly in their dtypes (an fp32 weight gets the fp32 ``dW``
    accumulator itself: no rounding to the operand dtype and back, no second ``[V, H]`` copy).

    ``hidden [N, H]`` / ``[B, T, H]``, ``weight [V, H]`` in one dtype (the precision policy has cast them);
    fp64 runs in fp64 here (cuBLAS's fp64 GEMM; fp32 in the invariant path). Returns fp32 ``(logp, entropy)``
    (fp64 for fp64 operands here). The options read: ``temperature``, ``return_entropy``, ``memory_budget`` and
    ``softcap = c``: the logits are capped, ``z -> c tanh(z / c)``, before the temperature (None: no cap).
    """
    args = (labels.reshape(-1).to(torch.int64), active, options)
    if leaves is None or (leaves[2] is None) != (bias is None):
        logp, entropy = VendorLinearLogprobs.apply(hidden, weight, bias, *args)
    else:
        operands = (hidden.detach(), weight.detach(), None if bias is None else bias.detach())
        logp, entropy = VendorLinearLogprobs.apply(*leaves, *args, operands)
    return logp, (entropy if options.return_entropy else None)
