"""DeepSpeed ZeRO-3: a partitioned lm_head taken as it comes by the hidden-state functions.

Under ZeRO-3 every parameter is partitioned over the data-parallel ranks between its uses: ``weight.shape`` is
``(0,)`` and ``weight.ds_shape`` the full ``[V, H]``. DeepSpeed gathers a module's parameters around that module's
own forward and backward; a fused head reads ``lm_head.weight`` without calling the module, so those hooks do not
run for it (inside the engine's forward DeepSpeed registers such a read as an *external parameter* of the module
running and keeps it gathered for that module's whole forward and backward; outside any forward, in a loop of the
user's own, the read returns the empty partition).

What a call does with a ZeRO-3 weight (and bias), on every backend and route:

- **Forward**: the parameters that are not available are all-gathered in place before the arguments are checked
  and re-partitioned when the call returns. The tensors the backends save for the backward that alias the
  gathered head, or are the precision policy's cast of it, are saved as a small record instead
  (``torch.autograd.graph.saved_tensors_hooks``) and rebuilt from the parameter in the backward: no ``[V, H]``
  copy of the head is kept by the library between the forward and the backward (the one-pass loss's ``dW``,
  formed in its forward, is its own and documented).
- **Backward**: the first node of the call's backward (an identity on its outputs) all-gathers the parameters
  that are not available then. Each is re-partitioned right after its gradient has been accumulated (autograd
  accumulates a full ``[V, H]`` gradient only into a full parameter: into a partitioned one it fails with a
  size mismatch), once DeepSpeed's own hook has taken the gradient for its reduce-scatter; one that gets no
  gradient in that backward (it does not require one) is re-partitioned when the backward ends.

Collectives: at most one all-gather in the forward and one in the backward per call, whatever the rank's rows
(all masked, clipped, zero advantage), its number of responses or of chunks: whether one runs depends only on the
parameter's status, which DeepSpeed keeps the same on every rank. Why this route and not the gradient formed in
the forward or an external parameter: docs/deepspeed.md.

``deepspeed`` is imported only when a ZeRO-3 parameter is seen.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

WHAT_TO_DO = ("pass the gathered weight instead (e.g. inside deepspeed.zero.GatheredParameters([weight, bias])), or "
              "run the call where DeepSpeed's process group is up (deepspeed.initialize / deepspeed.init_distributed)")


def is_zero3_param(tensor) -> bool:
    """Whether ``tensor`` is a parameter DeepSpeed ZeRO-3 manages (DeepSpeed sets ``ds_id`` and ``ds_status`` on
    each; nothing is imported to tell)."""
    return isinstance(tensor, Tensor) and hasattr(tensor, "ds_id") and hasattr(tensor, "ds_status")


@contextlib.contextmanager
def gathered(**named: Optional[Tensor]) -> Iterator[Optional["HeadGather"]]:
    """The call's ZeRO-3 parameters among ``named`` (e.g. ``weight=..., bias=...``) gathered for the block.

    Yields None when none is a ZeRO-3 parameter (then nothing happens and nothing is imported), else the
    :class:`HeadGather` whose :meth:`HeadGather.arm` the call applies to its outputs. Raises ``RuntimeError``
    naming ZeRO-3 and what to do when a partitioned parameter cannot be gathered (no ``deepspeed`` importable, no
    initialized process group).
    """
    params = [(name, t) for name, t in named.items() if t is not None and is_zero3_param(t)]
    if not params:
        yield None
        return
    gather = HeadGather(params)
    with gather.forward():
        yield gather


class _Record:
    """A saved tensor that aliases a gathered parameter (``cast=None``) or its cast to ``cast``: its geometry."""

    __slots__ = ("index", "cast", "size", "stride", "offset")

    def __init__(self, index: int, cast: Optional[torch.dtype], tensor: Tensor) -> None:
        self.index, self.cast = index, cast
        self.size, self.stride, self.offset = tuple(tensor.shape), tensor.stride(), tensor.storage_offset()


class HeadGather:
    """One call's ZeRO-3 parameters: gathered in its forward (:meth:`forward`), and again in its backward once
    :meth:`arm` has put the re-gathering node on its outputs."""

    def __init__(self, named: List[Tuple[str, Tensor]]) -> None:
        self.names = [name for name, _ in sorted(named, key=lambda item: item[1].ds_id)]
        self.params = [p for _, p in sorted(named, key=lambda item: item[1].ds_id)]  # one order on every rank
        self._status = _zero_param_status(self.names, self.params)
        self._sources: Dict[int, Tuple[int, Optional[torch.dtype]]] = {}  # storage address -> (param, cast dtype)
        self._casts: Dict[Tuple[int, torch.dtype], Tensor] = {}  # the backward's casts, made once per backward
        self._held: Dict[int, object] = {}  # param index -> its post-accumulate hook handle (None: no hook)

    # ---- the forward -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Gather what is not available, record the gathered storages, save aliases of them as records."""
        gathered = self._gather()
        try:
            for i, p in enumerate(self.params):
                self._check_full(i, "forward")
                self._sources[_address(p.data)] = (i, None)
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._release(gathered)
            self._sources.clear()

    def register_cast(self, param: Tensor, cast: Optional[Tensor]) -> None:
        """``cast`` (the precision policy's copy of ``param``, if it made one) is rebuilt in the backward, not kept."""
        if cast is None or cast is param:
            return
        for i, p in enumerate(self.params):
            if p is param:
                self._sources[_address(cast)] = (i, cast.dtype)

    def _pack(self, tensor: Tensor):
        source = self._sources.get(_address(tensor)) if tensor.numel() and tensor.layout == torch.strided else None
        return tensor if source is None else _Record(source[0], source[1], tensor)

    def _unpack(self, saved):
        if not isinstance(saved, _Record):
            return saved
        self._check_full(saved.index, "backward")
        base = self.params[saved.index].data
        if saved.cast is not None:
            key = (saved.index, saved.cast)
            if key not in self._casts:
                self._casts[key] = base.to(saved.cast)
            base = self._casts[key]
        return base.as_strided(saved.size, saved.stride, saved.offset)

    # ---- the backward ------------------------------------------------------------------------------------------

    def arm(self, *outputs: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        """``outputs`` unchanged in value; their backward first gathers the parameters again (see the module)."""
        index = [i for i, t in enumerate(outputs) if t is not None and t.requires_grad]
        if not index:
            return outputs
        wrapped = _GatherInBackward.apply(self, *(outputs[i] for i in index))
        out = list(outputs)
        for i, t in zip(index, wrapped):
            out[i] = t
        return tuple(out)

    def backward_started(self) -> None:
        """Gather what is not available; release each after its gradient is accumulated, the rest at the end."""
        for i in self._gather():
            p = self.params[i]
            self._held[i] = p.register_post_accumulate_grad_hook(self._accumulated) if p.requires_grad else None
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _accumulated(self, param: Tensor) -> None:
        for i, p in enumerate(self.params):
            if p is param and i in self._held:
                self._drop(i)

    def _backward_ended(self) -> None:
        for i in list(self._held):
            self._drop(i)
        self._casts.clear()

    def _drop(self, i: int) -> None:
        hook = self._held.pop(i)
        if hook is not None:
            hook.remove()
        self._casts = {key: t for key, t in self._casts.items() if key[0] != i}
        self._release([i])

    # ---- DeepSpeed ---------------------------------------------------------------------------------------------

    def _gather(self) -> List[int]:
        """All-gather (one collective) the parameters not available now; their indices."""
        missing = [i for i, p in enumerate(self.params) if p.ds_status == self._status.NOT_AVAILABLE]
        if missing:
            _check_process_group(self.names[missing[0]], self.params[missing[0]])
            params = [self.params[i] for i in missing]
            params[0].all_gather(param_list=params)
        return missing

    def _release(self, indices: List[int]) -> None:
        """Re-partition those of ``indices`` still gathered (a local operation: no collective), but not one a module
        holds now (``ds_active_sub_modules``, e.g. an embedding tied to the lm_head, gathered again for its own
        backward): DeepSpeed releases that one with its module."""
        params = [self.params[i] for i in indices
                  if self.params[i].ds_status == self._status.AVAILABLE and not self.params[i].ds_active_sub_modules]
        if params:
            params[0].partition(param_list=params, has_been_updated=False)

    def _check_full(self, i: int, where: str) -> None:
        p = self.params[i]
        if tuple(p.shape) != tuple(p.ds_shape):
            raise RuntimeError(
                f"DeepSpeed ZeRO-3: the {self.names[i]} parameter is not gathered in the {where} (shape "
                f"{tuple(p.shape)}, {tuple(p.ds_shape)} in full; status {p.ds_status.name}); {WHAT_TO_DO}"
            )


class _GatherInBackward(torch.autograd.Function):
    """Identity on a call's outputs whose backward (the call's first) gathers its ZeRO-3 parameters again."""

    @staticmethod
    def forward(ctx, gather: HeadGather, *outputs: Tensor):
        ctx.gather = gather
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in outputs)

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        ctx.gather.backward_started()
        return (None, *grads)


def _address(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _zero_param_status(names: List[str], params: List[Tensor]):
    """DeepSpeed's ``ZeroParamStatus`` (its import is the first use of DeepSpeed in the process)."""
    try:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    except ImportError as exc:
        raise RuntimeError(
            f"DeepSpeed ZeRO-3: the {names[0]} parameter is partitioned (shape {tuple(params[0].shape)}, "
            f"{tuple(params[0].ds_shape)} in full) but deepspeed cannot be imported ({exc}); {WHAT_TO_DO}"
        ) from None
    return ZeroParamStatus


def _check_process_group(name: str, param: Tensor) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"DeepSpeed ZeRO-3: the {name} parameter is partitioned (shape {tuple(param.shape)}, "
            f"{tuple(param.ds_shape)} in full) and gathering it needs torch.distributed, which is not initialized; "
            f"{WHAT_TO_DO}"
        )
