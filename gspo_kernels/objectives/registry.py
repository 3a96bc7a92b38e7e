"""The registry of objectives: what a module declares about its objective, and the tables derived from it.

An :class:`Objective` is the per-token math of one or more ``loss_type`` names (``config.objective``); a
:class:`LossType` is a name a user passes as ``GSPOConfig.loss_type``: the objective it runs and the
aggregation it implies. Every table that used to list the objectives by hand (``config.ALL_LOSS_TYPES``,
``IMPLIED_AGGREGATION``, ``OBJECTIVES``, ``OBJECTIVE_OF``, the Triton codes, the sequence kernels' metric rows) is
read from here, in registration order. It knows nothing of any framework: how TRL or verl name an objective and its
options, each framework's integration declares (``gspo_kernels.integrations``).

This module imports nothing of the package: ``config.py`` validates through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple


def _no_check(config: Any, active: bool) -> None:
    return None


def _no_metrics(w: Any, A: Any, valid: Any, config: Any) -> Dict[str, Any]:
    return {}


def _no_floats(config: Any) -> Tuple[float, ...]:
    return ()


def _no_option(config: Any) -> bool:
    return False


@dataclass(frozen=True)
class LossType:
    """A ``loss_type`` name: the objective it runs and the aggregation it implies (``aggregation`` overrides
    it)."""

    name: str
    objective: str
    aggregation: str


@dataclass(frozen=True)
class Objective:
    """One per-token objective, as its module declares it.

    Attributes:
        name: ``config.objective`` (e.g. ``"clip"``).
        loss_types: the ``loss_type`` names that run it.
        surrogate: the PyTorch stage's per-token loss, called by :func:`gspo_kernels.objectives.stage.gspo_objective`
            with keyword arguments only (``log_w``, ``log_ratio``, ``A``, ``A_live``, ``adv``, ``logp_m``,
            ``lengths``, ``denom``, ``fold``, ``factor``, ``inputs``, ``config``, ``metrics``; it takes the ones it
            needs and ``**_``). Returns ``(per-token loss [N], w_i [S] or None)``: ``w_i``, the one weight of
            each response that the ``importance_weight/*`` metrics count (``one_weight_per_response``).
        check: ``check(config, active)`` raises ``ValueError`` for an invalid option of this objective
            (``active``: ``config.objective`` is this one; the options' values are checked for every config).
        clip_metrics: ``clip_metrics(w, A, valid, config)``: its clip metrics (TRL's names) over the counted
            items (responses or tokens); the PyTorch stage adds the ``importance_weight/*`` statistics.
        folds_correction: the correction factor (``is_ratio``, the rollout correction) is folded into the
            objective's weight (passed as ``fold``) instead of multiplying its loss.
        loss_through_weight: its loss depends on the importance weight (at the ``"sequence"`` level the Triton
            kernel adds the gradient through the mean log-ratio).
        one_weight_per_response: the ``importance_weight/*`` metrics count one weight per response.
        metrics: ``(name, kernel slot)`` of the metrics it reports besides ``importance_weight/*``, the
            slot named as the Triton sequence kernel's output (``"O_HIGH"``): its rows of the metric table.
        triton_floats: ``triton_floats(config)``: its float options as the kernel's ``obj_a`` .. ``obj_d``.
        triton_option: ``triton_option(config)``: its constexpr option, the kernel's ``OBJ_OPTION``.
        h100: the sequence kernel launches ``gspo-kernels h100-report`` compiles for it: keyword arguments of
            ``configs._sequence_h100`` (``level``, constexpr flags, ``HAS_*`` inputs, ``ROLLOUT`` by name).
    """

    name: str
    loss_types: Tuple[LossType, ...]
    surrogate: Callable[..., Any]
    check: Callable[[Any, bool], None] = _no_check
    clip_metrics: Callable[..., Dict[str, Any]] = _no_metrics
    folds_correction: bool = False
    loss_through_weight: bool = False
    one_weight_per_response: bool = False
    metrics: Tuple[Tuple[str, str], ...] = ()
    triton_floats: Callable[[Any], Tuple[float, ...]] = _no_floats
    triton_option: Callable[[Any], bool] = _no_option
    h100: Tuple[Mapping[str, Any], ...] = ()


_OBJECTIVES: Dict[str, Objective] = {}
_LOSS_TYPES: Dict[str, LossType] = {}


def register(objective: Objective) -> Objective:
    """Add ``objective`` and its loss types (a name already taken is refused)."""
    if objective.name in _OBJECTIVES:
        raise ValueError(f"objective {objective.name!r} is already registered")
    for loss_type in objective.loss_types:
        register_loss_type(loss_type, _pending=objective)
    _OBJECTIVES[objective.name] = objective
    return objective


def register_loss_type(loss_type: LossType, *, _pending: Optional[Objective] = None) -> LossType:
    """Add a ``loss_type`` name running an objective already registered (or the one being registered)."""
    if loss_type.name in _LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type.name!r} is already registered")
    known = loss_type.objective in _OBJECTIVES or (_pending is not None and _pending.name == loss_type.objective)
    if not known:
        raise ValueError(f"loss_type {loss_type.name!r} names an unknown objective {loss_type.objective!r}")
    _LOSS_TYPES[loss_type.name] = loss_type
    return loss_type


def unregister(name: str) -> None:
    """Remove the objective ``name`` and its loss types (for tests that register one of their own)."""
    _OBJECTIVES.pop(name)
    for loss_type in [t for t in _LOSS_TYPES.values() if t.objective == name]:
        del _LOSS_TYPES[loss_type.name]


def objective(name: str) -> Objective:
    """The registered objective ``name``."""
    return _OBJECTIVES[name]


def objectives() -> Tuple[Objective, ...]:
    """Every registered objective, in registration order."""
    return tuple(_OBJECTIVES.values())


def loss_type(name: str) -> LossType:
    """The registered ``loss_type`` ``name``."""
    return _LOSS_TYPES[name]


def loss_types() -> Tuple[LossType, ...]:
    """Every registered ``loss_type``, in registration order."""
    return tuple(_LOSS_TYPES.values())


def check_options(config: Any) -> None:
    """Every objective's option checks for ``config`` (raises ``ValueError``)."""
    for obj in objectives():
        obj.check(config, obj.name == config.objective)
