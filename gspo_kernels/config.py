"""Loss options, with the peers' names (TRL's ``GRPOConfig`` spelling)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from gspo_kernels.checks import check_softcap, check_temperature

IMPORTANCE_SAMPLING_LEVELS = ("sequence", "sequence_token", "token")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass(frozen=True)
class GSPOConfig:
    """Options of the GSPO / GRPO objective (see ``docs/math.md``).

    Attributes:
        importance_sampling_level: ``"sequence"`` (GSPO), ``"sequence_token"`` (GSPO-token) or
            ``"token"`` (GRPO/PPO).
        loss_type: aggregation, ``"grpo"`` (seq-mean-token-mean), ``"bnpo"`` (token-mean),
            ``"dr_grpo"`` (sum / (S * max_completion_length)) or ``"dapo"`` (sum / num_items_in_batch).
        epsilon_low, epsilon_high: clip band ``[1 - epsilon_low, 1 + epsilon_high]``.
        delta: optional upper bound of the unclipped branch (two-sided clipping).
        beta: weight of the k3 KL term to the reference policy (needs ``ref_logprobs``).
        use_bias_correction_kl: multiply the KL term by the importance weight.
        temperature: logits are divided by it before the softmax.
        max_completion_length: the ``dr_grpo`` divisor; required by that loss type.
        entropy_coef: adds ``-entropy_coef * (masked token-mean entropy)`` to the loss.
        log_ratio_clamp: optional upper bound ``c`` on the log importance weight before ``exp`` (verl's
            numerical guard: 10 in its GSPO loss, 20 in its PPO loss): ``w = exp(min(log w, c))``, and no
            gradient flows through a clamped weight. None (the default) clamps nothing.
        final_logit_softcapping: optional logit soft cap ``c`` (Gemma 2/3, the model config's name): the
            logits become ``c * tanh(z / c)`` before the division by ``temperature``. None: no cap.
    """

    importance_sampling_level: str = "sequence"
    loss_type: str = "grpo"
    epsilon_low: float = 3e-4
    epsilon_high: float = 4e-4
    delta: Optional[float] = None
    beta: float = 0.0
    use_bias_correction_kl: bool = False
    temperature: float = 1.0
    max_completion_length: Optional[int] = None
    entropy_coef: float = 0.0
    log_ratio_clamp: Optional[float] = None
    final_logit_softcapping: Optional[float] = None

    def __post_init__(self) -> None:
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                f"got {self.importance_sampling_level!r}"
            )
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        for name in ("epsilon_low", "epsilon_high"):
            value = getattr(self, name)
            if not _finite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.epsilon_low >= 1:
            raise ValueError(f"epsilon_low must be < 1 (the band's low edge is 1 - epsilon_low), got {self.epsilon_low!r}")
        if self.delta is not None and (not _finite(self.delta) or self.delta <= 1):
            raise ValueError(f"delta must be None or a finite number > 1, got {self.delta!r}")
        if not _finite(self.beta) or self.beta < 0:
            raise ValueError(f"beta must be a finite number >= 0, got {self.beta!r}")
        check_temperature(self.temperature)
        if not _finite(self.entropy_coef):
            raise ValueError(f"entropy_coef must be a finite number, got {self.entropy_coef!r}")
        if self.max_completion_length is not None and (
            isinstance(self.max_completion_length, bool)
            or not isinstance(self.max_completion_length, int)
            or self.max_completion_length < 1
        ):
            raise ValueError(
                f"max_completion_length must be None or a positive int, got {self.max_completion_length!r}"
            )
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("max_completion_length is required when loss_type='dr_grpo'")
        if self.log_ratio_clamp is not None and (not _finite(self.log_ratio_clamp) or self.log_ratio_clamp <= 0):
            raise ValueError(f"log_ratio_clamp must be None or a finite number > 0, got {self.log_ratio_clamp!r}")
        if not isinstance(self.use_bias_correction_kl, bool):
            raise ValueError(f"use_bias_correction_kl must be a bool, got {self.use_bias_correction_kl!r}")
        check_softcap(self.final_logit_softcapping)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_config(config: Optional[GSPOConfig]) -> GSPOConfig:
    """``config`` as given, or the defaults for None; anything else is refused naming ``config``."""
    if config is None:
        return GSPOConfig()
    if not isinstance(config, GSPOConfig):
        raise TypeError(f"config must be a GSPOConfig, got {type(config).__name__}")
    return config
