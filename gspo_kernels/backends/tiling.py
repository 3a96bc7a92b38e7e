"""Row tiling shared by the backends: views of ``[..., D]`` tensors as row blocks, never copies, and the
recognition of a model's ``[B, T + 1, V]`` output read as ``[:, :-1]`` (:func:`next_token_base`)."""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor


def as_rows(x: Tensor) -> Tensor:
    """``[..., D]`` -> ``[rows, D]`` without a copy when the leading dimensions can be merged (``reshape``: a view
    then, else a copy; no ``view`` attempt in a ``try``, which ``torch.compile`` cannot trace)."""
    return x.reshape(-1, x.shape[-1])


def row_blocks(x: Tensor, block: int, balanced: bool = False) -> Sequence[tuple]:
    """Split ``x [..., D]`` into ``(r0, r1, view [r1 - r0, D])`` row blocks that never copy.

    A ``[B, T, V]`` tensor whose ``B`` and ``T`` cannot be merged into one strided dimension
    (e.g. ``logits[:, :-1]``) is walked one batch element at a time. ``balanced``: as many blocks as
    ``block`` rows need, of (nearly) equal size (1024 rows at ``block = 883``: 2 x 512, not 883 + 141).
    """
    if x.dim() == 2:
        n = x.shape[0]
        if balanced and n > 0:
            block = -(-n // -(-n // block))
        return [(r0, min(r0 + block, n), x[r0 : r0 + block]) for r0 in range(0, n, block)]
    try:
        flat = x.view(-1, x.shape[-1])
        return row_blocks(flat, block, balanced)
    except RuntimeError:
        pass
    out = []
    T = x.shape[1]
    for b in range(x.shape[0]):
        for r0, r1, view in row_blocks(x[b], block, balanced):
            out.append((b * T + r0, b * T + r1, view))
    return out


def next_token_base(logits: Tensor) -> Optional[Tensor]:
    """The ``[B, T + 1, V]`` tensor ``base`` when ``logits`` is exactly ``base[:, :-1]`` in autograd's eyes.

    True when ``logits`` requires grad, is a 3-D view of a 3-D ``base`` with the same strides and start, and
    was produced from ``base`` by slicing (its ``grad_fn`` is a ``SliceBackward0`` whose input is ``base``'s own
    node, through at most one more slice per dimension: torch 2.8 records ``x[:, :-1]``'s ``:`` as a slice). A backend (triton, cpu) then takes ``base`` as its input and writes the gradient for all
    ``T + 1`` positions (zeros at the last), so autograd's ``slice_backward`` does not allocate a second
    ``[B, T + 1, V]`` buffer. Returns None in every other case (the view is then used as it is).
    """
    base = getattr(logits, "_base", None)
    if base is None or not logits.requires_grad or logits.dim() != 3 or base.dim() != 3:
        return None
    if tuple(base.shape) != (logits.shape[0], logits.shape[1] + 1, logits.shape[2]):
        return None
    if base.stride() != logits.stride() or base.storage_offset() != logits.storage_offset():
        return None
    node = logits.grad_fn
    if node is None or type(node).__name__ != "SliceBackward0" or not node.next_functions:
        return None
    parent = node.next_functions[0][0]
    # torch < 2.9 records the no-op ``:`` of ``x[:, :-1]`` as a slice of its own (dim 0, the whole extent):
    # a chain of slices from ``base`` is still a view of ``base`` with the geometry checked above
    for _ in range(base.dim()):
        if parent is None or type(parent).__name__ != "SliceBackward0" or not parent.next_functions:
            break
        parent = parent.next_functions[0][0]
    if base.grad_fn is not None:
        return base if parent is base.grad_fn else None
    return base if getattr(parent, "variable", None) is base else None
