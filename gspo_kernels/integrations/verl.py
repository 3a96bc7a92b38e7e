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
  a weight by at most ``e^-20``; the library does not).

``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` / ``clip_ratio_c``, ``loss_agg_mode``
(``token-mean``, ``token-sum``, ``seq-mean-token-mean``, ``seq-mean-token-sum``,
``seq-mean-token-sum-norm``) and ``config.global_batch_info`` (``dp_size``, ``batch_num_tokens``,
``global_batch_size``, ``loss_scale_factor``) are read from verl's actor config exactly as verl's
``agg_loss`` reads them; ``rollout_is_weights`` multiplies the per-token loss. Metrics:
``actor/pg_clipfrac``, ``actor/ppo_kl`` and ``actor/pg_clipfrac_lower`` (0 for the GSPO levels, like verl).
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
from gspo_kernels.loss import linear_logprobs, policy_loss
from gspo_kernels.parallel import VocabParallel

POLICY_LOSS_NAME = "gspo_kernels"
LEVEL_LOSS_NAMES = {
    "gspo_kernels_sequence_token": "sequence_token",
    "gspo_kernels_sequence": "sequence",
    "gspo_kernels_token": "token",
}
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
GSPO_LOG_RATIO_CLAMP = 10.0  # verl's compute_policy_loss_gspo: clamp(max=10) before exp
PPO_LOG_RATIO_CLAMP = 20.0  # verl's compute_policy_loss_vanilla: clamp(-20, 20) before exp


def register_policy_loss(importance_sampling_level: str = "sequence_token", *, backend: str = "auto") -> str:
    """Register ``"gspo_kernels"`` (at ``importance_sampling_level``) and the three per-level names.

    Returns ``"gspo_kernels"``; set ``actor_rollout_ref.actor.policy_loss.loss_mode`` to it (or to one of
    ``gspo_kernels_sequence_token``, ``gspo_kernels_sequence``, ``gspo_kernels_token``).
    """
    if importance_sampling_level not in LEVEL_LOSS_NAMES.values():
        raise ValueError(f"importance_sampling_level must be one of {tuple(LEVEL_LOSS_NAMES.values())}, "
                         f"got {importance_sampling_level!r}")
    core_algos.register_policy_loss(POLICY_LOSS_NAME)(make_policy_loss(importance_sampling_level, backend=backend))
    for name, level in LEVEL_LOSS_NAMES.items():
        core_algos.register_policy_loss(name)(make_policy_loss(level, backend=backend))
    return POLICY_LOSS_NAME


def make_policy_loss(importance_sampling_level: str, *, backend: str = "auto") -> Callable:
    """A function with verl's policy-loss signature computing the loss with :func:`gspo_kernels.policy_loss`."""

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
        cfg, clip_c = _gspo_config(config, importance_sampling_level)
        mask = response_mask.to(torch.bool)
        per_seq_mean = loss_agg_mode == "seq-mean-token-mean"
        out = policy_loss(
            log_prob, advantages, old_log_prob, mask=mask, is_ratio=rollout_is_weights,
            num_items_in_batch=None if per_seq_mean else 1.0,
            config=GSPOConfig(**{**cfg, "loss_type": "grpo" if per_seq_mean else "dapo"}), backend=backend,
        )
        loss = out.loss * _agg_scale(loss_agg_mode, mask, getattr(config, "global_batch_info", None) or {})

        with torch.no_grad():
            log_ratio = (log_prob.detach() - old_log_prob.detach()).float()
            if importance_sampling_level == "token":
                log_ratio = torch.clamp(log_ratio, min=-PPO_LOG_RATIO_CLAMP, max=PPO_LOG_RATIO_CLAMP)
            denom = mask.sum() + 1e-8
            ppo_kl = torch.where(mask, -log_ratio, 0.0).sum() / denom
            if importance_sampling_level == "token":  # verl's dual-clip share, computed as verl computes it
                adv = advantages.detach().float()
                ratio = torch.exp(log_ratio)
                clipped = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - cfg["epsilon_low"],
                                                                         1 + cfg["epsilon_high"]))
                lower = (clipped > -adv * clip_c) & (adv < 0)
                clipfrac_lower = torch.where(mask, lower.float(), 0.0).sum() / denom
            else:
                clipfrac_lower = torch.zeros(())
        metrics = {
            "actor/pg_clipfrac": out.metrics["clip_ratio/region_mean"].item(),
            "actor/ppo_kl": ppo_kl.item(),
            "actor/pg_clipfrac_lower": clipfrac_lower.item(),
        }
        return loss, metrics

    gspo_kernels_policy_loss.__qualname__ = f"gspo_kernels_policy_loss[{importance_sampling_level}]"
    return gspo_kernels_policy_loss


def _gspo_config(config: Any, level: str) -> Tuple[Dict[str, Any], float]:
    clip = _get(config, "clip_ratio", 0.2)
    low = _get(config, "clip_ratio_low", None)
    high = _get(config, "clip_ratio_high", None)
    low = clip if low is None else low
    high = clip if high is None else high
    cfg: Dict[str, Any] = dict(importance_sampling_level=level, epsilon_low=float(low), epsilon_high=float(high))
    clip_c = float(_get(config, "clip_ratio_c", 3.0))
    if level == "token":
        # verl's dual clip caps -A * ratio at -A * clip_ratio_c for A < 0: the library's two-sided clip
        # (delta) gives the same loss and gradient whenever clip_ratio_c > 1 + clip_ratio_high.
        if not clip_c > 1.0 + high:
            raise ValueError(f"clip_ratio_c must be > 1 + clip_ratio_high = {1.0 + high} for the gspo_kernels "
                             f"token-level loss (verl's dual clip), got {clip_c}")
        cfg.update(delta=clip_c, log_ratio_clamp=PPO_LOG_RATIO_CLAMP)
    else:
        cfg.update(log_ratio_clamp=GSPO_LOG_RATIO_CLAMP)
    return cfg, clip_c


def _get(config: Any, key: str, default: Any) -> Any:
    getter = getattr(config, "get", None)
    return getter(key, default) if callable(getter) else getattr(config, key, default)


def _agg_scale(mode: str, mask: Tensor, info: Dict[str, Any]) -> Any:
    """The factor turning the library's sum (or grpo mean over all rows) into verl's ``agg_loss``."""
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
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
    partial on each rank, as verl's kernel leaves it.
    """
    if reduction != "none":
        raise ValueError(f"the gspo_kernels linear_cross_entropy supports reduction='none' only, got {reduction!r}")
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
