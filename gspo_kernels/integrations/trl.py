"""TRL drop-in: ``from gspo_kernels.integrations.trl import GRPOTrainer`` instead of ``from trl import ...``.

One log-prob path. TRL 1.16 computes every per-token log-prob (the old policy's in
``_generate_and_score_completions``, the reference model's, and the current policy's in ``_compute_loss``)
through ``_get_per_token_logps_and_entropies``, which calls the model with ``fused_lm_head=True``. This
subclass re-patches that forward on the policy and on the reference model: the backbone runs as before,
and the head is :func:`gspo_kernels.linear_logprobs` over the completion positions (hidden states and the
lm_head weight; the ``[B, T, V]`` logits never exist). Old, reference and current log-probs therefore
share one computation and one precision (:mod:`gspo_kernels.precision`: under ``bf16=True`` the autocast
dtype is the operand dtype, products accumulate in fp32, log-probs are fp32; a bf16 policy without
autocast gives bf16 operands; ``cast_lm_head_to_fp32`` gives fp32 operands), so an unchanged policy has
importance weights of exactly 1 up to the backbone's own rounding. The per-sequence stage (ratios,
clipping, KL, aggregation) is the library's (:func:`gspo_kernels.policy_loss`); ``_compute_loss`` is
the only other override.

Sharded heads: the head runs *inside* the model's forward, where the wrappers have gathered the
parameters: DDP; FSDP1 (``use_orig_params=True``, lm_head inside the root unit or any unit enclosing the
forward); FSDP2 (``fully_shard``; an lm_head that is its own unit has ``DTensor`` weight/bias, gathered
with ``full_tensor`` whose gradient is reduce-scattered back to ``Shard(0)`` and averaged over the
ranks, as FSDP2 averages every other gradient); DeepSpeed ZeRO-2 and ZeRO-3 (under ZeRO-3 the head reads
``lm_head.weight`` inside the model's forward, where DeepSpeed gathers it as an external parameter of the model for
its forward and backward, as for stock TRL's head; a weight still partitioned there is gathered by the library,
:mod:`gspo_kernels.distributed.zero3`). Refused with an error naming the wrapper: an lm_head that is its own FSDP1
unit (its weight still flat or empty in the enclosing forward).

Honoured from ``GRPOConfig``: ``loss_type`` (all eight of TRL 1.16: ``grpo``, ``dapo``, ``dr_grpo``, ``bnpo``,
``cispo``, ``sapo``, ``luspo``, ``vespo``, each with the objective and the aggregation TRL gives it),
``importance_sampling_level`` (``token``, ``sequence``, and ``sequence_token``, GSPO-token, which TRL's own trainer
rejects), ``epsilon`` / ``epsilon_high`` (CISPO: ``epsilon_high`` is the cap), ``delta``,
``sapo_temperature_pos|neg``, ``vespo_k_pos|neg`` / ``vespo_lambda_pos|neg``, ``beta`` with the reference model,
``use_bias_correction_kl``, ``temperature``, vLLM importance sampling (``vllm_importance_sampling_correction``
/ ``_mode`` / ``_clip_min`` / ``_clip_max``: the library computes the weights from the engine's log-probs,
:func:`gspo_kernels.policy_loss`'s ``rollout_logprobs``), ``num_items_in_batch`` and gradient accumulation
(scaled as TRL scales them), ``entropy_coef`` and adaptive entropy control (``use_adaptive_entropy``,
``entropy_coef_min|max|delta``, ``entropy_target``), ``top_entropy_quantile`` (entropy masking),
``off_policy_mask_threshold``, the MoE router auxiliary loss, ``cast_lm_head_to_fp32``, models with
``final_logit_softcapping`` (Gemma 2 / 3; the cap runs inside the fused head) and a tool mask. Options it
does not implement raise a ``ValueError`` naming them when the trainer is built.

Logged under TRL's names and with TRL's weighting across processes (token- or response-weighted
means from summed totals, min / max over the gathered per-response values): ``entropy``, ``kl``
(``beta > 0``), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``,
``clip_ratio/low_min``, ``clip_ratio/high_max`` (the clipped objectives), ``cispo_clip_ratio``,
``vespo/phi_seq_mean`` (and ``policy_loss``, ``entropy_coef``, ``aux_loss`` where TRL logs them), plus
``importance_weight/mean|min|max``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Dict, Optional

import torch
import trl
from trl.trainer.utils import FusedCausalLMOutput, nanmax, nanmin

from gspo_kernels import backends, objectives
from gspo_kernels.checks import check_bool, check_memory_budget, check_softcap
from gspo_kernels.config import GSPOConfig
from gspo_kernels.distributed import zero3
from gspo_kernels.integrations import adapter
from gspo_kernels.loss import fused_linear_gspo_loss, linear_logprobs, policy_loss
from gspo_kernels.objectives.clipped import clip_flags

# The head's memory_budget on CPU tensors when the caller gives none (bytes; see GRPOTrainer): the logits the cpu
# backend keeps between forward and backward. Smaller than the library's 1 GiB: a trainer's loss step holds the
# model's gradients (the lm_head's fp32 one alone is V*H*4 bytes, 0.54 GB for a 0.5B model) beside whatever the
# head keeps. Measured by benchmarks/trl_step.py (hidden 896, vocabulary 151936, 2048 completion tokens, fp32,
# single runs on 2 noisy cores): 256 MiB kept the peak at 0.43x stock TRL's where 1 GiB gave 0.60-0.61x; old pass
# + loss step took 21.0-22.7 s with 256 MiB, 20.1-21.6 s with 1 GiB, 22.7-26.4 s with 0.
CPU_MEMORY_BUDGET = 256 << 20
# On CUDA with gspo_one_pass (the Triton one-pass loss in the forward): the bytes of its chunk buffers, fp32 logits of
# C rows and a dZ store of 4 C rows (configs.one_pass_chunk_rows), where the library alone would size them from the
# device's free memory (1024 / 4096 rows: 1.9 GB at V = 151936). In a trainer they sit beside the model's
# activations at the top of the forward; 1 GiB holds 576 / 2304 rows at V = 151936, or 1024 / 1472 when the
# completions are 1024 tokens long (the chunks grow to the longest response). Measured on an H200 at the client
# shape with 576 rows (every completion then in two passes): 61.8 ms and 5.34 GiB peak against stock TRL's 58.5 ms
# and 4.28 GiB. The default route's two-pass head keeps the library's default (then 512 / 2048 rows, 0.93 GB:
# 58.6 ms and 5.22 GiB in the same session; now, with few rows against the vocabulary, its backward runs over
# vocabulary slices with 256 MiB of buffers and no copy of the head: PREDICTED ~4.04 GiB, docs/trl.md).
ONE_PASS_MEMORY_BUDGET = 1 << 30
_FSDP1_OWN_UNIT = (
    "an lm_head wrapped as its own FSDP (FullyShardedDataParallel) unit is not supported by gspo_kernels' "
    "GRPOTrainer; keep lm_head in the root FSDP unit (use_orig_params=True), or use FSDP2 (fully_shard) or DDP"
)
SUPPORTED_IMPORTANCE_LEVELS = ("token", "sequence", "sequence_token")
# TRL 1.16's loss types (its GRPOConfig.loss_type), in TRL's order; each maps onto the library's loss_type of the
# same name
TRL_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
CLIPPED_LOSS_TYPES = tuple(t.name for t in objectives.loss_types()  # the clipped surrogate: TRL logs clip_ratio/*
                           if t.name in TRL_LOSS_TYPES and t.objective == "clip")
# The GRPOConfig fields passed to GSPOConfig under the same name, by objective (TRL applies delta to the clipped
# surrogate only)
TRL_OBJECTIVE_OPTIONS = {
    "clip": ("delta",),
    "sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
    "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
}
# The metrics TRL logs as the library computes them (per process, averaged over processes)
_LIBRARY_METRICS = ("cispo_clip_ratio", "vespo/phi_seq_mean")
# TRL's vllm_importance_sampling_mode values, the library's rollout_correction modes of the same names
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _objective_is(name: str):
    """The trainer's loss_type runs the objective ``name``."""
    return lambda trainer: objectives.loss_type(trainer.loss_type).objective == name


def _vllm_is(trainer: Any) -> bool:
    return bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)


# TRL's options as the library's (read from the trainer, which holds GRPOConfig's values as TRL resolved them, and
# its ``args``): the same loss_type (objective and aggregation), TRL's option names. The options TRL has and the
# library does not are refused by name when the trainer is built.
TRL = adapter.Declaration("TRL", rules=(
    adapter.rename("importance_sampling_level"),
    adapter.rename("loss_type"),
    adapter.rename("epsilon_low"),
    adapter.rename("epsilon_high"),  # CISPO: the absolute cap on the weight, as in TRL
    adapter.rename("beta"),
    adapter.rename("use_bias_correction_kl", "args.use_bias_correction_kl", convert=bool),
    adapter.rename("max_completion_length"),
    adapter.rename("off_policy_mask_threshold"),
    adapter.constant("rollout_correction_max", None),
    # the objective's own options, TRL's names (the clipped surrogate: delta; SAPO's, VESPO's)
    *(adapter.rename(name, f"args.{name}", when=_objective_is(objective))
      for objective, names in TRL_OBJECTIVE_OPTIONS.items() for name in names),
), refusals=(
    adapter.Refusal("loss_type", lambda value: value in TRL_LOSS_TYPES,
                    "{option}={value!r} (supported: " + ", ".join(TRL_LOSS_TYPES) + ")"),
    adapter.Refusal("importance_sampling_level", lambda value: value in SUPPORTED_IMPORTANCE_LEVELS,
                    "{option}={value!r} (supported: " + ", ".join(SUPPORTED_IMPORTANCE_LEVELS) + ")"),
    adapter.Refusal("max_completion_length", bool, "loss_type='dr_grpo' without {option}",
                    when=lambda trainer: trainer.loss_type == "dr_grpo"),
    adapter.Refusal("vllm_importance_sampling_mode", lambda value: value in VLLM_IS_MODES,
                    "{option}={value!r} (supported: " + ", ".join(VLLM_IS_MODES) + ")", when=_vllm_is),
    adapter.Refusal("vllm_importance_sampling_mode", lambda value: False,
                    "{option}={value!r} without vllm_importance_sampling_clip_min or _clip_max",
                    when=lambda trainer: _vllm_is(trainer) and trainer.vllm_importance_sampling_mode in VLLM_IS_MODES
                    and trainer.vllm_importance_sampling_clip_min is None
                    and trainer.vllm_importance_sampling_clip_max is None),
))
# With TRL's vLLM importance sampling (the engine's log-probs given): mode, C_max and C_min map one-to-one
TRL_VLLM_IS = TRL.extend(
    adapter.rename("rollout_correction", "vllm_importance_sampling_mode"),
    adapter.rename("rollout_correction_max", "vllm_importance_sampling_clip_max"),
    adapter.rename("rollout_correction_min", "vllm_importance_sampling_clip_min"),
)
_MULTIMODAL_KEYS = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids", "num_images",
)


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose log-probs and loss run through the library (see the module docstring).

    Args:
        *args, **kwargs: those of ``trl.GRPOTrainer``.
        gspo_backend: the library backend (``"auto"``, ``"triton"``, ``"cpu"``, ``"torch"``).
        gspo_memory_budget: the head's ``memory_budget`` in bytes (see :func:`gspo_kernels.fused_linear_gspo_loss`):
            the logits the ``cpu`` backend keeps between the forward and the backward, the Triton loss's chunk
            buffers. ``None`` (default): :data:`CPU_MEMORY_BUDGET` (256 MiB) on CPU tensors,
            on CUDA the library's default (the two-pass head's buffers: 256 MiB when its backward runs over
            vocabulary slices, ``V >= 4 N``; else 0.93 GB at V = 151936), or
            :data:`ONE_PASS_MEMORY_BUDGET` (1 GiB) with ``gspo_one_pass``. 0 gives the least memory (the ``cpu``
            backend recomputes every logits tile).
        gspo_one_pass: the loss step computes the whole loss inside the model's forward with
            :func:`gspo_kernels.fused_linear_gspo_loss` (the Triton backend's one-pass loss: 6NHV FLOPs instead of
            8NHV) instead of TRL's log-probs, then the library's sequence stage, then a backward that recomputes the
            logits (default). Off by default: at the client shape measured on an H200 (hidden 2048, V = 151936,
            8 x 1024 completions, bf16 autocast) it took 1.056x stock TRL's step time and 1.25x its peak memory,
            against 1.008x and 1.22x for the default (``gspo-kernels bench --gpu``, trl-step; README), its chunks
            then shorter than one completion (each response in two passes; since fixed, predicted faster, not
            measured). The same loss and gradients either way; ignored (the default route) under TRL's top-entropy mask or entropy
            bonus, which need the entropies before the loss.
    """

    def __init__(self, *args: Any, gspo_backend: str = "auto", gspo_memory_budget: Optional[int] = None,
                 gspo_one_pass: bool = False, **kwargs: Any) -> None:
        if gspo_backend != "auto" and gspo_backend not in backends.BACKENDS:
            raise ValueError(f"gspo_backend must be one of {('auto',) + backends.BACKENDS}, got {gspo_backend!r}")
        check_bool("gspo_one_pass", gspo_one_pass)
        try:
            check_memory_budget(gspo_memory_budget)
        except ValueError as exc:
            raise ValueError(f"gspo_memory_budget: {exc}") from None
        super().__init__(*args, **kwargs)
        self.gspo_backend = gspo_backend
        self.gspo_one_pass = gspo_one_pass
        self._check_supported()
        # TRL added its fused head to these two models (before any wrapping); ours replaces it.
        head = dict(temperature=self.temperature, fp32_head=bool(self.args.cast_lm_head_to_fp32), backend=gspo_backend,
                    memory_budget=gspo_memory_budget)
        install_head(self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model, **head)
        if self.ref_model is not None:
            install_head(self.accelerator.unwrap_model(self.ref_model), **head)  # DeepSpeed wraps it (beta > 0)

    def _check_supported(self) -> None:
        args = self.args
        problems = adapter.refused(TRL, self)  # the options the declaration refuses, in its order
        if problems:
            raise ValueError(
                "gspo_kernels.integrations.trl.GRPOTrainer does not support: " + "; ".join(problems)
                + ". Use trl.GRPOTrainer for these options."
            )
        text_config = self.model.config.get_text_config()
        _logit_scale(text_config)
        _softcap(text_config)
        if args.delta is not None and args.delta <= 1:
            raise ValueError(f"delta must be > 1, got {args.delta}")
        try:  # the library's own checks of the options, now rather than at the first batch
            self._loss_config(rollout_correction=self.use_vllm and self.vllm_importance_sampling_correction)
        except ValueError as exc:
            raise ValueError(f"gspo_kernels' GRPOTrainer cannot run this GRPOConfig: {exc}") from None

    def _loss_config(self, *, rollout_correction: bool) -> GSPOConfig:
        """The library's options for TRL's (:data:`TRL`; with TRL's vLLM importance sampling, :data:`TRL_VLLM_IS`)."""
        return adapter.build_config(TRL_VLLM_IS if rollout_correction else TRL, self)

    def _one_pass_loss(self) -> bool:
        """Whether the loss runs inside the model's forward as :func:`gspo_kernels.fused_linear_gspo_loss` (its
        gradient formed in the same pass over the lm_head: 6NHV instead of the 8NHV of log-probs, then the
        loss, then a backward that recomputes the logits). Not when the loss needs the entropies before it can
        start (TRL's top-entropy mask) or adds TRL's entropy bonus on its own terms."""
        return self.gspo_one_pass and self.top_entropy_quantile >= 1.0 and not self._entropy_bonus_enabled

    def _compute_loss(self, model, inputs: Dict[str, Any]) -> torch.Tensor:
        extra = [key for key in _MULTIMODAL_KEYS if inputs.get(key) is not None]
        if extra:
            raise ValueError(f"gspo_kernels' GRPOTrainer handles text-only inputs; got {', '.join(extra)}")
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0

        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        C = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]

        advantages = inputs["advantages"]
        adv2d = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")

        # vLLM: the engine's log-probs. The library computes TRL's importance-sampling weights from them (the
        # mode and caps of vllm_importance_sampling_*; VESPO folds them into its sequence weight, as TRL does),
        # and the off-policy mask compares against them, as TRL's does.
        sampling = inputs.get("sampling_per_token_logps")
        vllm_is = bool(self.use_vllm and self.vllm_importance_sampling_correction)
        is_ratio = None
        if vllm_is and sampling is None:  # a caller that gives only the ready-made ratio
            is_ratio = inputs["importance_sampling_ratio"]
        config = self._gspo_config = self._loss_config(rollout_correction=vllm_is and sampling is not None)

        num_items = None
        if config.effective_aggregation == "dapo":
            # TRL's normalizer: num_items_in_batch spans the generation batch; rescale to one accumulation window
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        terms = dict(mask=mask, ref_logprobs=ref, is_ratio=is_ratio, rollout_logprobs=sampling,
                     num_items_in_batch=num_items, config=config)
        entropies = entropy_mask = None
        if self._one_pass_loss():
            # the loss inside the model's forward, its gradient formed there (fused_linear_gspo_loss)
            request = LossRequest(completion_ids, advantages, old, terms)
            model_inputs = dict(input_ids=input_ids, attention_mask=attention_mask)
            if self.aux_loss_enabled:
                model_inputs["output_router_logits"] = True
            with self.accelerator.autocast():
                outputs = model(**model_inputs, fused_lm_head=True, gspo_loss=request)
            out, logp, aux_loss = request.output, outputs.log_probs, outputs.aux_loss
        else:
            # TRL's own call, through the (possibly wrapped) model: our head runs inside the model's forward
            logp, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, C, compute_entropy=True, compute_aux_loss=self.aux_loss_enabled
            )
            loss_advantages = advantages
            if self.top_entropy_quantile < 1.0:  # TRL's top-entropy token mask (0/1) on the policy term
                entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
                entropy_mask = entropy_mask.to(logp.dtype)
                # each objective's policy term is linear in A at a fixed sign of A, so (A * m) drops a masked
                # token's policy term for m in {0, 1}, while its log-ratio still counts in the sequence weight and
                # the normalizers, as in TRL
                loss_advantages = adv2d.to(logp.dtype) * entropy_mask
            out = policy_loss(logp, loss_advantages, old, entropy=entropies, backend=self.gspo_backend, **terms)
        detached_loss = out.loss.detach()
        loss = out.loss if config.effective_aggregation == "dapo" else out.loss / accumulation
        metrics = self._metrics[mode]

        if self._entropy_bonus_enabled:
            # TRL's bonus: the mean entropy over the tokens the policy term acts on, scaled for accumulation only
            effective = mask if entropy_mask is None else mask * entropy_mask
            bonus = (entropies * effective).sum() / effective.sum().clamp(min=1.0)
            coef = self.entropy_coef
            if self.use_adaptive_entropy:  # the coefficient and gate of the previous optimizer step
                coef = coef if self._last_world_entropy <= self.args.entropy_target else 0.0
            loss = loss - coef * bonus / accumulation
            metrics["policy_loss"].append(self.accelerator.gather(detached_loss).nanmean().item())
            if self.use_adaptive_entropy and mode == "train":
                # the window's entropy: the library's entropy metric (token mean over the loss's tokens), or the
                # bonus's own mean when entropy masking narrows the tokens
                mean = out.metrics["entropy"] if entropy_mask is None else bonus.detach()
                count = effective.detach().sum().to(torch.float32)
                self._adapt_entropy_coef(torch.stack([mean.to(torch.float32) * count, count]))
            if mode == "train" and self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            metrics["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        self._log_loss_metrics(metrics, out.metrics, logp.detach(), old, adv2d, mask)
        return loss

    def _adapt_entropy_coef(self, stats: torch.Tensor) -> None:
        """TRL's adaptive entropy control (Skywork-OR1): sum ``[entropy total, token count]`` over the
        micro-batches of the accumulation window; at the optimizer step, reduce over processes, move
        ``entropy_coef`` by ``entropy_coef_delta`` towards more bonus when the window's mean entropy is at or below
        ``entropy_target`` (less otherwise, within ``[entropy_coef_min, entropy_coef_max]``), and remember the
        entropy for the next window's gate."""
        args = self.args
        window = self._entropy_window_stats
        self._entropy_window_stats = stats if window is None else window + stats
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    @torch.no_grad()
    def _log_loss_metrics(self, metrics, library, logp, old, adv2d, mask) -> None:
        """TRL's loss metrics, weighted across processes as TRL weights them (summed totals / gathered values).

        The formulas are the library's: ``entropy`` and ``kl`` are its metrics (token means over ``mask``,
        reduced here as token-weighted totals), the clip shares come from
        :func:`gspo_kernels.objectives.clipped.clip_flags`. What is TRL's own is the weighting: every response counts
        (empty ones too), the totals are summed over processes, the advantages are the unmasked ones (entropy
        masking changes the loss, not the metrics), and ``clip_ratio/low_min`` / ``high_max`` are taken over
        per-response shares. ``cispo_clip_ratio`` and ``vespo/phi_seq_mean`` are the library's per-process
        values, averaged over processes."""
        mask = mask.to(logp.dtype)
        tokens = mask.sum()

        def token_weighted(value: torch.Tensor) -> float:
            totals = torch.stack([value.to(logp.dtype) * tokens, tokens])
            totals = self.accelerator.reduce(totals, reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if "kl" in library:
            metrics["kl"].append(token_weighted(library["kl"]))
        metrics["entropy"].append(token_weighted(library["entropy"]))
        for name in _LIBRARY_METRICS:
            if name in library:
                metrics[name].append(self.accelerator.gather(library[name].reshape(1)).nanmean().item())

        log_ratio = (logp - (logp if old is None else old.to(logp.dtype))) * mask
        per_sequence = self.importance_sampling_level != "token"
        if per_sequence:  # one weight per response ([B, 1]); every response counts, as in TRL
            weight = torch.exp(log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))
            valid = torch.ones_like(weight, dtype=torch.bool)
        else:
            weight = torch.exp(log_ratio)
            valid = mask > 0

        def weighted_mean(x: torch.Tensor, sequence_values: bool) -> float:
            if sequence_values:
                totals = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
            else:
                totals = torch.stack([(x * mask).sum(), mask.sum()])
            totals = self.accelerator.reduce(totals, reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def per_response(x: torch.Tensor) -> torch.Tensor:
            return x.squeeze(1) if per_sequence else (x * mask).sum(-1) / mask.sum(-1)

        if self.loss_type in CLIPPED_LOSS_TYPES:
            low, high = clip_flags(weight, adv2d, self._gspo_config)
            low, high = low.to(logp.dtype), high.to(logp.dtype)
            region = ((low + high) > 0).to(logp.dtype)
            metrics["clip_ratio/low_mean"].append(weighted_mean(low, per_sequence))
            metrics["clip_ratio/high_mean"].append(weighted_mean(high, per_sequence))
            metrics["clip_ratio/region_mean"].append(weighted_mean(region, per_sequence))
            metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(per_response(low))).item())
            metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(per_response(high))).item())
        metrics["importance_weight/mean"].append(weighted_mean(weight, per_sequence))
        w = weight.expand_as(mask) if per_sequence else weight
        keep = valid.expand_as(mask) if per_sequence else valid
        inf = torch.tensor(float("inf"), device=w.device, dtype=w.dtype)
        wmin = self.accelerator.gather(torch.where(keep, w, inf).amin().reshape(1)).min()
        wmax = self.accelerator.gather(torch.where(keep, w, -inf).amax().reshape(1)).max()
        metrics["importance_weight/min"].append(wmin.item() if torch.isfinite(wmin) else 1.0)
        metrics["importance_weight/max"].append(wmax.item() if torch.isfinite(wmax) else 1.0)


class LossRequest:
    """What the model's forward needs to compute the loss itself (``model(..., gspo_loss=request)``): the
    completions (the labels of the last ``C`` positions), the advantages, the old log-probs and the other
    keywords of :func:`gspo_kernels.fused_linear_gspo_loss`. The forward leaves the ``LossOutput`` in
    ``output``; it returns the loss and the detached per-token log-probs (0 where the mask is 0)."""

    def __init__(self, completion_ids: torch.Tensor, advantages: torch.Tensor, old: Optional[torch.Tensor],
                 terms: Dict[str, Any]) -> None:
        self.completion_ids, self.advantages, self.old, self.terms = completion_ids, advantages, old, terms
        self.output = None


def install_head(model, *, temperature: float, fp32_head: bool, backend: str,
                 memory_budget: Optional[int] = None) -> None:
    """Make ``model(..., labels=labels, fused_lm_head=True)`` score the labels through the library.

    Replaces the fused head TRL's ``add_fused_lm_head`` installed (any other call goes to the forward
    it replaced). Returns TRL's ``FusedCausalLMOutput`` (``log_probs``, ``entropy``, ``label_mask``,
    ``loss``, ``aux_loss``), per-token fields fp32 and zero where the label is ``-100``. Call it before
    the model is wrapped (DDP / FSDP / DeepSpeed): the wrappers then run this forward with their
    parameters gathered.
    """
    previous = model.forward
    text_config = model.config.get_text_config()
    scale = _logit_scale(text_config)
    # TRL's head: logits s * (h W^T + b), then the Gemma soft cap c tanh(z / c), then / temperature. With z' the
    # unscaled logits, c tanh(s z' / c) / T = (c / s) tanh(z' / (c / s)) / (T / s): the library's head with the
    # cap c / s and the temperature T / s.
    softcap = _softcap(text_config)
    cap = {} if softcap is None else {"final_logit_softcapping": softcap / scale}

    def head_loss(hidden, head, request: LossRequest):
        """The loss of ``request`` over the completion positions' hidden states, in the forward."""
        labels = request.completion_ids
        weight, bias = _gathered(head, hidden.shape[-1])
        hidden = hidden[:, -labels.shape[1] - 1:-1].to(weight.device)
        # the head's temperature and cap in the config, as linear_logprobs gets them on the other path
        config = dataclasses.replace(request.terms["config"], temperature=temperature / scale,
                                     final_logit_softcapping=cap.get("final_logit_softcapping"))
        logp = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
        request.output = fused_linear_gspo_loss(
            hidden, weight, labels, request.advantages, request.old, bias=bias, backend=backend,
            fp32_head=fp32_head, memory_budget=head_memory_budget(memory_budget, hidden.device, one_pass=True),
            logprobs_out=logp,
            **{**request.terms, "config": config},
        )
        return request.output.loss, logp

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                gspo_loss: Optional[LossRequest] = None, **kwargs):
        if not fused_lm_head:
            passed = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
            return previous(*args, **{k: v for k, v in passed.items() if v is not None}, **kwargs)
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        backbone = self.base_model(*args, **kwargs)
        head = self.get_output_embeddings()
        _check_head(head)
        aux_loss = _router_aux_loss(backbone, text_config, kwargs)
        if gspo_loss is not None:
            loss, log_probs = head_loss(backbone.last_hidden_state, head, gspo_loss)
            return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=None, label_mask=None,
                                       aux_loss=aux_loss)
        if shift_labels is None:
            hidden, labels = backbone.last_hidden_state[:, :-1], labels[:, 1:]
        else:
            hidden, labels = backbone.last_hidden_state, shift_labels
        weight, bias = _gathered(head, hidden.shape[-1])
        hidden, labels = hidden.to(weight.device), labels.to(weight.device)
        mask = labels != -100
        logp, entropy = linear_logprobs(
            hidden[mask], weight, labels[mask], bias=bias, temperature=temperature / scale, return_entropy=True,
            backend=backend, fp32_head=fp32_head, memory_budget=head_memory_budget(memory_budget, hidden.device),
            **cap,
        )
        # masked_scatter keeps the outputs connected to the graph even when no label is valid
        log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
        entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / count
        if aux_loss is not None:
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask, aux_loss=aux_loss)

    model.forward = types.MethodType(forward, model)


def _check_head(head) -> None:
    """The lm_head the fused head can use: a plain ``nn.Linear`` that is not its own FSDP1 unit."""
    if type(head).__name__ == "FullyShardedDataParallel":
        raise ValueError(_FSDP1_OWN_UNIT)
    if not isinstance(head, torch.nn.Linear) or hasattr(head, "lora_A"):
        raise ValueError(
            "gspo_kernels' GRPOTrainer needs a plain linear lm_head (its weight is the projection), got "
            f"{type(head).__name__}; keep lm_head out of the adapter's target modules"
        )


def _router_aux_loss(backbone, text_config, kwargs) -> Optional[torch.Tensor]:
    """The MoE load-balancing loss of the forward (as TRL's head computes it) when router logits were asked."""
    if not kwargs.get("output_router_logits"):
        return None
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func(backbone.router_logits, text_config.num_experts, text_config.num_experts_per_tok,
                                    kwargs.get("attention_mask"))


def head_memory_budget(memory_budget: Optional[int], device: torch.device, *, one_pass: bool = False) -> Optional[int]:
    """The ``memory_budget`` of a head call: the caller's, else :data:`CPU_MEMORY_BUDGET` on CPU and, elsewhere,
    :data:`ONE_PASS_MEMORY_BUDGET` for the one-pass loss, the library's default (None) for the other calls."""
    if memory_budget is not None:
        return memory_budget
    if device.type == "cpu":
        return CPU_MEMORY_BUDGET
    return ONE_PASS_MEMORY_BUDGET if one_pass else None


def _gathered(head: torch.nn.Linear, hidden_size: int):
    """The lm_head's full ``[V, H]`` weight and ``[V]`` bias as seen inside the model's forward."""
    weight, bias = head.weight, head.bias
    try:
        from torch.distributed.tensor import DTensor, Partial
    except ImportError:  # pragma: no cover - torch without torch.distributed
        DTensor = None
    if DTensor is not None and isinstance(weight, DTensor):
        # FSDP2, lm_head its own unit: all-gather; the gradient of the full tensor is each rank's partial
        # contribution, reduce-scattered back to the sharded parameter and averaged, as FSDP2 averages
        grad = [Partial("avg")] * weight.device_mesh.ndim
        weight = weight.full_tensor(grad_placements=grad)
        if bias is not None:
            bias = bias.full_tensor(grad_placements=grad)
        return weight, bias
    if zero3.is_zero3_param(weight):  # DeepSpeed ZeRO-3: the library gathers it for the call, forward and backward
        return weight, bias
    if weight.dim() != 2 or weight.shape[-1] != hidden_size:
        raise ValueError(f"the lm_head weight is sharded where the head runs (shape {tuple(weight.shape)}): "
                         + _FSDP1_OWN_UNIT)
    return weight, bias


def _logit_scale(text_config) -> float:
    """The multiplier a model applies to its logits (TRL's reading of the config); 1.0 for most models."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1.0 / scaling
    scale = 1.0 if scale is None else float(scale)
    if scale <= 0:
        raise ValueError(f"gspo_kernels' GRPOTrainer needs a positive logit scale, got {scale}")
    return scale




def _softcap(text_config) -> Optional[float]:
    """The model's ``final_logit_softcapping`` (Gemma 2 / 3: logits ``c tanh(z / c)``), None when it has none."""
    return check_softcap(getattr(text_config, "final_logit_softcapping", None))
