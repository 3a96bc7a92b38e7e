"""LUSPO: the clipped surrogate summed over each response's tokens, averaged over responses (the ``seq_sum``
aggregation; TRL 1.16's ``loss_type="luspo"``)."""

from __future__ import annotations

from gspo_kernels.objectives.registry import LossType

LOSS_TYPE = LossType("luspo", "clip", "seq_sum")
ORDER = 30  # its place in the registry (gspo_kernels.objectives): after the clipped surrogate
