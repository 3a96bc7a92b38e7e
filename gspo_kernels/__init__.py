"""Fused kernels for the GSPO / GRPO reinforcement-learning loss.

Public API: :class:`GSPOConfig`, :func:`gspo_loss`, :func:`fused_linear_gspo_loss`,
:func:`token_logprobs`, :func:`linear_logprobs`, :func:`group_advantages`, :class:`GSPOLoss`,
:class:`FusedLinearGSPOLoss`, :class:`LossOutput`, :func:`policy_loss` (the loss from per-token log-probs),
:class:`VocabParallel` (a vocabulary-parallel lm_head); the float64 oracle is :mod:`gspo_kernels.reference`.
"""

from gspo_kernels import config as _config
from gspo_kernels import objectives as _objectives  # noqa: F401 (registers the objectives with the config)
from gspo_kernels.advantages import group_advantages
from gspo_kernels.backends import available as available_backends
from gspo_kernels.config import GSPOConfig
from gspo_kernels.loss import (
    FusedLinearGSPOLoss,
    GSPOLoss,
    fused_linear_gspo_loss,
    gspo_loss,
    linear_logprobs,
    policy_loss,
    token_logprobs,
)
from gspo_kernels.objectives.stage import LossOutput
from gspo_kernels.parallel import VocabParallel

# the defaults' config built now, not at the first call: built under torch.compile, it would leave a guard on the
# module's global that fails at the next call (one more compilation of a compiled step that passes no config)
_config.check_config(None)

__version__ = "0.3.0.dev0"

__all__ = [
    "GSPOConfig",
    "LossOutput",
    "gspo_loss",
    "fused_linear_gspo_loss",
    "token_logprobs",
    "linear_logprobs",
    "group_advantages",
    "GSPOLoss",
    "FusedLinearGSPOLoss",
    "available_backends",
    "policy_loss",
    "VocabParallel",
]
