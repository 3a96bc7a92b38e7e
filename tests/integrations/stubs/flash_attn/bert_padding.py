"""``flash_attn.bert_padding``'s padding helpers as OpenRLHF calls them, in plain PyTorch (tests only).

``unpad_input`` removes the positions whose attention mask is 0 (row-major order), ``pad_input`` puts rows back
at those positions (zeros elsewhere), ``index_first_axis`` picks rows; autograd differentiates all three.
"""

from __future__ import annotations

import torch
from einops import rearrange

__all__ = ["index_first_axis", "pad_input", "rearrange", "unpad_input"]


def index_first_axis(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``values[indices]`` along the first axis."""
    return values[indices]


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """``(rows, indices, cu_seqlens, max_seqlen, seqlens)`` of the unmasked positions of ``hidden_states
    [B, S, ...]`` (flash-attn 2.8's five returns; ``unused_mask`` is not supported)."""
    if unused_mask is not None:
        raise NotImplementedError("the test stand-in of unpad_input takes no unused_mask")
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return rows, indices, cu_seqlens, int(seqlens.max()) if seqlens.numel() else 0, seqlens


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """``[batch, seqlen, ...]`` holding the rows of ``hidden_states`` at the flat positions ``indices``, 0 elsewhere."""
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
