"""Vocabulary-parallel lm_head (Megatron-style tensor parallelism) on top of any backend.

Each rank of a process group holds the logits columns / lm_head rows ``[start, end)`` of the global
vocabulary; labels are global ids. Nothing ``[N, V]``-sized crosses the group. Per row, each rank runs
its backend on its shard with a *local* label (``label - start`` when it owns the label, else a stand-in
column) and gets the shard's log-prob ``lp_k`` and entropy ``H_k``. With the stand-in label's logit
``z_k`` (a gather from the logits, or one row dot ``hidden . weight[label]`` for the hidden-state path)
the shard's log-sum-exp is ``lse_k = z_k - lp_k``. Then, for the whole vocabulary::

    M   = max_k lse_k                                   (all-reduce MAX, no gradient)
    S   = sum_k exp(lse_k - M)             lse = M + log S
    z_y = sum_k [rank k owns y] z_k        logp = z_y - lse
    E   = sum_k exp(lse_k - M) (lse_k - H_k)            H = lse - E / S

(``H = lse - sum_v p_v z_v`` and ``sum_{v in k} p_v z_v = exp(lse_k - lse) (lse_k - H_k)``.) ``S``, ``z_y``
and ``E`` travel in one all-reduce of a ``[3, N]`` tensor, so a forward pass costs two all-reduces of
``O(N)`` scalars. Their backward is the identity: the loss downstream is computed identically on every
rank, so each rank's gradient of the reduced value is already the gradient of its own contribution
(Megatron's reduce-from-tensor-parallel-region). The shard's ``dlogits`` / ``dW`` / ``dbias`` come from the
backend's own backward; ``dH`` (the hidden states' gradient) is partial on each rank and is summed over
the group by an identity-forward / all-reduce-backward on ``hidden`` (copy-to-region) unless
``reduce_hidden_grad=False`` (for a caller whose column-parallel layer reduces it itself).

A soft cap ``c`` (the options' ``softcap``) is elementwise: each rank's backend caps its own shard, and the stand-in
label's logit is capped the same way (``z_k = c tanh(z / c) / tau``, its gradient times ``sech^2(z / c)``), so
the formulas above hold for the capped logits unchanged. Under the cap a ``-inf`` logit becomes ``-c / tau``
(a real column), so no stand-in needs repairing.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from gspo_kernels.checks import tracing
from gspo_kernels.precision import upcast


class VocabParallel:
    """This rank holds vocabulary rows ``[start, end)``; the group's ranges must tile ``[0, V)``.

    Args:
        group: the tensor-parallel ``torch.distributed`` process group (None: the default group).
        start, end: this rank's slice of the global vocabulary, ``0 <= start < end``.
        reduce_hidden_grad: sum the hidden states' gradient over the group (default); False leaves each
            rank's partial ``dH`` (as Megatron's ``ColumnParallelLinear`` expects, which reduces it itself).

    Construction is a collective: every rank of ``group`` must build its ``VocabParallel`` together (one
    all-gather of ``(start, end)`` checks that the ranges neither overlap nor leave gaps). Shards may be
    uneven. ``vocab_size`` is the global vocabulary size.
    """

    def __init__(self, group: Optional["dist.ProcessGroup"], start: int, end: int, *,
                 reduce_hidden_grad: bool = True) -> None:
        for name, value in (("start", start), ("end", end)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"vocab_parallel {name} must be an int, got {type(value).__name__}")
        if not isinstance(reduce_hidden_grad, bool):
            raise TypeError(f"reduce_hidden_grad must be a bool, got {reduce_hidden_grad!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("VocabParallel needs an initialized torch.distributed process group "
                               "(torch.distributed.init_process_group)")
        self.group = group
        self.start = start
        self.end = end
        self.reduce_hidden_grad = reduce_hidden_grad
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # Every rank takes part in the all-gather before any range check, so a bad range on one rank
        # raises on all of them instead of leaving the others blocked in a collective.
        self.vocab_size = _check_ranges(group, self.world_size, self.rank, start, end)

    @property
    def local_size(self) -> int:
        return self.end - self.start

    def __repr__(self) -> str:
        return (f"VocabParallel(rank {self.rank}/{self.world_size}, [{self.start}, {self.end}) of {self.vocab_size}"
                f"{'' if self.reduce_hidden_grad else ', partial dH'})")

    def check_local(self, name: str, size: int) -> None:
        """``size`` (the shard's vocabulary dimension of the argument ``name``) must be ``end - start``."""
        if size != self.local_size:
            raise ValueError(f"{name} holds {size} vocabulary entries on this rank but vocab_parallel holds "
                             f"[{self.start}, {self.end}) ({self.local_size} entries)")


def check_vocab_parallel(value: object) -> Optional[VocabParallel]:
    if value is not None and not isinstance(value, VocabParallel):
        raise TypeError(f"vocab_parallel must be a gspo_kernels.VocabParallel or None, got {type(value).__name__}")
    return value


def _comm_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_ranges(group, world: int, rank: int, start: int, end: int) -> int:
    """All-gather every rank's range; they must tile ``[0, V)``. Returns ``V``."""
    mine = torch.tensor([start, end], dtype=torch.int64, device=_comm_device(group))
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    if start < 0:
        raise ValueError(f"vocab_parallel start must be >= 0, got {start}")
    if end <= start:
        raise ValueError(f"vocab_parallel end must be > start (a non-empty shard), got start={start}, end={end}")
    ranges = sorted((int(r[0]), int(r[1]), k) for k, r in enumerate(gathered))
    if world == 1 and start != 0:
        raise ValueError(f"vocab_parallel: a group of size 1 must hold the whole vocabulary, so start must be 0, "
                         f"got the partial range [{start}, {end})")
    expect, previous = 0, None
    for lo, hi, k in ranges:
        if hi <= lo or lo < 0:
            raise ValueError(f"vocab_parallel: rank {k} holds the invalid range [{lo}, {hi}) (need 0 <= start < end)")
        if lo < expect:
            raise ValueError(f"vocab_parallel ranges overlap: rank {k} holds [{lo}, {hi}) and rank {previous[2]} "
                             f"holds [{previous[0]}, {previous[1]})")
        if lo > expect:
            raise ValueError(f"vocab_parallel ranges leave a gap: no rank holds [{expect}, {lo}) "
                             f"(the ranks' [start, end) must tile [0, V))")
        expect, previous = hi, (lo, hi, k)
    return expect


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; backward is the identity (the loss downstream is replicated on every rank)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (each rank holds a partial ``dH``)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def _local_labels(labels: Tensor, vp: VocabParallel, fill: int | Tensor = 0) -> Tuple[Tensor, Tensor]:
    owned = (labels >= vp.start) & (labels < vp.end)
    return owned, torch.where(owned, labels - vp.start, fill)


def _combine(vp: VocabParallel, lp_loc: Tensor, ent_loc: Optional[Tensor], z_loc: Tensor, owned: Tensor,
             active: Optional[Tensor], return_entropy: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """The shards' ``(lp_k, H_k, z_k)`` -> the global ``(logp, H)`` (see the module docstring)."""
    dtype = lp_loc.dtype
    zero = lp_loc.new_zeros(())
    z = z_loc.to(dtype)
    lse_loc = z - lp_loc
    # Rows this rank leaves out: inactive ones, and rows whose whole shard is -inf (the stand-in column,
    # the row's argmax, is -inf: the shard contributes exp(-inf) = 0). Both get exactly-zero gradients.
    # NaN from a NaN input is kept, so it reaches the output (never a silent finite answer).
    keep = z != float("-inf")
    if active is not None:
        keep = keep & active
    lse_k = torch.where(keep, lse_loc, zero)
    peak = torch.where(keep, lse_loc.detach(), lse_loc.new_full((), float("-inf")))
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=vp.group)
    peak = torch.where(torch.isfinite(peak), peak, zero)  # rows inactive everywhere
    s = torch.where(keep, torch.exp(lse_k - peak), zero)
    on = owned if active is None else owned & active
    parts = [s, torch.where(on, z, zero)]  # a -inf label logit gives logp = -inf, as with one process
    if return_entropy:
        ent_k = torch.where(keep, ent_loc.to(dtype), zero)
        parts.append(s * (lse_k - ent_k))
    red = _AllReduceSum.apply(torch.stack(parts), vp.group)
    total = red[0]
    row_on = total > 0
    lse = peak + torch.log(torch.where(row_on, total, torch.ones_like(total)))
    logp = torch.where(row_on, red[1] - lse, zero)
    entropy = None
    if return_entropy:
        entropy = torch.where(row_on, lse - red[2] / torch.where(row_on, total, torch.ones_like(total)), zero)
    return logp, entropy


def _capped(z: Tensor, softcap: Optional[float]) -> Tuple[Tensor, Optional[Tensor]]:
    """The stand-in logits under the soft cap, ``c tanh(z / c)``, and their slope ``sech^2(z / c)`` (computed in
    fp32, fp64 for fp64 input); ``(z, None)`` unchanged without a cap."""
    if softcap is None:
        return z, None
    u = upcast(z) / softcap
    return softcap * torch.tanh(u), torch.cosh(u).pow(-2)


class _LogitsShard(torch.autograd.Function):
    """The backend on a logits shard plus the stand-in label's logit ``z`` (``[N]``, already / temperature,
    soft-capped first when the options' ``softcap`` is set; ``options``: the call's ``CallOptions``).

    The gradient reaching ``z`` is added in place into the backend's ``dlogits`` (no second ``[N, V]`` buffer).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, local: Tensor, options, run: Callable):
        temperature, softcap = float(options.temperature), options.softcap
        ctx.set_materialize_grads(False)
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_(logits.requires_grad)
            lp, ent = run(leaf, local)
        index = _row_index(logits, local)
        z, slope = _capped(leaf.detach()[index], softcap)
        z = z / temperature
        ctx.graph = (leaf, lp, ent)
        ctx.index = index
        ctx.temperature = temperature
        ctx.slope = slope
        return lp.detach(), (lp.new_zeros(0) if ent is None else ent.detach()), z

    @staticmethod
    def backward(ctx, g_lp, g_ent, g_z):
        leaf, lp, ent = ctx.graph
        grad = _backend_grads((lp, ent), (g_lp, g_ent), [leaf])[0]
        if g_z is not None and leaf.requires_grad:
            if grad is None:
                grad = torch.zeros_like(leaf)
            g = g_z / ctx.temperature if ctx.slope is None else g_z * ctx.slope / ctx.temperature
            grad.index_put_(ctx.index, g.to(grad.dtype), accumulate=True)
        return grad, None, None, None


class _LinearShard(torch.autograd.Function):
    """The backend on an lm_head shard plus the stand-in label's logit ``(h . W[label] + b[label]) / tau``
    (``options``: the call's ``CallOptions``; its ``temperature`` and ``softcap`` read here)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], local: Tensor, options, run: Callable):
        temperature, softcap = float(options.temperature), options.softcap
        ctx.set_materialize_grads(False)
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in (hidden, weight, bias)]
            lp, ent = run(*leaves, local)
        h = leaves[0].detach().reshape(-1, hidden.shape[-1])
        acc = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
        z = (h.to(acc) * weight.detach().index_select(0, local).to(acc)).sum(-1)
        if bias is not None:
            z = z + bias.detach().index_select(0, local).to(acc)
        z, ctx.slope = _capped(z, softcap)
        ctx.graph = (leaves, lp, ent)
        ctx.local = local
        ctx.temperature = temperature
        return lp.detach(), (lp.new_zeros(0) if ent is None else ent.detach()), z / temperature

    @staticmethod
    def backward(ctx, g_lp, g_ent, g_z):
        leaves, lp, ent = ctx.graph
        grads = _backend_grads((lp, ent), (g_lp, g_ent), leaves)
        if g_z is not None:
            g = g_z / ctx.temperature if ctx.slope is None else g_z * ctx.slope / ctx.temperature
            local = ctx.local
            h_leaf, w_leaf, b_leaf = leaves
            h = h_leaf.detach().reshape(-1, h_leaf.shape[-1])
            for i, leaf in enumerate(leaves):
                if leaf is not None and leaf.requires_grad and grads[i] is None:
                    grads[i] = torch.zeros_like(leaf)
            if h_leaf.requires_grad:
                dh = grads[0].contiguous()
                dh.view(-1, dh.shape[-1]).add_((g[:, None] * w_leaf.detach().index_select(0, local).to(g.dtype))
                                               .to(dh.dtype))
                grads[0] = dh
            if w_leaf.requires_grad:
                grads[1].index_add_(0, local, (g[:, None] * h.to(g.dtype)).to(grads[1].dtype))
            if b_leaf is not None and b_leaf.requires_grad:
                grads[2].index_add_(0, local, g.to(grads[2].dtype))
        return grads[0], grads[1], grads[2], None, None, None


def _row_index(logits: Tensor, local: Tensor) -> tuple:
    """Advanced index of ``logits[..., local]`` row by row, for ``[N, V]`` or ``[B, T, V]`` (any strides)."""
    if logits.dim() == 2:
        return (torch.arange(logits.shape[0], device=local.device), local)
    B, T = logits.shape[:2]
    rows = torch.arange(B * T, device=local.device)
    return (rows // T, rows % T, local)


def _backend_grads(outputs, grad_outputs, leaves) -> list:
    outs, grads = [], []
    for out, g in zip(outputs, grad_outputs):
        if out is not None and g is not None and out.requires_grad:
            outs.append(out)
            grads.append(g)
    wanted = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
    result = [None] * len(leaves)
    if outs and wanted:
        got = iter(torch.autograd.grad(outs, wanted, grads, allow_unused=True))
        for i, leaf in enumerate(leaves):
            if leaf is not None and leaf.requires_grad:
                result[i] = next(got)
    return result


def _repair_stand_ins(logits: Tensor, owned: Tensor, active: Optional[Tensor], temperature: float,
                      lp_loc: Tensor, ent_loc: Optional[Tensor], z: Tensor, run: Callable):
    """Rows whose stand-in column holds ``-inf`` (valid input on a non-label column) use the row's argmax."""
    bad = (z == float("-inf")) & ~owned
    if active is not None:
        bad = bad & active
    if tracing() or not bool(bad.any()):
        return lp_loc, ent_loc, z
    idx = torch.nonzero(bad).reshape(-1)
    rows = logits if logits.dim() == 2 else logits.flatten(0, 1)
    sub = rows.index_select(0, idx)
    stand_in = sub.detach().argmax(-1)
    lp_r, ent_r = run(sub, stand_in)
    z_r = sub.gather(-1, stand_in[:, None]).squeeze(-1) / temperature
    lp_loc = lp_loc.index_put((idx,), lp_r.to(lp_loc.dtype))
    if ent_loc is not None:
        ent_loc = ent_loc.index_put((idx,), ent_r.to(ent_loc.dtype))
    z = z.index_put((idx,), z_r.to(z.dtype))
    return lp_loc, ent_loc, z


def logits_logprobs(impl, vp: VocabParallel, logits: Tensor, labels: Tensor, active: Optional[Tensor],
                    options) -> Tuple[Tensor, Optional[Tensor]]:
    """The backend contract's ``logits_logprobs`` for a vocabulary shard ``logits [..., end - start]``.

    ``labels``: ``[N]`` int64 global ids in ``[0, V)``. Returns the global ``(logp [N], entropy [N] | None)``
    (fp32; fp64 for fp64 logits), identical on every rank; the logits' gradient is this shard's. ``options``:
    the call's :class:`~gspo_kernels.options.CallOptions` (its ``softcap`` applied by the backend on the shard).
    """
    vp.check_local("logits", logits.shape[-1])
    owned, local = _local_labels(labels, vp)
    temperature, return_entropy = options.temperature, options.return_entropy

    def run(x, lab, opts=options, act=active):
        return impl.logits_logprobs(x, lab, act, opts)

    lp_loc, ent_loc, z = _LogitsShard.apply(logits, local, options, run)
    ent_loc = ent_loc if return_entropy else None
    out_of_place = dataclasses.replace(options, inplace_backward=False)
    lp_loc, ent_loc, z = _repair_stand_ins(logits=logits, owned=owned, active=active, temperature=temperature,
                                           lp_loc=lp_loc, ent_loc=ent_loc, z=z,
                                           run=lambda x, lab: run(x, lab, out_of_place, None))
    return _combine(vp=vp, lp_loc=lp_loc, ent_loc=ent_loc, z_loc=z, owned=owned, active=active,
                    return_entropy=return_entropy)


def linear_logprobs(impl, vp: VocabParallel, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                    active: Optional[Tensor], options) -> Tuple[Tensor, Optional[Tensor]]:
    """The backend contract's ``linear_logprobs`` for an lm_head shard ``weight [end - start, H]``.

    ``hidden``: ``[N, H]`` or ``[B, T, H]``, the full hidden states (replicated over the group);
    ``bias``: this shard's ``[end - start]`` or None; ``labels``: ``[N]`` global ids. Gradients: this
    shard's ``dW`` / ``dbias``; ``dH`` summed over the group unless ``vp.reduce_hidden_grad`` is False.
    ``options``: the call's :class:`~gspo_kernels.options.CallOptions`.
    """
    vp.check_local("weight", weight.shape[0])
    if vp.reduce_hidden_grad and torch.is_grad_enabled() and hidden.requires_grad:
        hidden = _CopyToGroup.apply(hidden, vp.group)
    # A stand-in column with a finite logit: the largest bias entry (hidden @ weight.T is finite).
    fill = 0 if bias is None else int(bias.detach().argmax())
    owned, local = _local_labels(labels, vp, fill)

    def run(h, w, b, lab):
        return impl.linear_logprobs(h, w, b, lab, active, options)

    lp_loc, ent_loc, z = _LinearShard.apply(hidden, weight, bias, local, options, run)
    return _combine(vp=vp, lp_loc=lp_loc, ent_loc=ent_loc if options.return_entropy else None, z_loc=z, owned=owned,
                    active=active, return_entropy=options.return_entropy)
