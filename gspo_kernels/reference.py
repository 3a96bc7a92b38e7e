"""The oracle: plain PyTorch in float64, everything materialized, one response at a time.

Every formula is the one in ``docs/math.md``; nothing here is meant to be fast. Tests compare every
backend with these functions. Input validation is shared with the fast paths (``layout.py``);
the math is not.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from gspo_kernels.config import GSPOConfig
from gspo_kernels.objective import LossOutput
from gspo_kernels.validation import (
    LossInputs,
    check_linear,
    check_logits,
    prepare_loss_inputs,
)


def token_logprobs(
    logits: Tensor, labels: Tensor, *, temperature: float = 1.0, return_entropy: bool = False
):
    """``logp_t = z[y_t]/tau - logsumexp(z/tau)`` and ``H_t = -sum_v p log p`` in float64.

    ``logits [..., V]``, ``labels [...]`` in ``[0, V)``; returns float64 tensors shaped like labels.
    """
    check_logits(logits, labels, None)
    _check_label_range(labels, logits.shape[-1])
    logp_all = F.log_softmax(logits.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def naive_token_logprobs(logits: Tensor, labels: Tensor, *, temperature: float = 1.0) -> Tensor:
    """The plain PyTorch path in the logits' own dtype (``log_softmax`` + ``gather``), as fp32.

    Not an oracle: the precision baseline that bf16 / fp16 tolerances are measured against
    ("no worse than the plain PyTorch path in that dtype, plus a stated margin").
    """
    logp_all = (logits / temperature).log_softmax(dim=-1)
    return logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1).float()


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    """Log-probs (and entropy) of ``logits = hidden @ weight.T + bias`` in float64."""
    check_linear(hidden, weight, bias, labels)
    return token_logprobs(_logits(hidden, weight, bias), labels, temperature=temperature, return_entropy=return_entropy)


def gspo_loss(
    logits: Tensor,
    labels: Tensor,
    advantages: Tensor,
    old_logprobs: Optional[Tensor] = None,
    *,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    is_ratio: Optional[Tensor] = None,
    num_items_in_batch: Union[None, int, float, Tensor] = None,
    config: Optional[GSPOConfig] = None,
) -> LossOutput:
    """The GSPO / GRPO loss from logits ``[B, T, V]`` (padded) or ``[N, V]`` (packed), in float64."""
    config = config or GSPOConfig()
    check_logits(logits, labels, cu_seqlens)
    inputs = prepare_loss_inputs(
        labels, advantages, logits.shape[-1], old_logprobs=old_logprobs, mask=mask, cu_seqlens=cu_seqlens,
        ref_logprobs=ref_logprobs, is_ratio=is_ratio, num_items_in_batch=num_items_in_batch, beta=config.beta,
    )
    flat = logits.reshape(-1, logits.shape[-1])
    logp, entropy = token_logprobs(flat, inputs.labels, temperature=config.temperature, return_entropy=True)
    return sequence_loss(logp, entropy, inputs, config)


def fused_linear_gspo_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    advantages: Tensor,
    old_logprobs: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    **kwargs,
) -> LossOutput:
    """:func:`gspo_loss` of ``hidden @ weight.T + bias`` (the logits are materialized here)."""
    check_linear(hidden, weight, bias, labels)
    return gspo_loss(_logits(hidden, weight, bias), labels, advantages, old_logprobs, **kwargs)


def group_advantages(rewards: Tensor, group_size: int, *, eps: float = 1e-4) -> Tensor:
    """``A_i = (r_i - mean_group(r)) / (std_group(r) + eps)``, unbiased std, one group at a time."""
    out = torch.empty(rewards.shape, dtype=torch.float64)
    r = rewards.double().cpu()
    for g0 in range(0, r.numel(), group_size):
        group = r[g0 : g0 + group_size]
        mean = group.sum() / group_size
        var = ((group - mean) ** 2).sum() / (group_size - 1) if group_size > 1 else torch.zeros((), dtype=torch.float64)
        centered = group - mean
        out[g0 : g0 + group_size] = torch.where(centered == 0, 0.0, centered / (var.sqrt() + eps))
    return out


def sequence_loss(logp: Tensor, entropy: Tensor, inputs: LossInputs, config: GSPOConfig) -> LossOutput:
    """The spec's per-token surrogate, clipping, IS correction, KL, aggregation and metrics.

    ``logp`` and ``entropy`` are ``[N]`` float64 (differentiable); one response at a time.
    """
    batch = inputs.batch
    S = batch.num_seqs
    cu = batch.cu_seqlens.tolist()
    eps_low, eps_high, delta = config.epsilon_low, config.epsilon_high, config.delta
    level = config.importance_sampling_level
    total = logp.new_zeros(())  # sum over responses of the aggregated per-token losses
    all_tokens = logp.new_zeros(())
    weights, advs, kls, entropies = [], [], [], []
    for i in range(S):
        s, e = cu[i], cu[i + 1]
        m = batch.mask[s:e].double()
        on = m > 0
        n = m.sum()
        lp = torch.where(on, logp[s:e], 0.0)
        old = lp.detach() if inputs.old_logprobs is None else torch.where(on, inputs.old_logprobs[s:e].double(), 0.0)
        r = lp - old  # r_t = logp_t - old_t
        mean_r = (m * r).sum() / n.clamp(min=1)  # (1/|y_i|) sum_t mask_t r_t
        clamp = config.log_ratio_clamp
        if clamp is not None:  # w = exp(min(log w, c)); torch.clamp passes no gradient above c
            r_w, mean_w = torch.clamp(r, max=clamp), torch.clamp(mean_r, max=clamp)
            tok_w = torch.clamp(mean_r.detach() + lp - lp.detach(), max=clamp)
        else:
            r_w, mean_w, tok_w = r, mean_r, mean_r.detach() + lp - lp.detach()
        if level == "token":
            w = torch.exp(r_w)
        elif level == "sequence":
            w = torch.exp(mean_w).expand(e - s)
        else:  # sequence_token
            w = torch.exp(tok_w)
        A = inputs.advantages[s:e].double() if inputs.advantages_per_token else inputs.advantages[i].double().expand(e - s)
        c1 = w if delta is None else torch.clamp(w, max=delta)
        c2 = torch.clamp(w, 1 - eps_low, 1 + eps_high)
        loss_t = -torch.minimum(c1 * A, c2 * A)
        if inputs.is_ratio is not None:
            loss_t = loss_t * inputs.is_ratio[s:e].double()
        if config.beta > 0:
            d = torch.where(on, inputs.ref_logprobs[s:e].double(), 0.0) - lp
            kl = torch.exp(d) - d - 1
            if config.use_bias_correction_kl:
                kl = kl * w
            loss_t = loss_t + config.beta * kl
            kls.append(kl.detach()[on])
        loss_t = torch.where(on, loss_t, 0.0)
        if config.loss_type == "grpo":
            total = total + loss_t.sum() / n.clamp(min=1)
        else:
            total = total + loss_t.sum()
        all_tokens = all_tokens + n
        entropies.append(entropy[s:e][on])
        if level == "sequence" and not inputs.advantages_per_token:
            if n > 0:
                weights.append(torch.exp(mean_w.detach()).reshape(1))
                advs.append(inputs.advantages[i].double().reshape(1))
        else:
            weights.append(w.detach()[on])
            advs.append(A[on])

    if config.loss_type == "grpo":
        loss = total / max(S, 1)
    elif config.loss_type == "bnpo":
        loss = total / all_tokens.clamp(min=1)
    elif config.loss_type == "dr_grpo":
        loss = total / (max(S, 1) * config.max_completion_length)
    else:
        items = all_tokens if inputs.num_items_in_batch is None else inputs.num_items_in_batch.double()
        loss = total / items.clamp(min=1)

    ent = torch.cat(entropies) if entropies else logp.new_zeros(0)
    entropy_mean = ent.sum() / max(ent.numel(), 1)
    if config.entropy_coef != 0:
        loss = loss - config.entropy_coef * entropy_mean

    w_all = torch.cat(weights) if weights else logp.new_zeros(0)
    a_all = torch.cat(advs) if advs else logp.new_zeros(0)
    count = max(w_all.numel(), 1)
    low = (w_all < 1 - eps_low) & (a_all < 0)
    high = (w_all > 1 + eps_high) & (a_all > 0)
    metrics = {
        "clip_ratio/low_mean": low.sum().double() / count,
        "clip_ratio/high_mean": high.sum().double() / count,
        "clip_ratio/region_mean": (low | high).sum().double() / count,
        "importance_weight/mean": w_all.sum() / count,
        "importance_weight/min": w_all.min() if w_all.numel() else logp.new_zeros(()),
        "importance_weight/max": w_all.max() if w_all.numel() else logp.new_zeros(()),
        "entropy": entropy_mean.detach(),
    }
    if config.beta > 0:
        kl_all = torch.cat(kls) if kls else logp.new_zeros(0)
        metrics["kl"] = kl_all.sum() / max(kl_all.numel(), 1)
    return LossOutput(loss, metrics)


def _logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    logits = hidden.double() @ weight.double().T
    return logits if bias is None else logits + bias.double()


def _check_label_range(labels: Tensor, vocab_size: int) -> None:
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= vocab_size):
        raise ValueError(f"labels must lie in [0, {vocab_size}) (the vocabulary size), got values in "
                         f"[{int(labels.min())}, {int(labels.max())}]")
