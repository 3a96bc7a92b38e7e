"""Loss options, with the peers' names (TRL's ``GRPOConfig`` spelling)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Tuple

from gspo_kernels.checks import check_softcap, check_temperature, is_finite_number

IMPORTANCE_SAMPLING_LEVELS = ("sequence", "sequence_token", "token")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # the aggregations (TRL's names)
# ``aggregation`` values: the four of LOSS_TYPES and "seq_sum" = (1/S) sum_i sum_t l_it (LUSPO's, verl's
# seq-mean-token-sum).
AGGREGATIONS = LOSS_TYPES + ("seq_sum",)
ROLLOUT_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop",
                       "sequence_masked_tis", "sequence_geometric_mask", "token_binary_kl_mask",
                       "sequence_binary_kl_mask", "token_tv_mask", "sequence_tv_mask")
# The rollout correction modes whose statistic is one per response (the others read one per token); see docs/math.md
ROLLOUT_SEQUENCE_MODES = ("sequence_truncate", "sequence_mask", "sequence_masked_tis", "sequence_geometric_mask",
                          "sequence_binary_kl_mask", "sequence_tv_mask")
# The modes that gate on a divergence of the sampled token's probability (engine vs trainer, each clamped to
# [ROLLOUT_PROBABILITY_CLAMP, 1 - ROLLOUT_PROBABILITY_CLAMP]): the binary KL or the total variation, and which
ROLLOUT_DIVERGENCES = {"token_binary_kl_mask": "binary_kl", "sequence_binary_kl_mask": "binary_kl",
                       "token_tv_mask": "tv", "sequence_tv_mask": "tv"}
ROLLOUT_PROBABILITY_CLAMP = 1e-6


class LossTypeRegistry(Protocol):
    """What the config reads of the objectives' registry. :mod:`gspo_kernels.objectives` hands itself over with
    :func:`use_registry` when it is imported (``import gspo_kernels`` imports it): the config imports no objective,
    the objectives import the config."""

    def loss_type(self, name: str) -> Any: ...  # a LossType: its ``objective`` and its implied ``aggregation``
    def loss_types(self) -> Tuple[Any, ...]: ...
    def objectives(self) -> Tuple[Any, ...]: ...
    def check_options(self, config: "GSPOConfig") -> None: ...


_registry: Optional[LossTypeRegistry] = None


def use_registry(registry: LossTypeRegistry) -> None:
    """The objectives' registry the config reads (called once, by :mod:`gspo_kernels.objectives`)."""
    global _registry
    _registry = registry


def _objectives() -> LossTypeRegistry:
    if _registry is None:  # not reachable through ``import gspo_kernels``, which imports the objectives
        raise RuntimeError("gspo_kernels.objectives has not registered the objectives: import gspo_kernels first")
    return _registry


# The tables of the objectives, read from their registry (gspo_kernels.objectives) at each access, so an
# objective registered later is in them:
#   ALL_LOSS_TYPES       every loss_type: the four above (the clipped surrogate with that aggregation) and the
#                        objectives of TRL 1.16 and verl; see docs/math.md
#   IMPLIED_AGGREGATION  the aggregation each loss_type implies (TRL's _compute_loss); ``aggregation`` overrides it
#   OBJECTIVES           the per-token objectives ("clip": the PPO/GRPO/GSPO clipped surrogate)
#   OBJECTIVE_OF         the per-token objective of each loss_type
_REGISTRY_TABLES = {
    "ALL_LOSS_TYPES": lambda: tuple(t.name for t in _objectives().loss_types()),
    "IMPLIED_AGGREGATION": lambda: {t.name: t.aggregation for t in _objectives().loss_types()},
    "OBJECTIVES": lambda: tuple(o.name for o in _objectives().objectives()),
    "OBJECTIVE_OF": lambda: {t.name: t.objective for t in _objectives().loss_types()},
}


def __getattr__(name: str):
    table = _REGISTRY_TABLES.get(name)
    if table is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return table()


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
            ``rollout_correction_min`` (C_min; icepop and sequence_masked_tis default it to 1 / C_max). The
            ``*_binary_kl_mask`` / ``*_tv_mask`` modes bound the sampled token's binary KL / total variation between
            the engine and the trainer (per token, or its mean over the response) by C_max (required: the trust
            region's delta) and C_min (optional).
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
        return _objectives().loss_type(self.loss_type).objective

    @property
    def effective_aggregation(self) -> str:
        """``aggregation`` when set, else the one ``loss_type`` implies (one of :data:`AGGREGATIONS`)."""
        return self.aggregation if self.aggregation is not None else _objectives().loss_type(self.loss_type).aggregation

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
        loss_types = tuple(t.name for t in _objectives().loss_types())
        if self.loss_type not in loss_types:
            raise ValueError(f"loss_type must be one of {loss_types}, got {self.loss_type!r}")
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be None or one of {AGGREGATIONS}, got {self.aggregation!r}")
        for name in ("epsilon_low", "epsilon_high"):
            value = getattr(self, name)
            if not is_finite_number(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.epsilon_low >= 1:
            raise ValueError(f"epsilon_low must be < 1 (the band's low edge is 1 - epsilon_low), got {self.epsilon_low!r}")
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
        self._check_rollout_correction()
        self._check_objective_options()
        check_softcap(self.final_logit_softcapping)

    def _check_objective_options(self) -> None:
        _objectives().check_options(self)  # each objective's options (its module's ``check``)
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
        if mode in ("token_mask", "sequence_mask", "sequence_geometric_mask") and lo is None and hi is None:
            raise ValueError(f"rollout_correction={mode!r} needs rollout_correction_max or rollout_correction_min")
        if mode in ROLLOUT_DIVERGENCES and hi is None:
            raise ValueError(f"rollout_correction={mode!r} needs rollout_correction_max (the largest "
                             f"{ROLLOUT_DIVERGENCES[mode]} divergence kept)")
        if mode in ("icepop", "sequence_masked_tis") and hi is None:
            raise ValueError(f"rollout_correction={mode!r} needs rollout_correction_max (C_max)")


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
