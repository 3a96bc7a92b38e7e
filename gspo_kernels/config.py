"""Loss options, with the peers' names (TRL's ``GRPOConfig`` spelling)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gspo_kernels.checks import check_softcap, check_temperature, is_finite_number

IMPORTANCE_SAMPLING_LEVELS = ("sequence", "sequence_token", "token")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # the aggregations (TRL's names)
# Every loss_type: the four above (the clipped surrogate with that aggregation) and the objectives of TRL 1.16
# (cispo, sapo, luspo, vespo) and verl (gmpo = its "geo_mean"); see docs/math.md.
ALL_LOSS_TYPES = LOSS_TYPES + ("cispo", "sapo", "luspo", "vespo", "gmpo")
# ``aggregation`` values: the four of LOSS_TYPES and "seq_sum" = (1/S) sum_i sum_t l_it (LUSPO's, verl's
# seq-mean-token-sum).
AGGREGATIONS = LOSS_TYPES + ("seq_sum",)
# The aggregation each loss_type implies (TRL's _compute_loss); ``aggregation`` overrides it.
IMPLIED_AGGREGATION = {**{name: name for name in LOSS_TYPES}, "cispo": "dapo", "sapo": "grpo", "luspo": "seq_sum",
                       "vespo": "dapo", "gmpo": "grpo"}
# The per-token objective of each loss_type: "clip" is the PPO/GRPO/GSPO clipped surrogate.
OBJECTIVES = ("clip", "cispo", "sapo", "vespo", "gmpo")
OBJECTIVE_OF = {**{name: "clip" for name in LOSS_TYPES}, "luspo": "clip", "cispo": "cispo", "sapo": "sapo",
                "vespo": "vespo", "gmpo": "gmpo"}
CISPO_CLIPS = ("upper", "band")
ROLLOUT_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop",
                       "sequence_masked_tis")


@dataclass(frozen=True)
class GSPOConfig:
    """Options of the GSPO / GRPO objective (see ``docs/math.md``).

    Attributes:
        importance_sampling_level: ``"sequence"`` (GSPO), ``"sequence_token"`` (GSPO-token) or
            ``"token"`` (GRPO/PPO).
        loss_type: one of :data:`ALL_LOSS_TYPES`. ``"grpo"`` (seq-mean-token-mean), ``"bnpo"`` (token-mean),
            ``"dr_grpo"`` (sum / (S * max_completion_length)) and ``"dapo"`` (sum / num_items_in_batch) are the
            clipped surrogate with that aggregation; ``"cispo"``, ``"sapo"``, ``"luspo"``, ``"vespo"`` (TRL 1.16)
            and ``"gmpo"`` (verl's geo_mean) name an objective and the aggregation TRL gives it
            (:data:`IMPLIED_AGGREGATION`).
        epsilon_low, epsilon_high: clip band ``[1 - epsilon_low, 1 + epsilon_high]`` (GMPO: the log-space band
            ``[-epsilon_low, epsilon_high]``; CISPO with ``cispo_clip="upper"``: ``epsilon_high`` is the cap).
        delta: optional upper bound of the unclipped branch (two-sided clipping).
        beta: weight of the k3 KL term to the reference policy (needs ``ref_logprobs``).
        use_bias_correction_kl: multiply the KL term by the importance weight.
        temperature: logits are divided by it before the softmax.
        max_completion_length: the ``dr_grpo`` divisor; required by that loss type.
        entropy_coef: adds ``-entropy_coef * (masked token-mean entropy)`` to the loss.
        log_ratio_clamp: optional upper bound ``c`` on the log importance weight before ``exp`` (verl's
            numerical guard: 10 in its GSPO loss, 20 in its PPO loss): ``w = exp(min(log w, c))``, and no
            gradient flows through a clamped weight. None (the default) clamps nothing.
        aggregation: overrides the aggregation ``loss_type`` implies (:data:`IMPLIED_AGGREGATION`): one of
            :data:`AGGREGATIONS` (``"seq_sum"``: ``(1/S) sum_i sum_t l_it``).
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures for ``A > 0`` / ``A <= 0``.
        cispo_clip: ``"upper"`` (TRL/Liger: ``min(w, epsilon_high)``, ``epsilon_high`` an absolute cap such as
            5.0) or ``"band"`` (verl/slime/NeMo-RL: ``clamp(w, 1 - epsilon_low, 1 + epsilon_high)``).
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma weight
            ``phi(w) = exp(lambda + k log w - lambda w)``, ``(k, lambda)`` by the sign of ``A`` (``A >= 0``: pos).
        clip_ratio_c: dual clip (verl's name): for ``A < 0`` the clipped surrogate's loss is at most
            ``clip_ratio_c * |A|``; > 1, or None (off).
        off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence masking (TRL's name): a response with
            ``A < 0`` whose mean ``(rollout - logp)`` exceeds it contributes nothing. None: off.
        rollout_correction: the train/rollout mismatch correction computed from ``rollout_logprobs`` (one of
            :data:`ROLLOUT_CORRECTIONS`), with the bounds ``rollout_correction_max`` (C_max) and
            ``rollout_correction_min`` (C_min; icepop and sequence_masked_tis default it to 1 / C_max).
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
    aggregation: Optional[str] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    cispo_clip: str = "upper"
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    clip_ratio_c: Optional[float] = None
    off_policy_mask_threshold: Optional[float] = None
    rollout_correction: Optional[str] = None
    rollout_correction_max: Optional[float] = 3.0
    rollout_correction_min: Optional[float] = None
    final_logit_softcapping: Optional[float] = None

    @property
    def objective(self) -> str:
        """The per-token objective of ``loss_type`` (one of :data:`OBJECTIVES`)."""
        return OBJECTIVE_OF[self.loss_type]

    @property
    def effective_aggregation(self) -> str:
        """``aggregation`` when set, else the one ``loss_type`` implies (one of :data:`AGGREGATIONS`)."""
        return self.aggregation if self.aggregation is not None else IMPLIED_AGGREGATION[self.loss_type]

    @property
    def rollout_bounds(self):
        """``(C_min, C_max)`` of the rollout correction, None for an absent bound (icepop and
        sequence_masked_tis: ``C_min`` defaults to ``1 / C_max``)."""
        lo, hi = self.rollout_correction_min, self.rollout_correction_max
        if lo is None and hi is not None and self.rollout_correction in ("icepop", "sequence_masked_tis"):
            lo = 1.0 / hi
        return lo, hi

    def __post_init__(self) -> None:
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                f"got {self.importance_sampling_level!r}"
            )
        if self.loss_type not in ALL_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {ALL_LOSS_TYPES}, got {self.loss_type!r}")
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be None or one of {AGGREGATIONS}, got {self.aggregation!r}")
        for name in ("epsilon_low", "epsilon_high"):
            value = getattr(self, name)
            if not is_finite_number(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.epsilon_low >= 1:
            raise ValueError(f"epsilon_low must be < 1 (the band's low edge is 1 - epsilon_low), got {self.epsilon_low!r}")
        if self.delta is not None and (not is_finite_number(self.delta) or self.delta <= 1):
            raise ValueError(f"delta must be None or a finite number > 1, got {self.delta!r}")
        if not is_finite_number(self.beta) or self.beta < 0:
            raise ValueError(f"beta must be a finite number >= 0, got {self.beta!r}")
        check_temperature(self.temperature)
        if not is_finite_number(self.entropy_coef):
            raise ValueError(f"entropy_coef must be a finite number, got {self.entropy_coef!r}")
        if self.max_completion_length is not None and (
            isinstance(self.max_completion_length, bool)
            or not isinstance(self.max_completion_length, int)
            or self.max_completion_length < 1
        ):
            raise ValueError(
                f"max_completion_length must be None or a positive int, got {self.max_completion_length!r}"
            )
        if self.effective_aggregation == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("max_completion_length is required when loss_type='dr_grpo' (or aggregation='dr_grpo')")
        if self.log_ratio_clamp is not None and (not is_finite_number(self.log_ratio_clamp) or self.log_ratio_clamp <= 0):
            raise ValueError(f"log_ratio_clamp must be None or a finite number > 0, got {self.log_ratio_clamp!r}")
        if not isinstance(self.use_bias_correction_kl, bool):
            raise ValueError(f"use_bias_correction_kl must be a bool, got {self.use_bias_correction_kl!r}")
        self._check_objective_options()
        self._check_rollout_correction()
        check_softcap(self.final_logit_softcapping)

    def _check_objective_options(self) -> None:
        objective = self.objective
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            value = getattr(self, name)
            if not is_finite_number(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.cispo_clip not in CISPO_CLIPS:
            raise ValueError(f"cispo_clip must be one of {CISPO_CLIPS}, got {self.cispo_clip!r}")
        if objective == "cispo" and self.cispo_clip == "upper" and self.epsilon_high < 1:
            raise ValueError(
                f"epsilon_high is CISPO's absolute cap on the importance weight when loss_type='cispo' and "
                f"cispo_clip='upper' (TRL's convention, e.g. 5.0): it must be >= 1, got {self.epsilon_high!r} "
                f"(for the band [1 - epsilon_low, 1 + epsilon_high] set cispo_clip='band')"
            )
        for name in ("vespo_k_pos", "vespo_k_neg"):
            value = getattr(self, name)
            if not is_finite_number(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
            value = getattr(self, name)
            if not is_finite_number(value) or value < 1e-4:
                raise ValueError(f"{name} must be a finite number >= 1e-4 (TRL's floor), got {value!r}")
        if self.clip_ratio_c is not None:
            if not is_finite_number(self.clip_ratio_c) or self.clip_ratio_c <= 1:
                raise ValueError(f"clip_ratio_c must be None or a finite number > 1, got {self.clip_ratio_c!r}")
            if objective != "clip":
                raise ValueError(f"clip_ratio_c (the dual clip) applies to the clipped surrogate only "
                                 f"(loss_type in {LOSS_TYPES + ('luspo',)}), not loss_type={self.loss_type!r}")
        if self.delta is not None and objective != "clip":
            raise ValueError(f"delta (two-sided clipping) applies to the clipped surrogate only "
                             f"(loss_type in {LOSS_TYPES + ('luspo',)}), not loss_type={self.loss_type!r}")
        threshold = self.off_policy_mask_threshold
        if threshold is not None and (not is_finite_number(threshold) or threshold < 0):
            raise ValueError(f"off_policy_mask_threshold must be None or a finite number >= 0, got {threshold!r}")

    def _check_rollout_correction(self) -> None:
        mode, lo, hi = self.rollout_correction, self.rollout_correction_min, self.rollout_correction_max
        if mode is not None and mode not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout_correction must be None or one of {ROLLOUT_CORRECTIONS}, got {mode!r}")
        if hi is not None and (not is_finite_number(hi) or hi <= 0):
            raise ValueError(f"rollout_correction_max must be None or a finite number > 0, got {hi!r}")
        if lo is not None and (not is_finite_number(lo) or lo < 0):
            raise ValueError(f"rollout_correction_min must be None or a finite number >= 0, got {lo!r}")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"rollout_correction_min ({lo!r}) must be <= rollout_correction_max ({hi!r})")
        if mode is None:
            return
        if mode in ("token_mask", "sequence_mask") and lo is None and hi is None:
            raise ValueError(f"rollout_correction={mode!r} needs rollout_correction_max or rollout_correction_min")
        if mode in ("icepop", "sequence_masked_tis") and hi is None:
            raise ValueError(f"rollout_correction={mode!r} needs rollout_correction_max (C_max)")
        if self.objective == "vespo" and mode not in ("token_truncate", "token_mask", "icepop"):
            raise ValueError(
                f"loss_type='vespo' folds the rollout correction into its sequence weight token by token (TRL): "
                f"rollout_correction must be 'token_truncate', 'token_mask' or 'icepop', got {mode!r}"
            )


_DEFAULT_CONFIG: Optional[GSPOConfig] = None


def check_config(config: Optional[GSPOConfig]) -> GSPOConfig:
    """``config`` as given, or the defaults for None (one shared instance: the dataclass is frozen, so sharing
    it is safe, and a call does not re-run its validation); anything else is refused naming ``config``."""
    global _DEFAULT_CONFIG
    if config is None:
        if _DEFAULT_CONFIG is None:
            _DEFAULT_CONFIG = GSPOConfig()
        return _DEFAULT_CONFIG
    if not isinstance(config, GSPOConfig):
        raise TypeError(f"config must be a GSPOConfig, got {type(config).__name__}")
    return config
