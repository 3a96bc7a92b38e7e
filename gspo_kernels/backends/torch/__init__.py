"""``backend="torch"``: the portable chunked heavy stage (any device); see ``linear.py``."""

from __future__ import annotations

from gspo_kernels.backends.torch.linear import linear_logprobs, logits_logprobs, make_backend

__all__ = ["linear_logprobs", "logits_logprobs", "make_backend"]
