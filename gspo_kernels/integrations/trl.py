"""TRL drop-in: ``from gspo_kernels.integrations.trl import GRPOTrainer`` instead of ``from trl import ...``.

The subclass keeps everything of ``trl.GRPOTrainer`` (generation, rewards, advantages, old and reference
log-probs, logging) and replaces only ``_compute_loss``: the policy's last hidden states and lm_head
weight go to :func:`gspo_kernels.fused_linear_gspo_loss`, so the ``[B, T, V]`` logits are never formed
and the loss, clipping and metrics run in the library's kernels.

Honoured from ``GRPOConfig``: ``importance_sampling_level`` (``token``, ``sequence``, and
``sequence_token``, GSPO-token, which TRL's own trainer rejects), ``loss_type`` (``grpo``, ``bnpo``,
``dr_grpo``, ``dapo``), ``epsilon`` / ``epsilon_high``, ``delta``, ``beta`` with the reference model,
``use_bias_correction_kl``, ``temperature``, the vLLM ``importance_sampling_ratio``,
``num_items_in_batch`` and gradient accumulation (scaled as TRL scales them), a static ``entropy_coef``,
the MoE router auxiliary loss, ``cast_lm_head_to_fp32`` and a tool mask. Options it does not implement
raise a ``ValueError`` naming them when the trainer is built.

Logged under TRL's names: ``entropy``, ``kl`` (``beta > 0``), ``clip_ratio/low_mean``,
``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (and ``policy_loss``, ``entropy_coef``,
``aux_loss`` where TRL logs them), plus ``importance_weight/mean|min|max``. TRL's per-sequence
``clip_ratio/low_min`` and ``clip_ratio/high_max`` are not logged: the fused loss returns no per-token
log-probs to derive them from. Across processes, metrics are the mean of the per-process values.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
import trl

from gspo_kernels.config import LOSS_TYPES, GSPOConfig
from gspo_kernels.loss import fused_linear_gspo_loss

SUPPORTED_IMPORTANCE_LEVELS = ("token", "sequence", "sequence_token")
_MULTIMODAL_KEYS = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids", "num_images",
)


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose loss runs through :func:`gspo_kernels.fused_linear_gspo_loss`.

    Args:
        *args, **kwargs: those of ``trl.GRPOTrainer``.
        gspo_backend: the library backend (``"auto"``, ``"triton"``, ``"cpu"``, ``"torch"``).
    """

    def __init__(self, *args: Any, gspo_backend: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gspo_backend = gspo_backend
        self._check_supported()

    def _check_supported(self) -> None:
        args = self.args
        problems = []
        if self.loss_type not in LOSS_TYPES:
            problems.append(f"loss_type={self.loss_type!r} (supported: {', '.join(LOSS_TYPES)})")
        if self.importance_sampling_level not in SUPPORTED_IMPORTANCE_LEVELS:
            problems.append(
                f"importance_sampling_level={self.importance_sampling_level!r} "
                f"(supported: {', '.join(SUPPORTED_IMPORTANCE_LEVELS)})"
            )
        if self.top_entropy_quantile < 1.0:
            problems.append(f"top_entropy_quantile={self.top_entropy_quantile} (only 1.0)")
        if self.off_policy_mask_threshold is not None:
            problems.append("off_policy_mask_threshold (only None)")
        if getattr(self, "use_adaptive_entropy", False):
            problems.append("adaptive entropy control (only a static entropy_coef)")
        text_config = self.model.config.get_text_config()
        if getattr(text_config, "final_logit_softcapping", None) is not None:
            problems.append("models with final_logit_softcapping")
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            problems.append("loss_type='dr_grpo' without max_completion_length")
        if problems:
            raise ValueError(
                "gspo_kernels.integrations.trl.GRPOTrainer does not support: " + "; ".join(problems)
                + ". Use trl.GRPOTrainer for these options."
            )
        self._logit_scale = _logit_scale(text_config)
        if args.delta is not None and args.delta <= 1:
            raise ValueError(f"delta must be > 1, got {args.delta}")

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

        # Through the (possibly wrapped) model, so DDP / FSDP / PEFT hooks run; only the last position's
        # logits are formed, the completion's logits never are.
        forward_kwargs = {"output_router_logits": True} if self.aux_loss_enabled else {}
        with self.accelerator.autocast():
            outputs = model(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1,
                use_cache=False, **forward_kwargs,
            )
        hidden = outputs.hidden_states[-1][:, -C - 1 : -1]  # position t predicts token t + 1
        lm_head = self.accelerator.unwrap_model(model).get_output_embeddings()
        if not isinstance(lm_head, torch.nn.Linear) or hasattr(lm_head, "lora_A"):
            raise ValueError(
                f"gspo_kernels' GRPOTrainer needs a plain linear lm_head (its weight is the projection), got "
                f"{type(lm_head).__name__}; keep lm_head out of the adapter's target modules"
            )
        weight, bias = lm_head.weight, lm_head.bias
        if self.args.cast_lm_head_to_fp32 or hidden.dtype != weight.dtype:
            hidden = hidden.to(weight.dtype)

        entropy_coef = self.entropy_coef if self._entropy_bonus_enabled else 0.0
        num_items = None
        if self.loss_type == "dapo":
            # TRL's normalizer: num_items_in_batch spans the generation batch; rescale to one accumulation window
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            entropy_coef = entropy_coef / accumulation  # TRL scales the entropy bonus by accumulation only
        config = GSPOConfig(
            importance_sampling_level=self.importance_sampling_level,
            loss_type=self.loss_type,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=self.args.delta,
            beta=self.beta,
            use_bias_correction_kl=bool(self.args.use_bias_correction_kl),
            temperature=self.temperature / self._logit_scale,
            max_completion_length=self.max_completion_length,
            entropy_coef=entropy_coef,
        )
        is_ratio = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"]
        out = fused_linear_gspo_loss(
            hidden,
            weight,
            completion_ids,
            inputs["advantages"],
            inputs.get("old_per_token_logps"),
            bias=bias,
            mask=mask,
            ref_logprobs=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            is_ratio=is_ratio,
            num_items_in_batch=num_items,
            config=config,
            backend=self.gspo_backend,
        )
        loss = out.loss if self.loss_type == "dapo" else out.loss / accumulation
        metrics = self._metrics[mode]

        if self._entropy_bonus_enabled:
            policy_loss = out.loss.detach() + entropy_coef * out.metrics["entropy"]
            metrics["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / accumulation
            metrics["aux_loss"].append(self.accelerator.gather_for_metrics(outputs.aux_loss).mean().item())

        names = ["entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 "importance_weight/mean"]
        if self.beta != 0.0:
            names.append("kl")
        for name in names:
            metrics[name].append(self.accelerator.gather(out.metrics[name].reshape(1)).mean().item())
        metrics["importance_weight/min"].append(self.accelerator.gather(out.metrics["importance_weight/min"].reshape(1)).min().item())
        metrics["importance_weight/max"].append(self.accelerator.gather(out.metrics["importance_weight/max"].reshape(1)).max().item())
        return loss


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
