"""``flash_attn.utils.distributed.all_gather`` on any torch.distributed backend (gloo included; tests only)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's tensor along dim 0; backward: this rank's slice of the gradient summed over ranks
    (what flash-attn's reduce-scatter gives)."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        ctx.rows = values.shape[0]
        parts = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, values.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows:(rank + 1) * ctx.rows], None


def all_gather(values: torch.Tensor, process_group) -> torch.Tensor:
    return _AllGather.apply(values, process_group)
