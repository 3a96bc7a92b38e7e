"""The hidden-state path's one-pass loss (the backend's ``fused_linear_loss``): the loss and its gradient over
chunks of whole responses, ``6 N H V`` FLOPs.

The two-pass form (:mod:`.linear`'s ``linear_logprobs``, then the sequence stage) does ``8 N H V``: its backward
computes the logits again. The one-call loss (:func:`fused_linear_loss`) needs the gradient while the chunk's
logits are still there: it runs over chunks of *whole responses*, so that the sequence stage can produce
``dL/dlogp`` for the chunk's tokens before ``dZ`` is formed, and does ``6 N H V`` (``2 N H V`` per counted row
plus ``4 H V`` per row that carries a gradient). The chunk GEMM, the buffers and the ``dZ`` store are
the engine's (:mod:`.chunked_gemm`: :func:`~.chunked_gemm.chunk_logits`, :class:`~.chunked_gemm.ChunkBuffers`,
:class:`~.chunked_gemm.GradientStore`), as for the two-pass path. A call travels as one frozen
:class:`OnePassCall`; the state its chunks share as one :class:`_Pass`.

Host reads: none here. The one-call loss plans its rows from ``inputs.host`` (read with the value checks, once
per call; :class:`_RowPlan`): masked rows enter no GEMM, rows of responses without a gradient enter no backward
GEMM, rows found clipped in the forward enter them as zero rows. Inside CUDA-graph capture (and
``torch.compile``) there is no host layout: every row of a chunk goes through the GEMMs, so a step can be
captured.

The gradients are known at the end of the forward: :class:`_GradientsKnown` hands them to the backward, scaled
in place by the incoming gradient (:func:`scale_gradient_kernel`, the one kernel of this module).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from gspo_kernels import checks
from gspo_kernels.backends.triton import configs, sequence
from gspo_kernels.backends.triton.chunked_gemm import (
    ChunkBuffers,
    ChunkGradient,
    GradientStore,
    GradientTargets,
    chunk_logits,
    chunk_statistics,
    close_store,
    gemm_operands,
    open_store,
)
from gspo_kernels.backends.triton.launch import device_guard
from gspo_kernels.backends.triton.logits import logprobs_forward
from gspo_kernels.options import CallOptions
from gspo_kernels.precision import compute_dtype


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


def _longest_response(inputs) -> int:
    """The most tokens of one response: from the host layout (read with the value checks), else the padded T."""
    if inputs.host is not None:
        cu = inputs.host.cu_seqlens
        return max((b - a for a, b in zip(cu[:-1], cu[1:])), default=0)
    return inputs.batch.token_shape[-1]  # padded (the caller returns early for packed without a host layout)


@dataclass(frozen=True)
class OnePassCall:
    """One call of the one-pass loss (:func:`fused_linear_loss`): the backend's ``sequence_stage``, the operands
    ``hidden [N, H]``, ``weight [V, H]`` and ``bias [V]`` (None: none) in the operand dtype, the validated
    ``inputs`` (:class:`~gspo_kernels.layout.LossInputs`), the call's ``options`` (``config``, ``temperature`` and
    ``softcap`` read here), ``sizes = (C, K)`` (the rows of a chunk and of the ``dZ`` store), ``need``: which of
    ``[dH, dW, dB]`` to form, and ``logprobs_out`` (``[N]``, receives the log-probs; None: not kept)."""

    sequence_stage: Callable
    hidden: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    inputs: Any
    options: CallOptions
    sizes: Tuple[int, int]
    need: Sequence[bool]
    logprobs_out: Optional[Tensor] = None


@dataclass(frozen=True)
class _Pass:
    """What every chunk of one pass reads and writes: the ``call``, its ``row_plan``, the GEMMs' operands and
    gradients with the ``dZ`` kernel's options (``targets``), the kernel's ``bias`` (compute dtype, capped; None:
    none), the chunk ``buffers`` and the ``dZ`` ``store`` (None without rows), ``labels [N]``, ``valid [N]`` (the
    unmasked tokens), the outputs ``logp``, ``entropy [N]`` and ``row_stats [2, N]`` (compute dtype) and
    ``stand_in [N]``: the log-probs the sequence stage sees for the tokens of the other chunks."""

    call: OnePassCall
    row_plan: _RowPlan
    targets: GradientTargets
    bias: Optional[Tensor]
    buffers: Optional[ChunkBuffers]
    store: Optional[GradientStore]
    labels: Tensor
    valid: Tensor
    logp: Tensor
    entropy: Tensor
    row_stats: Tensor
    stand_in: Tensor


def _chunk_gradient(run: _Pass, sl: slice) -> Tuple[Tensor, Optional[Tensor]]:
    """``dL/dlogp`` (and ``dL/dentropy`` when the loss has an entropy term) for the tokens ``sl``: the stage on
    the whole batch, the chunk's values in place, the other tokens at their stand-ins (the Triton stage's gradient
    without the autograd engine: no graph, no host-side work between its launches; by autograd for any other
    stage, and for an objective the kernels do not compute)."""
    sequence_stage, inputs, config = run.call.sequence_stage, run.call.inputs, run.call.options.config
    logp, entropy, stand_in = run.logp, run.entropy, run.stand_in
    if sequence_stage is sequence.fused_objective and sequence.has_kernels(config):
        lp = stand_in.clone()
        lp[sl] = logp[sl]
        g, ge = sequence.fused_objective_gradient(lp, entropy, inputs, config)
        return g[sl], (None if ge is None else ge[sl])
    with torch.enable_grad():
        lp = stand_in.clone()
        lp[sl] = logp[sl]
        lp.requires_grad_(True)
        ent = entropy.clone().requires_grad_(config.entropy_coef != 0)
        out = sequence_stage(lp, ent, inputs, config)
        wrt = (lp, ent) if config.entropy_coef != 0 else (lp,)
        grads = torch.autograd.grad(out.loss, wrt, allow_unused=True)
    g = grads[0][sl] if grads[0] is not None else torch.zeros_like(logp[sl])
    ge = None
    if config.entropy_coef != 0:
        ge = grads[1][sl] if grads[1] is not None else torch.zeros_like(logp[sl])
    return g, ge


def _long_response(run: _Pass, t0: int, t1: int, n_carrying: Optional[int]) -> None:
    """One response (tokens ``t0:t1``) longer than a chunk: its forward in parts, the stage's gradient, then each
    part again (logits recomputed) through the backward; its masked rows are zero rows (no host read)."""
    targets, b, buffers = run.targets, run.bias, run.buffers
    temperature, softcap, rows, w = targets.temperature, targets.softcap, targets.rows, targets.weight
    chunk = run.call.sizes[0]
    parts = [(s, min(t1, s + chunk)) for s in range(t0, t1, chunk)]
    for s0, s1 in parts:
        z = chunk_logits(rows[s0:s1], w, b, buffers.logits)
        chunk_statistics(z=z, labels=run.labels[s0:s1], active=run.valid[s0:s1], temperature=temperature,
                         logp=run.logp[s0:s1], entropy=run.entropy[s0:s1], row_stats=run.row_stats[:, s0:s1],
                         softcap=softcap)
    if n_carrying == 0:
        return
    g, ge = _chunk_gradient(run, slice(t0, t1))
    for s0, s1 in parts:
        local = slice(s0 - t0, s1 - t0)
        z = chunk_logits(rows[s0:s1], w, b, buffers.logits)
        run.store.backward(ChunkGradient(z=z, labels=run.labels[s0:s1], stats=run.row_stats[:, s0:s1].contiguous(),
                                         entropy=run.entropy[s0:s1], g=g[local], ge=None if ge is None else ge[local],
                                         t0=s0, keep=run.valid[s0:s1]), targets)


def _whole_chunk(run: _Pass, t0: int, t1: int, n_counted: Optional[int], n_carrying: Optional[int]) -> None:
    """A chunk of whole responses (tokens ``t0:t1``; ``n_counted`` of its rows unmasked, ``n_carrying`` with a
    gradient, None: not known on the host): its counted rows (gathered, carrying rows first, when some are
    masked or without gradient) through the logits GEMM and the forward epilogue, the stage's gradient, then the
    carrying rows' ``dZ`` into the store."""
    targets, valid, logp, entropy, row_stats = run.targets, run.valid, run.logp, run.entropy, run.row_stats
    temperature, softcap, rows, w = targets.temperature, targets.softcap, targets.rows, targets.weight
    acc = logp.dtype
    sl = slice(t0, t1)
    order = None  # the chunk's rows to visit, carrying rows first (None: all, in token order)
    if n_counted is not None and (n_counted < t1 - t0 or 0 < n_carrying < n_counted):
        order = torch.sort(run.row_plan.category[sl], stable=True).indices[:n_counted]
    m = (t1 - t0) if n_counted is None else n_counted
    if m == 0:
        run.stand_in[sl] = logp[sl]
        return
    h_rows = rows[sl] if order is None else rows[sl].index_select(0, order)
    lab = run.labels[sl] if order is None else run.labels[sl].index_select(0, order)
    z = chunk_logits(h_rows, w, run.bias, run.buffers.logits)
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
    g, ge = _chunk_gradient(run, sl)
    run.stand_in[sl] = logp[sl]
    k = m if n_carrying is None else n_carrying
    if k == 0:
        return
    if order is not None:
        g = g.index_select(0, order[:k])
        ge = None if ge is None else ge.index_select(0, order[:k])
    keep = None
    if n_counted is None:  # rows not planned on the host: those without gradient are zero rows
        g = torch.where(valid[sl], g, 0)
        ge = None if ge is None else torch.where(valid[sl], ge, 0)
        keep = (g != 0) if ge is None else ((g != 0) | (ge != 0))
    run.store.backward(ChunkGradient(z=z[:k], labels=lab[:k], stats=stats if k == m else stats[:, :k].contiguous(),
                                     entropy=c_ent[:k], g=g, ge=ge, index=None if order is None else order[:k] + t0,
                                     t0=t0, keep=keep), targets)


def _one_pass(call: OnePassCall):
    """The pass of :func:`fused_linear_loss`: ``(LossOutput with its metrics, [dH, dW, dB])`` (fp32 / operand
    dtypes; None where ``call.need`` says no), over chunks of ``call.sizes = (C, K)`` rows; the log-probs into
    ``call.logprobs_out`` when given."""
    options, inputs, need = call.options, call.inputs, call.need
    config = options.config
    bias = call.bias
    rows, w, b = gemm_operands(call.hidden.detach(), call.weight.detach(), None if bias is None else bias.detach(),
                               options.softcap)
    n, vocab = rows.shape[0], w.shape[0]
    acc = compute_dtype(w.dtype)
    plan = _RowPlan(inputs, config, call.sizes[0])
    labels, valid = inputs.labels, inputs.batch.mask > 0
    dh = torch.zeros_like(rows) if need[0] else None
    dw = torch.empty(w.shape, device=w.device, dtype=acc) if need[1] else None
    db = torch.zeros(vocab, device=w.device, dtype=acc) if need[2] else None
    logp = torch.zeros(n, device=w.device, dtype=acc)
    entropy = torch.zeros_like(logp)
    row_stats = torch.zeros((2, n), device=w.device, dtype=acc)
    stand_in = torch.zeros_like(logp) if inputs.old_logprobs is None else inputs.old_logprobs.to(acc).clone()
    buffers, store = open_store(n, call.sizes, w)
    targets = GradientTargets(rows=rows, weight=w, dh=dh, dw=dw, db=db, temperature=options.temperature,
                              softcap=options.softcap)
    run = _Pass(call=call, row_plan=plan, targets=targets, bias=b, buffers=buffers, store=store, labels=labels,
                valid=valid, logp=logp, entropy=entropy, row_stats=row_stats, stand_in=stand_in)
    two_pass_tokens = 0
    for t0, t1, whole, n_counted, n_carrying in plan.chunks:
        if whole:
            _whole_chunk(run, t0, t1, n_counted, n_carrying)
            continue
        # one response longer than a chunk: in parts, the logits recomputed in the backward
        two_pass_tokens += t1 - t0
        _long_response(run, t0, t1, n_carrying)
        stand_in[t0:t1] = logp[t0:t1]
    close_store(store, targets)
    with torch.no_grad():
        out = call.sequence_stage(logp, entropy, inputs, config)
        if call.logprobs_out is not None:
            call.logprobs_out.copy_(torch.where(valid, logp, 0))
    metrics = dict(out.metrics)
    metrics["fused_linear/two_pass_tokens"] = logp.new_full((), float(two_pass_tokens), dtype=torch.float32)
    return type(out)(out.loss, metrics), [dh, dw, db]



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


def fused_linear_loss(sequence_stage: Callable, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], inputs,
                      options: CallOptions, *, leaves=None):
    """The loss of ``sequence_stage`` over ``hidden @ weight.T + bias`` with its gradient formed in the same pass.

    ``sequence_stage(logp [N], entropy [N], inputs, config) -> LossOutput`` (the backend's sequence stage) must be
    separable by response: the gradient for a response's tokens depends only on that response's log-probs
    (true of every sequence_stage of :class:`GSPOConfig`: the aggregation constants come from the mask). For each
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
    ``hidden`` / ``weight`` / ``bias``; default: those) to which they are returned directly. The options read
    (the call's :class:`~gspo_kernels.options.CallOptions`): ``config``, ``memory_budget`` and ``softcap`` (the
    logits are capped, ``z -> c tanh(z / c)``, before the temperature; None: no cap). ``inputs.logprobs_out``
    (``[N]``, when the caller gave one) receives the per-token log-probs (0 where the mask is 0) when the pass runs
    (not when it returns None).
    """
    memory_budget = options.memory_budget
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
    # the call without its operands: what a second pass needs (``again`` below)
    stage_args = dict(sequence_stage=sequence_stage, inputs=inputs, options=options, sizes=sizes, need=need)
    out, grads = _one_pass(OnePassCall(hidden=hidden, weight=weight, bias=bias, logprobs_out=inputs.logprobs_out,
                                       **stage_args))
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
        return leaf_grads(_one_pass(OnePassCall(hidden=ops[0], weight=ops[1], bias=ops[2], **stage_args))[1])

    loss = _GradientsKnown.apply(out.loss, leaf_grads(grads), again, *present)
    return type(out)(loss, out.metrics)
