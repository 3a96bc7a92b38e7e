"""How :class:`~gspo_kernels.train.hf_trainer.GSPOTrainer` reaches a causal LM's parts: its decoder, its lm_head
(weight, bias, soft cap), the check that the hidden-state path computes the model's own logits, and the models
it refuses (:class:`UnsupportedModelError`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from gspo_kernels.config import GSPOConfig
from gspo_kernels.distributed import zero3


class UnsupportedModelError(ValueError):
    """The model's logits are not ``lm_head(last hidden state)``, or its lm_head / decoder is not found."""


@dataclass
class CausalLMParts:
    """The pieces of a causal LM the fused loss needs: the backbone and the lm_head's parameters."""

    decoder: nn.Module
    weight: nn.Parameter  # [V, H]
    bias: Optional[nn.Parameter]  # [V] or None
    softcap: Optional[float] = None  # the model's final_logit_softcapping (logits = c tanh(lm_head(h) / c))


def causal_lm_parts(model: nn.Module) -> CausalLMParts:
    """The decoder (``model.get_decoder()``) and the lm_head (``model.get_output_embeddings()``) of ``model``.

    ``softcap`` is the model's ``final_logit_softcapping`` (None when it has none). Raises
    :class:`UnsupportedModelError` for a model whose logits are otherwise transformed after the lm_head
    (``logit_scale``, ``logits_scaling``) or that lacks either piece.
    """
    cfg = getattr(model, "config", None)
    text_cfg = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    name = type(model).__name__
    softcap = getattr(text_cfg, "final_logit_softcapping", None) if text_cfg is not None else None
    for attr, neutral, why in (
        ("logit_scale", 1.0, "the fused loss does not scale the logits"),
        ("logits_scaling", 1.0, "the fused loss does not scale the logits"),
    ):
        value = getattr(text_cfg, attr, neutral) if text_cfg is not None else neutral
        if value is not None and value != neutral:
            raise UnsupportedModelError(
                f"{name} has config.{attr} = {value!r}: {why}; GSPOTrainer needs logits = lm_head(hidden) "
                f"(set config.{attr} = {neutral!r} only if that is what you want to train)"
            )
    if not hasattr(model, "get_output_embeddings") or not hasattr(model, "get_decoder"):
        raise UnsupportedModelError(f"{name} is not a transformers PreTrainedModel (no get_output_embeddings / "
                                    "get_decoder)")
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(head, nn.Linear) or not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        raise UnsupportedModelError(
            f"{name}.get_output_embeddings() returned {type(head).__name__}, not an nn.Linear lm_head; "
            "GSPOTrainer needs a causal LM head (e.g. AutoModelForCausalLM)"
        )
    decoder = model.get_decoder()
    if decoder is model:
        raise UnsupportedModelError(f"{name}.get_decoder() returned the model itself; no separate backbone found")
    return CausalLMParts(decoder, weight, head.bias, None if softcap is None else float(softcap))


def _with_model_softcap(config: GSPOConfig, softcap: Optional[float], model_name: str) -> GSPOConfig:
    """The loss options with the model's logit soft cap: the model's value when the options give none; a
    different value given in the options is refused (the loss would not be the model's)."""
    given = config.final_logit_softcapping
    if given is None:
        return config if softcap is None else dataclasses.replace(config, final_logit_softcapping=softcap)
    if softcap is None or float(given) != softcap:
        raise ValueError(f"final_logit_softcapping={given!r} was given but {model_name} has "
                         f"config.final_logit_softcapping = {softcap!r}; GSPOTrainer takes the cap from the model "
                         "(leave the option unset)")
    return config


@torch.no_grad()
def check_logits_path(model: nn.Module, parts: CausalLMParts, vocab_ids: Sequence[int], *, atol: float = 1e-3) -> float:
    """Compare ``model(ids).logits`` with ``lm_head(decoder(ids).last_hidden_state)`` on a short probe.

    Returns the largest absolute difference; raises :class:`UnsupportedModelError` when it exceeds
    ``max(atol, 8 * eps(weight dtype))`` relative to the logits' scale (the model does something between
    the two that the fused loss would miss). Catches e.g. a rescaling; a soft-cap far above the probe's
    logits changes them too little to see, which is why the named config attributes are checked first.
    """
    device = parts.weight.device
    ids = torch.tensor([list(vocab_ids)], device=device)
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids, use_cache=False).logits.float()
        hidden = _last_hidden(parts.decoder, ids, None, None)
    finally:
        model.train(was_training)
    ours = torch.nn.functional.linear(hidden, parts.weight, parts.bias).float()  # as the model computes it
    if parts.softcap is not None:
        ours = parts.softcap * torch.tanh(ours / parts.softcap)
    if ours.shape != logits.shape:
        raise UnsupportedModelError(f"{type(model).__name__}: the lm_head gives logits {tuple(ours.shape)} but the "
                                    f"model gives {tuple(logits.shape)}")
    diff = float((ours - logits).abs().max())
    scale = max(1.0, float(logits.abs().max()))
    tol = max(atol, 8 * torch.finfo(parts.weight.dtype).eps) * scale  # bf16 / fp16 rounding
    if not diff <= tol:
        raise UnsupportedModelError(
            f"{type(model).__name__}: model(ids).logits differs from lm_head(get_decoder()(ids).last_hidden_state) "
            f"by {diff:.3g}; the model transforms its logits in a way GSPOTrainer does not know"
        )
    return diff


def _last_hidden(decoder: nn.Module, input_ids: Tensor, attention_mask: Optional[Tensor],
                 position_ids: Optional[Tensor]) -> Tensor:
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:
        raise UnsupportedModelError(f"{type(decoder).__name__} returned no last_hidden_state")
    return hidden


def _refuse_deepspeed(model: nn.Module) -> None:
    """GSPOTrainer owns its optimizer steps and copies the model (reference, old policy): not a DeepSpeed engine's."""
    if type(model).__name__ == "DeepSpeedEngine" or any(zero3.is_zero3_param(p) for p in model.parameters()):
        raise ValueError(
            "GSPOTrainer does not run under DeepSpeed (it takes its own optimizer steps and copies the model); under "
            "DeepSpeed ZeRO-2 / ZeRO-3 use the TRL drop-in (gspo_kernels.integrations.trl.GRPOTrainer) or the loss in "
            "a loop of your own (docs/deepspeed.md)"
        )
