"""verl integration: the library's sequence stage as a verl policy loss, its fused head as verl's.

Two calls, made in every process that builds verl's actor (each Ray worker), before training starts::

    from gspo_kernels.integrations import verl as gk_verl
    gk_verl.register_policy_loss()   # actor.policy_loss.loss_mode=gspo_kernels
    gk_verl.route_fused_kernels()    # actor.model.use_fused_kernels=True (either fused_kernels_backend)

:func:`register_policy_loss` adds policy losses to ``verl.trainer.ppo.core_algos``'s registry, with verl's
signature ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
-> (loss, metrics)``. The loss mode in verl's config picks the importance-sampling level:

* ``gspo_kernels`` - the level given to :func:`register_policy_loss` (default ``"sequence_token"``);
* ``gspo_kernels_sequence_token`` - GSPO-token, the same loss as verl's ``gspo`` (log-ratio clamped at 10);
* ``gspo_kernels_sequence`` - GSPO with the gradient through the sequence weight (verl's ``gspo``
  conventions: clamp at 10, no dual clip);
* ``gspo_kernels_token`` - GRPO / PPO, the same loss as verl's ``vanilla``: dual clip at ``clip_ratio_c``
  for negative advantages, log-ratio clamped at 20 above (verl also clamps it at -20 below, which changes
  a weight by at most ``e^-20``; the library does not);
* ``gspo_kernels_sapo``, ``gspo_kernels_cispo``, ``gspo_kernels_geo_mean`` - the library's SAPO, CISPO (the band
  clip) and GMPO, the same losses as verl's ``sapo``, ``cispo`` and ``geo_mean``.

``register_policy_loss(dual_clip=True)`` adds the dual clip at ``clip_ratio_c`` to the GSPO levels.
``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` / ``clip_ratio_c`` / ``tau_pos`` / ``tau_neg``,
``loss_agg_mode`` (``token-mean``, ``token-sum``, ``seq-mean-token-mean``, ``seq-mean-token-sum``,
``seq-mean-token-sum-norm``; verl's sapo always uses ``seq-mean-token-mean``, its geo_mean the mean over
responses) and ``config.global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``loss_scale_factor``) are read from verl's actor config exactly as verl reads them; ``rollout_is_weights``
multiplies the per-token loss (geo_mean: their geometric mean per response, as verl). Metrics:
``actor/pg_clipfrac``, ``actor/ppo_kl`` and ``actor/pg_clipfrac_lower``, as verl defines them for each mode.
The entropy bonus and the KL loss stay in verl (it adds them after the policy loss).

:func:`route_fused_kernels` replaces the two hidden-state heads verl patches into a model's forward
(``verl.models.transformers.monkey_patch.patch_forward_with_backends``): ``FusedLinearForPPO`` (the
``torch`` / ``liger`` fused backend) and the Triton ``linear_cross_entropy`` (the ``triton`` backend, also
Megatron's vocabulary-parallel head in ``verl.models.mcore``) by :func:`gspo_kernels.linear_logprobs`
with ``return_entropy=True``; with a tensor-parallel group the lm_head shard runs through
:class:`gspo_kernels.VocabParallel` (``dH`` left partial, as verl's kernel leaves it).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import verl.trainer.ppo.core_algos as core_algos
from torch import Tensor

from gspo_kernels.config import GSPOConfig
from gspo_kernels.integrations import adapter
from gspo_kernels.loss import linear_logprobs, policy_loss
from gspo_kernels.parallel import VocabParallel

POLICY_LOSS_NAME = "gspo_kernels"
LEVEL_LOSS_NAMES = {
    "gspo_kernels_sequence_token": "sequence_token",
    "gspo_kernels_sequence": "sequence",
    "gspo_kernels_token": "token",
}
# verl's sapo / cispo / geo_mean as the library's objectives, by the library's loss_type: the loss_mode names
# registered for it (``names``), how it reads verl's actor config (``rules``: the adapter's rules of its own
# options), ``log_ratio_clamp`` (verl clamps the log-ratio at 20), ``agg_mode`` (the
# ``loss_agg_mode`` verl always uses for it), ``per_response`` (one loss per response, the mean over rows, the rollout
# weights folded per response), ``clipfrac`` (the library's metrics reported as verl's ``pg_clipfrac`` and
# ``pg_clipfrac_lower``; None: 0)
_VERL_SPECS: Dict[str, Dict[str, Any]] = {
    # verl's cispo: the band [1 - clip_ratio_low, 1 + clip_ratio_high], the log-ratio clamp; its clip share
    "cispo": dict(names=("gspo_kernels_cispo",), rules=(adapter.constant("cispo_clip", "band"),), log_ratio_clamp=True,
                  clipfrac=("cispo_clip_ratio", None)),
    # verl's sapo: its tau_pos / tau_neg, the log-ratio clamp, always seq-mean-token-mean, no clip share
    "sapo": dict(names=("gspo_kernels_sapo",),
                 rules=(adapter.rename("sapo_temperature_pos", "tau_pos", default=1.0, convert=float),
                        adapter.rename("sapo_temperature_neg", "tau_neg", default=1.05, convert=float)),
                 log_ratio_clamp=True, agg_mode="seq-mean-token-mean", clipfrac=(None, None)),
    # verl's geo_mean: no clamp (verl leaves it commented out), one loss per response, its log-space clip shares
    "gmpo": dict(names=("gspo_kernels_geo_mean",), rules=(), log_ratio_clamp=False, per_response=True,
                 clipfrac=("clip_ratio/high_mean", "clip_ratio/low_mean")),
}
OBJECTIVE_LOSS_NAMES = {name: loss_type for loss_type, spec in _VERL_SPECS.items() for name in spec["names"]}
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
GSPO_LOG_RATIO_CLAMP = 10.0  # verl's compute_policy_loss_gspo: clamp(max=10) before exp
PPO_LOG_RATIO_CLAMP = 20.0  # verl's vanilla / sapo / cispo: clamp(-20, 20) before exp


def register_policy_loss(importance_sampling_level: str = "sequence_token", *, backend: str = "auto",
                         dual_clip: bool = False) -> str:
    """Register ``"gspo_kernels"`` (at ``importance_sampling_level``), the three per-level names and the three
    objectives (``gspo_kernels_sapo``, ``gspo_kernels_cispo``, ``gspo_kernels_geo_mean``).

    ``dual_clip``: the GSPO levels (``gspo_kernels``, ``gspo_kernels_sequence_token``,
    ``gspo_kernels_sequence``) also apply verl's dual clip at ``clip_ratio_c`` for negative advantages (the token
    level always does, as verl's ``vanilla``; verl's ``gspo`` does not).

    Returns ``"gspo_kernels"``; set ``actor_rollout_ref.actor.policy_loss.loss_mode`` to it (or to another of the
    registered names).
    """
    if importance_sampling_level not in LEVEL_LOSS_NAMES.values():
        raise ValueError(f"importance_sampling_level must be one of {tuple(LEVEL_LOSS_NAMES.values())}, "
                         f"got {importance_sampling_level!r}")
    if not isinstance(dual_clip, bool):
        raise ValueError(f"dual_clip must be a bool, got {dual_clip!r}")
    core_algos.register_policy_loss(POLICY_LOSS_NAME)(
        make_policy_loss(importance_sampling_level, backend=backend, dual_clip=dual_clip))
    for name, level in LEVEL_LOSS_NAMES.items():
        core_algos.register_policy_loss(name)(make_policy_loss(level, backend=backend, dual_clip=dual_clip))
    for name, loss_type in OBJECTIVE_LOSS_NAMES.items():
        core_algos.register_policy_loss(name)(make_policy_loss("token", loss_type=loss_type, backend=backend))
    return POLICY_LOSS_NAME


def make_policy_loss(importance_sampling_level: str, *, loss_type: str = "clip", backend: str = "auto",
                     dual_clip: bool = False) -> Callable:
    """A function with verl's policy-loss signature computing the loss with :func:`gspo_kernels.policy_loss`.

    ``loss_type``: ``"clip"`` (verl's ``vanilla`` / ``gspo`` at ``importance_sampling_level``), or ``"sapo"``,
    ``"cispo"``, ``"gmpo"`` (verl's ``sapo``, ``cispo``, ``geo_mean``; token-level ratios, the level is not used).
    """
    if loss_type not in ("clip",) + tuple(OBJECTIVE_LOSS_NAMES.values()):
        raise ValueError(f"loss_type must be 'clip' or one of {tuple(OBJECTIVE_LOSS_NAMES.values())}, "
                         f"got {loss_type!r}")
    if loss_type != "clip":
        importance_sampling_level = "token"
    declaration = verl_declaration(importance_sampling_level, loss_type, dual_clip)

    def gspo_kernels_policy_loss(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Optional[Any] = None,
        rollout_is_weights: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Dict[str, float]]:
        if config is None:
            raise ValueError("config (verl's actor config) is required by the gspo_kernels policy loss")
        _check_agg_mode(loss_agg_mode)
        mask = response_mask.to(torch.bool)
        info = getattr(config, "global_batch_info", None) or {}
        spec = _VERL_SPECS.get(loss_type) or {}
        if spec.get("agg_mode"):  # verl's SAPO always aggregates seq-mean-token-mean, whatever loss_agg_mode says
            loss_agg_mode = spec["agg_mode"]
        cfg = adapter.build_config(declaration, _CallOptions(config, loss_agg_mode))
        is_weights = rollout_is_weights
        if spec.get("per_response"):
            # verl's geo_mean: one loss per response, mean over every row of the micro-batch (neither loss_agg_mode
            # nor global_batch_info), the rollout weights folded per response as their geometric mean
            scale, num_items = 1.0, None
            if rollout_is_weights is not None:
                is_weights = _geometric_mean_weights(rollout_is_weights, mask)
        else:
            num_items = None if cfg.aggregation == "grpo" else 1.0
            scale = _agg_scale(loss_agg_mode, mask, info)
        out = policy_loss(log_prob, advantages, old_log_prob, mask=mask, is_ratio=is_weights,
                          num_items_in_batch=num_items, config=cfg, backend=backend)
        loss = out.loss * scale
        metrics = _verl_metrics(library=out.metrics, log_prob=log_prob, old_log_prob=old_log_prob,
                                advantages=advantages, mask=mask, cfg=cfg, loss_type=loss_type)
        return loss, metrics

    name = importance_sampling_level if loss_type == "clip" else loss_type
    gspo_kernels_policy_loss.__qualname__ = f"gspo_kernels_policy_loss[{name}]"
    return gspo_kernels_policy_loss


@torch.no_grad()
def _verl_metrics(library: Dict[str, Tensor], log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                  mask: Tensor, cfg: GSPOConfig, loss_type: str) -> Dict[str, float]:
    """verl's three metrics: ``actor/pg_clipfrac`` and ``actor/pg_clipfrac_lower`` from the library's clip shares
    where they are verl's (the clipped surrogate, CISPO's band, GMPO's log-space clip), verl's masked mean of
    ``-log ratio`` as ``actor/ppo_kl`` (clamped at +-20 where verl clamps)."""
    log_ratio = (log_prob.detach() - old_log_prob.detach()).float()
    spec = _VERL_SPECS.get(loss_type)
    if (spec is None or spec["log_ratio_clamp"]) and cfg.importance_sampling_level == "token":
        log_ratio = torch.clamp(log_ratio, min=-PPO_LOG_RATIO_CLAMP, max=PPO_LOG_RATIO_CLAMP)
    denom = mask.sum() + 1e-8
    ppo_kl = torch.where(mask, -log_ratio, 0.0).sum() / denom
    zero = 0.0
    if spec is not None:  # the objectives: the library's metrics they name (CISPO: tokens whose weight left the
        # band; GMPO: tokens whose log-ratio was clipped, A > 0 / A < 0; SAPO: none)
        high_name, low_name = spec["clipfrac"]
        clipfrac = library[high_name].item() if high_name else zero
        lower = library[low_name].item() if low_name else zero
    else:
        clipfrac, lower = library["clip_ratio/region_mean"].item(), zero
        clip_c = cfg.clip_ratio_c
        if clip_c is not None:  # verl's dual-clip share: -A w' above -A c for A < 0, with w' the clipped weight
            adv = advantages.detach().float()
            if cfg.importance_sampling_level != "token":  # the sequence weight, clamped as verl's gspo
                lengths = mask.sum(-1, keepdim=True).clamp(min=1)
                seq = torch.where(mask, log_ratio, 0.0).sum(-1, keepdim=True) / lengths
                log_ratio = torch.clamp(seq, max=GSPO_LOG_RATIO_CLAMP).expand_as(log_ratio)
            ratio = torch.exp(log_ratio)
            clipped = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - cfg.epsilon_low,
                                                                     1 + cfg.epsilon_high))
            share = (clipped > -adv * clip_c) & (adv < 0)
            lower = (torch.where(mask, share.float(), 0.0).sum() / denom).item()
    return {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl.item(), "actor/pg_clipfrac_lower": lower}


def _geometric_mean_weights(weights: Tensor, mask: Tensor) -> Tensor:
    """verl's geo_mean folding of per-token rollout weights into one per response:
    ``exp(sum_t log(w_t + 1e-10) / (|y| + 1e-8))`` over the response's tokens."""
    log_w = torch.where(mask, torch.log(weights.detach().float() + 1e-10), 0.0)
    return torch.exp(log_w.sum(-1) / (mask.sum(-1) + 1e-8))


class _CallOptions:
    """What a verl policy-loss call reads: verl's actor config (as verl reads it) and the call's ``loss_agg_mode``."""

    def __init__(self, config: Any, loss_agg_mode: str) -> None:
        self.config, self.loss_agg_mode = config, loss_agg_mode

    def get(self, key: str, default: Any) -> Any:
        return self.loss_agg_mode if key == "loss_agg_mode" else _get(self.config, key, default)


def _clip_side(side: str):
    """verl's ``clip_ratio_low`` / ``_high``, ``clip_ratio`` (default 0.2) where it is None."""
    def value(options: Any) -> float:
        own = adapter.read(options, side, None, "verl")
        return float(adapter.read(options, "clip_ratio", 0.2, "verl") if own is None else own)
    return value


def verl_declaration(level: str, loss_type: str = "clip", dual_clip: bool = False) -> adapter.Declaration:
    """How one registered verl loss reads verl's actor config (and the call's ``loss_agg_mode``) into the library's
    options, as verl reads them: the clip band, an objective's own options (:data:`_VERL_SPECS`), the log-ratio
    clamp, the dual clip's ``clip_ratio_c`` where it applies (refused unless > 1, as verl asserts) and the
    aggregation (``seq-mean-token-mean``: the mean of per-response means; else a sum the call scales as verl's)."""
    rules = [adapter.constant("importance_sampling_level", level),
             adapter.derived("epsilon_low", _clip_side("clip_ratio_low")),
             adapter.derived("epsilon_high", _clip_side("clip_ratio_high"))]
    refusals = []
    spec = _VERL_SPECS.get(loss_type)
    if spec is not None:  # an objective: its options read from verl's config
        rules += [adapter.constant("loss_type", loss_type), *spec["rules"]]
        if spec["log_ratio_clamp"]:
            rules.append(adapter.constant("log_ratio_clamp", PPO_LOG_RATIO_CLAMP))
    else:
        rules.append(adapter.constant("loss_type", "grpo"))  # the clipped surrogate
        if level == "token" or dual_clip:
            rules.append(adapter.rename("clip_ratio_c", default=3.0, convert=float))
            refusals.append(adapter.Refusal("clip_ratio_c", lambda c: c > 1.0, default=3.0, convert=float,
                                            problem="{option} (verl's dual clip) must be > 1.0, got {value}"))
        rules.append(adapter.constant("log_ratio_clamp", PPO_LOG_RATIO_CLAMP if level == "token"
                                      else GSPO_LOG_RATIO_CLAMP))
    if spec is not None and spec.get("per_response"):
        rules.append(adapter.constant("aggregation", "grpo"))
    else:
        rules.append(adapter.derived("aggregation", lambda options: "grpo" if adapter.read(
            options, "loss_agg_mode") == "seq-mean-token-mean" else "dapo"))
    return adapter.Declaration("verl", tuple(rules), tuple(refusals))


def _get(config: Any, key: str, default: Any) -> Any:
    getter = getattr(config, "get", None)
    return getter(key, default) if callable(getter) else getattr(config, key, default)


def _check_agg_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")


def _agg_scale(mode: str, mask: Tensor, info: Dict[str, Any]) -> Any:
    """The factor turning the library's sum (or grpo mean over all rows) into verl's ``agg_loss``."""
    dp_size = info.get("dp_size", 1) or 1
    if mode == "token-sum":
        return dp_size
    if mode == "token-mean":
        tokens = info.get("batch_num_tokens")
        if tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            tokens = mask.sum()
        return dp_size / _at_least_one(tokens)
    sequences = info.get("global_batch_size")
    if sequences is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        sequences = mask.any(dim=-1).sum()  # verl counts the responses with at least one token
    scale = dp_size / _at_least_one(sequences)
    if mode == "seq-mean-token-mean":
        return scale * mask.shape[0]  # the library's "grpo" divides by every row of the batch
    if mode == "seq-mean-token-sum-norm":
        factor = info.get("loss_scale_factor")
        return scale / (mask.shape[-1] if factor is None else factor)
    return scale


def _at_least_one(value: Any) -> Any:
    return value.clamp(min=1) if isinstance(value, Tensor) else max(value, 1)


# ----------------------------------------------------------------------------- the fused hidden-state head

class FusedLinearForPPO(torch.nn.Module):
    """Drop-in for ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (same constructor and
    ``forward(hidden_states, vocab_weights, input_ids, temperature) -> (log_probs, entropy)``).

    ``hidden_states``: ``[N, H]`` or ``[B, T, H]``; ``vocab_weights``: ``[V, H]``; ``input_ids``: token ids
    shaped like ``hidden_states[..., 0]``. Returns fp32 log-probs and the entropy in ``hidden_states``' dtype
    (as verl does), from :func:`gspo_kernels.linear_logprobs`.
    """

    backend = "auto"

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        self.chunk_size = chunk_size  # kept for verl's interface; the library picks its own tiling
        self.impl_backend = impl_backend

    def forward(self, hidden_states: Tensor, vocab_weights: Tensor, input_ids: Tensor,
                temperature: float = 1.0) -> Tuple[Tensor, Tensor]:
        logp, entropy = linear_logprobs(hidden_states, vocab_weights, input_ids.to(torch.int64),
                                        temperature=float(temperature), return_entropy=True, backend=self.backend)
        return logp, entropy.to(hidden_states.dtype)


_vocab_parallel_cache: Dict[Tuple[int, int], VocabParallel] = {}


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0,
                         reduction: str = "none", dist_process_group: Optional[Any] = None) -> Tuple[Tensor, Tensor]:
    """Drop-in for ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (``reduction="none"``).

    Without a process group: :func:`gspo_kernels.linear_logprobs` of ``hidden @ weight.T``. With one (verl's
    Megatron path): ``weight`` is this rank's ``[V / tp, H]`` shard of an evenly split vocabulary, rank
    ``r`` holding rows ``[r V/tp, (r+1) V/tp)`` as in verl's kernel, labels are global ids, and ``dH`` stays
    partial on each rank, as verl's kernel leaves it (verl's Megatron forward gathers the sequence-parallel
    hidden states with megatron's gather, whose backward reduce-scatters it).

    Outputs are shaped like ``labels`` when ``hidden`` is ``[*labels.shape, H]``. verl's Megatron forward passes
    Megatron's sequence-first ``[T, 1, H]`` with its packed ``[1, T]`` labels: when the two differ only by
    dimensions of size 1, both are flattened, as verl's kernel does, and the outputs are ``[T]``.
    """
    if reduction != "none":
        raise ValueError(f"the gspo_kernels linear_cross_entropy supports reduction='none' only, got {reduction!r}")
    if hidden.shape[:-1] != labels.shape and _non_unit(hidden.shape[:-1]) == _non_unit(labels.shape):
        hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    vp = None
    if dist_process_group is not None:
        import torch.distributed as dist

        local = weight.shape[0]
        key = (id(dist_process_group), local)
        vp = _vocab_parallel_cache.get(key)
        if vp is None:
            rank = dist.get_rank(dist_process_group)
            vp = VocabParallel(dist_process_group, rank * local, (rank + 1) * local, reduce_hidden_grad=False)
            _vocab_parallel_cache[key] = vp
    return linear_logprobs(hidden, weight, labels.to(torch.int64), temperature=float(temperature),
                           return_entropy=True, backend=FusedLinearForPPO.backend, vocab_parallel=vp)


def _non_unit(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


_TARGETS = (
    ("verl.utils.experimental.torch_functional", "FusedLinearForPPO", FusedLinearForPPO),
    ("verl.utils.kernel.linear_cross_entropy", "linear_cross_entropy", linear_cross_entropy),
    # modules that bind linear_cross_entropy at import time (patched when already imported)
    ("verl.models.mcore.model_forward_fused", "linear_cross_entropy", linear_cross_entropy),
    ("verl.models.mcore.model_forward_1f1b_overlap", "linear_cross_entropy", linear_cross_entropy),
)


def route_fused_kernels(*, backend: str = "auto") -> Callable[[], None]:
    """Route verl's fused hidden-state log-prob + entropy heads to :func:`gspo_kernels.linear_logprobs`.

    verl's patched forwards import ``FusedLinearForPPO`` / ``linear_cross_entropy`` from their modules at
    call time, so models patched before or after this call both use the library. Returns a function that
    restores verl's originals.
    """
    FusedLinearForPPO.backend = backend
    saved = []
    for module_name, attr, replacement in _TARGETS:
        if module_name.startswith("verl.models.mcore"):
            module = sys.modules.get(module_name)
            if module is None:
                continue
        else:
            module = importlib.import_module(module_name)
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, replacement)

    def restore() -> None:
        for module, attr, original in saved:
            setattr(module, attr, original)

    return restore
