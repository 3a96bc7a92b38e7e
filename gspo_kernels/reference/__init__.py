"""The oracle: plain PyTorch in float64, one response at a time, everything materialized.

Every formula is the one in ``docs/math.md``; nothing here is meant to be fast. Tests compare every
backend with these functions. The oracle shares no code with the fast paths: it reads the layout
(``mask``, ``cu_seqlens``) itself, with its own input checks, and builds each response's list of
counted tokens directly. Tokens that do not count (``mask == 0``, padding) are never read: their
logits, labels, old / reference log-probs, ``is_ratio`` and advantages may hold anything.

All results are float64 (on the inputs' device), whatever the input dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from gspo_kernels.config import GSPOConfig
from gspo_kernels.objectives.stage import LossOutput
from gspo_kernels.reference.checks import (
    _check_config,
    _check_float,
    _check_integer,
    _check_label_range,
    _check_linear,
    _check_softcap,
    _check_temperature,
    _num_items,
)
from gspo_kernels.reference.objectives import (
    _CLIPPED_SURROGATE,
    _aggregate,
    _cispo_surrogate,
    _clipped_surrogate,
    _gmpo_surrogate,
    _importance_weight,
    _k3_kl,
    _objective_metrics,
    _off_policy_keep,
    _rollout_correction,
    _sapo_surrogate,
    _Tally,
    _vespo_surrogate,
)

Scalar = Union[None, int, float, Tensor]


# -------------------------------------------------------------------------------------------------
# The per-token stage: log-probs and entropies of rows of logits.
# -------------------------------------------------------------------------------------------------


def token_logprobs(
    logits: Tensor, labels: Tensor, *, temperature: float = 1.0, return_entropy: bool = False,
    final_logit_softcapping: Optional[float] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``logp_t = z[y_t]/tau - logsumexp(z/tau)`` and ``H_t = -sum_v p_v log p_v``, in float64.

    Args:
        logits: ``[..., V]``, any float dtype; ``-inf`` entries (masked vocabulary) are allowed.
        labels: ``[...]`` integer, every entry in ``[0, V)``.
        final_logit_softcapping: a soft cap ``c``: ``z`` is replaced by ``c * tanh(z / c)`` first (None: no cap).
    Returns:
        float64 ``logp`` shaped like ``labels`` (and ``H`` when ``return_entropy``); differentiable.
    """
    _check_float("logits", logits)
    _check_integer("labels", labels)
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"logits must have shape {tuple(labels.shape) + ('V',)} to match labels "
                         f"{tuple(labels.shape)}, got {tuple(logits.shape)}")
    _check_temperature(temperature)
    _check_softcap(final_logit_softcapping)
    V = logits.shape[-1]
    _check_label_range(labels.reshape(-1), V, "labels")
    logp, entropy = _rows_logprobs(logits.reshape(-1, V), labels.reshape(-1), temperature, final_logit_softcapping)
    logp, entropy = logp.reshape(labels.shape), entropy.reshape(labels.shape)
    return (logp, entropy) if return_entropy else logp


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    final_logit_softcapping: Optional[float] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`token_logprobs` of ``logits = hidden @ weight.T + bias``, the product taken in float64.

    ``hidden [..., H]``, ``weight [V, H]``, ``bias [V]`` or None, ``labels [...]`` in ``[0, V)``.
    """
    _check_linear(hidden, weight, bias, labels)
    return token_logprobs(_logits(hidden, weight, bias), labels, temperature=temperature,
                          return_entropy=return_entropy, final_logit_softcapping=final_logit_softcapping)


def _rows_logprobs(rows: Tensor, labels: Tensor, temperature: float,
                   softcap: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """``rows [n, V]`` logits, ``labels [n]`` -> float64 ``logp [n]`` and entropy ``H [n]`` (logits soft-capped
    to ``c * tanh(z / c)`` first when ``softcap = c`` is given; autograd supplies the ``1 - tanh^2`` factor)."""
    rows = rows.double()
    if softcap is not None:
        rows = softcap * torch.tanh(rows / softcap)
    logp_all = torch.log_softmax(rows / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    # p log p -> 0 as p -> 0: a -inf logit (p = 0, log p = -inf) adds 0, not 0 * -inf = NaN, and
    # the log p that autograd meets there is 0, so no NaN reaches the gradient either.
    entropy = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    return logp, entropy


# -------------------------------------------------------------------------------------------------
# The loss: from logits, from hidden states, or from log-probs already computed.
# -------------------------------------------------------------------------------------------------


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
    num_items_in_batch: Scalar = None,
    config: Optional[GSPOConfig] = None,
    rollout_logprobs: Optional[Tensor] = None,
) -> LossOutput:
    """The GSPO / GRPO loss from logits ``[B, T, V]`` (padded) or ``[N, V]`` (packed), in float64.

    The arguments are those of :func:`gspo_kernels.gspo_loss`. Returns ``LossOutput(loss, metrics)``:
    a 0-dim float64 loss, differentiable for ``logits``, and detached 0-dim float64 metrics.
    """
    config = _check_config(config)
    _check_float("logits", logits)
    layout = _Layout.of(labels, mask, cu_seqlens)
    if tuple(logits.shape[:-1]) != layout.token_shape or logits.dim() != len(layout.token_shape) + 1:
        raise ValueError(f"logits must have shape {layout.token_shape + ('V',)} to match labels "
                         f"{layout.token_shape}, got {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a vocabulary dimension V >= 1")
    rows = logits.reshape(-1, logits.shape[-1])
    tensors = _LossTensors(advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                           is_ratio=is_ratio, rollout_logprobs=rollout_logprobs, num_items_in_batch=num_items_in_batch)
    return _loss_from_rows(lambda idx: rows[idx], layout, labels, tensors, config, vocab_size=logits.shape[-1])


def fused_linear_gspo_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    advantages: Tensor,
    old_logprobs: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    is_ratio: Optional[Tensor] = None,
    num_items_in_batch: Scalar = None,
    config: Optional[GSPOConfig] = None,
    rollout_logprobs: Optional[Tensor] = None,
) -> LossOutput:
    """:func:`gspo_loss` of ``hidden @ weight.T + bias``; each response's logits are formed in float64.

    ``hidden [B, T, H]`` or ``[N, H]``, ``weight [V, H]``, ``bias [V]`` or None; differentiable for all three.
    Only counted tokens' hidden rows are read.
    """
    config = _check_config(config)
    _check_linear(hidden, weight, bias, labels)
    layout = _Layout.of(labels, mask, cu_seqlens)
    rows = hidden.reshape(-1, hidden.shape[-1])
    tensors = _LossTensors(advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                           is_ratio=is_ratio, rollout_logprobs=rollout_logprobs, num_items_in_batch=num_items_in_batch)
    return _loss_from_rows(lambda idx: _logits(rows[idx], weight, bias), layout, labels, tensors, config,
                           vocab_size=weight.shape[0])


def policy_loss(
    logprobs: Tensor,
    advantages: Tensor,
    old_logprobs: Optional[Tensor] = None,
    *,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    is_ratio: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None,
    num_items_in_batch: Scalar = None,
    config: Optional[GSPOConfig] = None,
    rollout_logprobs: Optional[Tensor] = None,
) -> LossOutput:
    """The loss from per-token log-probs ``[B, T]`` (padded) or ``[N]`` (packed with ``cu_seqlens``).

    ``entropy`` (log-probs' shape) is optional: without it the ``entropy`` metric is omitted, and
    ``config.entropy_coef`` must be 0. Differentiable for ``logprobs`` and ``entropy``; float64 out.
    """
    config = _check_config(config)
    _check_float("logprobs", logprobs)
    want_dim = 1 if cu_seqlens is not None else 2
    if logprobs.dim() != want_dim:
        raise ValueError(f"logprobs must be {'[N] (packed, with cu_seqlens)' if want_dim == 1 else '[B, T] (padded)'}"
                         f", got shape {tuple(logprobs.shape)}")
    layout = _Layout.from_shape(tuple(logprobs.shape), logprobs.device, mask, cu_seqlens)
    flat_logp = logprobs.reshape(-1)
    flat_entropy = None
    if entropy is not None:
        flat_entropy = _per_token("entropy", entropy, layout)
    elif config.entropy_coef != 0:
        raise ValueError("entropy is required when config.entropy_coef != 0")
    per_response = []
    for idx in layout.responses:
        lp = flat_logp[idx].double()
        per_response.append((lp, None if flat_entropy is None else flat_entropy[idx].double()))
    return _objective(per_response=per_response, layout=layout, advantages=advantages, old_logprobs=old_logprobs,
                      ref_logprobs=ref_logprobs, is_ratio=is_ratio, num_items_in_batch=num_items_in_batch,
                      config=config, with_entropy=flat_entropy is not None, rollout_logprobs=rollout_logprobs)


def sequence_loss(logp: Tensor, entropy: Optional[Tensor], inputs: Any, config: GSPOConfig) -> LossOutput:
    """:func:`policy_loss` for a caller that already holds flattened inputs (``logp``, ``entropy``: ``[N]``).

    ``inputs`` is read by attribute only (``batch.mask``, ``batch.cu_seqlens``, ``advantages``,
    ``advantages_per_token``, ``old_logprobs``, ``ref_logprobs``, ``is_ratio`` (``[N]``),
    ``num_items_in_batch``, ``rollout_logprobs``), as in the library's own flattened inputs; it is treated as a packed batch.
    """
    batch = inputs.batch
    return policy_loss(
        logp, inputs.advantages, inputs.old_logprobs, mask=batch.mask, cu_seqlens=batch.cu_seqlens,
        ref_logprobs=inputs.ref_logprobs, is_ratio=inputs.is_ratio, entropy=entropy,
        num_items_in_batch=inputs.num_items_in_batch, config=config,
        rollout_logprobs=inputs.rollout_logprobs,
    )


def group_advantages(rewards: Tensor, group_size: int, *, eps: float = 1e-4) -> Tensor:
    """``A_i = (r_i - mean_group(r)) / (std_group(r) + eps)``, unbiased std, one group at a time.

    ``rewards [S]`` with ``S`` a multiple of ``group_size``; float64 ``[S]`` out (on the CPU). A group
    whose rewards are all equal gets ``A = 0``.
    """
    if not isinstance(group_size, int) or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size must be a positive int dividing len(rewards) = {rewards.numel()}, "
                         f"got {group_size!r}")
    out = torch.empty(rewards.shape, dtype=torch.float64)
    r = rewards.double().cpu()
    for g0 in range(0, r.numel(), group_size):
        group = r[g0 : g0 + group_size]
        mean = group.sum() / group_size
        var = ((group - mean) ** 2).sum() / (group_size - 1) if group_size > 1 else torch.zeros((), dtype=torch.float64)
        centered = group - mean
        out[g0 : g0 + group_size] = torch.where(centered == 0, 0.0, centered / (var.sqrt() + eps))
    return out


# -------------------------------------------------------------------------------------------------
# The layout: which tokens make up each response.
# -------------------------------------------------------------------------------------------------


class _Layout:
    """``responses[i]``: int64 positions (in the flattened token order) of response i's counted tokens."""

    def __init__(self, token_shape: Tuple[int, ...], responses: List[Tensor]):
        self.token_shape = token_shape
        self.responses = responses
        self.num_seqs = len(responses)

    @staticmethod
    def of(labels: Tensor, mask: Optional[Tensor], cu_seqlens: Optional[Tensor]) -> "_Layout":
        _check_integer("labels", labels)
        if cu_seqlens is None and labels.dim() != 2:
            raise ValueError(f"labels must be [B, T] for the padded layout (or [N] with cu_seqlens for the packed "
                             f"one), got shape {tuple(labels.shape)}")
        if cu_seqlens is not None and labels.dim() != 1:
            raise ValueError(f"labels must be [N] when cu_seqlens is given (packed layout), "
                             f"got shape {tuple(labels.shape)}")
        return _Layout.from_shape(tuple(labels.shape), labels.device, mask, cu_seqlens)

    @staticmethod
    def from_shape(token_shape: Tuple[int, ...], device: torch.device, mask: Optional[Tensor],
                   cu_seqlens: Optional[Tensor]) -> "_Layout":
        counted = _mask_values(mask, token_shape, device)  # bool, token_shape
        if cu_seqlens is None:  # padded: response b is row b of [B, T]
            B, T = token_shape
            starts_ends = [(b * T, (b + 1) * T) for b in range(B)]
        else:  # packed: response i is tokens cu[i] .. cu[i+1] - 1
            starts_ends = _segments(cu_seqlens, token_shape[0], device)
        flat = counted.reshape(-1)
        responses = [start + torch.nonzero(flat[start:end]).reshape(-1) for start, end in starts_ends]
        return _Layout(token_shape, responses)


def _segments(cu_seqlens: Tensor, num_tokens: int, device: torch.device) -> List[Tuple[int, int]]:
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [S + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the tokens are on {device}")
    cu = [int(c) for c in cu_seqlens.tolist()]
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {cu[0]}")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{i}] < cu_seqlens[{i - 1}]")
    if cu[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must end at N = {num_tokens} (the number of tokens), "
                         f"got cu_seqlens[-1] = {cu[-1]}")
    return list(zip(cu[:-1], cu[1:]))


def _mask_values(mask: Optional[Tensor], token_shape: Tuple[int, ...], device: torch.device) -> Tensor:
    if mask is None:
        return torch.ones(token_shape, dtype=torch.bool, device=device)
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != token_shape:
        raise ValueError(f"mask must have the token shape {token_shape}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but the tokens are on {device}")
    if mask.dtype.is_complex:
        raise TypeError(f"mask must be bool, integer or float holding 0 and 1, got {mask.dtype}")
    if mask.dtype != torch.bool:
        bad = torch.nonzero(((mask != 0) & (mask != 1)).reshape(-1))  # NaN included
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"mask must hold only 0 and 1 (bool, integer or float); flat position {i} holds "
                             f"{mask.reshape(-1)[i].item()}")
    return mask != 0


# -------------------------------------------------------------------------------------------------
# The objective, one response at a time.
# -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LossTensors:
    """The loss's tensors besides the logits, as the caller gave them (None: not given): ``advantages`` ``[S]`` or
    per token, ``old_logprobs``, ``ref_logprobs``, ``is_ratio``, ``rollout_logprobs`` per token, and
    ``num_items_in_batch`` (a number, a 0-dim tensor or None)."""

    advantages: Tensor
    old_logprobs: Optional[Tensor]
    ref_logprobs: Optional[Tensor]
    is_ratio: Optional[Tensor]
    rollout_logprobs: Optional[Tensor]
    num_items_in_batch: Scalar


def _loss_from_rows(rows_of, layout: _Layout, labels: Tensor, tensors: _LossTensors, config: GSPOConfig, *,
                    vocab_size: int) -> LossOutput:
    """Log-probs and entropies of each response's counted tokens (``rows_of(idx)``: their logits), then
    :func:`_objective` on them with the loss's ``tensors``."""
    flat_labels = labels.reshape(-1)
    per_response = []
    for idx in layout.responses:
        y = flat_labels[idx]
        _check_label_range(y, vocab_size, "labels (at unmasked positions)")
        per_response.append(_rows_logprobs(rows_of(idx), y, config.temperature,
                                           config.final_logit_softcapping))
    return _objective(per_response=per_response, layout=layout, advantages=tensors.advantages,
                      old_logprobs=tensors.old_logprobs, ref_logprobs=tensors.ref_logprobs, is_ratio=tensors.is_ratio,
                      num_items_in_batch=tensors.num_items_in_batch, config=config, with_entropy=True,
                      rollout_logprobs=tensors.rollout_logprobs)


def _objective(
    per_response: Sequence[Tuple[Tensor, Optional[Tensor]]],
    layout: _Layout,
    advantages: Tensor,
    old_logprobs: Optional[Tensor],
    ref_logprobs: Optional[Tensor],
    is_ratio: Optional[Tensor],
    num_items_in_batch: Scalar,
    config: GSPOConfig,
    *,
    with_entropy: bool,
    rollout_logprobs: Optional[Tensor] = None,
) -> LossOutput:
    """``per_response[i] = (logp, entropy or None)`` over response i's counted tokens (float64).

    ``L = aggregate_i(sum_t l_{i,t}) - entropy_coef * mean_t H_t``, with ``l_{i,t}`` the objective's per-token
    loss (:func:`_response_loss`: weight, surrogate, correction, KL) and the aggregation of ``config``.
    """
    adv, adv_per_token = _advantages(advantages, layout)
    old = _per_token("old_logprobs", old_logprobs, layout)
    ref = _per_token("ref_logprobs", ref_logprobs, layout)
    rollout = _per_token("rollout_logprobs", rollout_logprobs, layout)
    if config.beta > 0 and ref is None:
        raise ValueError("ref_logprobs is required when beta > 0 (the KL term needs the reference log-probs)")
    if config.rollout_correction is not None and rollout is None:
        raise ValueError("rollout_logprobs is required when config.rollout_correction is set")
    if config.rollout_correction is not None and is_ratio is not None:
        raise ValueError("is_ratio and config.rollout_correction are exclusive")
    ratio = _is_ratio(is_ratio, layout)
    items = _num_items(num_items_in_batch)
    aggregation = config.aggregation or {"cispo": "dapo", "sapo": "grpo", "luspo": "seq_sum", "vespo": "dapo",
                                         "gmpo": "grpo"}.get(config.loss_type, config.loss_type)
    f64 = dict(dtype=torch.float64, device=advantages.device)

    # sum over responses of their aggregated per-token losses; empty slices keep it in the autograd
    # graph (with zero gradient) even when no token counts
    total = sum((logp[:0].sum() for logp, _ in per_response), torch.zeros((), **f64))
    tally = _Tally()
    for i, ((logp, entropy), idx) in enumerate(zip(per_response, layout.responses)):
        n = idx.numel()  # |y_i|
        if entropy is not None:
            tally.entropies.append(entropy)
        if n == 0:
            continue  # an empty response adds nothing (it still counts in S)
        tally.num_tokens += n
        loss_t = _response_loss(
            logp=logp,
            A=adv[idx] if adv_per_token else adv[i].expand(n),
            old=None if old is None else old[idx],
            ref=None if ref is None else ref[idx],
            c=None if ratio is None else ratio[idx],
            rollout=None if rollout is None else rollout[idx],
            config=config,
            adv_per_token=adv_per_token,
            tally=tally,
        )
        total = total + (loss_t.mean() if aggregation == "grpo" else loss_t.sum())

    loss = _aggregate(total, aggregation, layout.num_seqs, tally.num_tokens, items, config)
    metrics = _objective_metrics(tally, config, rollout is not None, f64)
    if with_entropy:  # masked token-mean of H_t
        ent = torch.cat(tally.entropies) if tally.entropies else torch.zeros(0, **f64)
        entropy_mean = ent.sum() / max(ent.numel(), 1)
        if config.entropy_coef != 0:
            loss = loss - config.entropy_coef * entropy_mean
        metrics["entropy"] = entropy_mean.detach()
    if config.beta > 0:
        kl_all = torch.cat(tally.kls) if tally.kls else torch.zeros(0, **f64)
        metrics["kl"] = kl_all.sum() / max(kl_all.numel(), 1)
    return LossOutput(loss, metrics)


def _response_loss(*, logp: Tensor, A: Tensor, old: Optional[Tensor], ref: Optional[Tensor], c: Optional[Tensor],
                   rollout: Optional[Tensor], config: GSPOConfig, adv_per_token: bool, tally: _Tally) -> Tensor:
    """``l_t`` of one response's tokens: ``surrogate(w_t, A_t) * keep * c_t + beta * kl_t``.

    ``w_t`` the importance weight at the config's level, ``c_t`` the correction (``is_ratio``, or the rollout
    correction computed here), ``keep`` the off-policy mask. Records the response's metric inputs in ``tally``.
    """
    old = logp.detach() if old is None else old  # on-policy: ratio exactly 1
    r = logp - old  # r_t = logp_t - old_t
    w = _importance_weight(r, logp, config)
    if rollout is not None:
        rho = _rollout_correction(old.detach(), rollout, config, tally)
        if config.rollout_correction is not None:
            c = rho
    keep = _off_policy_keep(logp, A, old if rollout is None else rollout, config)

    loss_type = config.loss_type
    if loss_type in _CLIPPED_SURROGATE:
        loss_t = _clipped_surrogate(w, A, config.epsilon_low, config.epsilon_high, config.delta)  # -min(c1 A, c2 A)
        if config.clip_ratio_c is not None:  # dual clip: at most clip_ratio_c |A| when A < 0
            loss_t = torch.where(A < 0, torch.minimum(loss_t, config.clip_ratio_c * A.abs()), loss_t)
        metric_w = None
    elif loss_type == "sapo":
        loss_t, metric_w = _sapo_surrogate(w, A, config), None
    elif loss_type == "cispo":
        loss_t, metric_w = _cispo_surrogate(w, A, logp, config, adv_per_token, tally), None
    elif loss_type == "vespo":
        loss_t, metric_w = _vespo_surrogate(r, A, logp, c, config, adv_per_token, tally)
        c = None  # folded into the weight: not a factor of the loss
    else:
        loss_t, metric_w = _gmpo_surrogate(r, A, config, tally)
    if keep is not None:
        loss_t = loss_t * keep
    if c is not None:
        loss_t = torch.where(c == 0, 0.0, loss_t * c)
    if config.beta > 0:
        kl = _k3_kl(ref, logp)
        if config.use_bias_correction_kl:
            kl = kl * w
        loss_t = loss_t + config.beta * kl
        tally.kls.append(kl.detach())

    if metric_w is not None:  # one weight per response (VESPO's, GMPO's)
        tally.weights.append(metric_w.reshape(1))
        tally.advs.append(A[:1])
    elif config.importance_sampling_level == "sequence" and not adv_per_token:  # metrics count responses
        tally.weights.append(w.detach()[:1])
        tally.advs.append(A[:1])
    else:  # metrics count tokens
        tally.weights.append(w.detach())
        tally.advs.append(A)
    return loss_t


# -------------------------------------------------------------------------------------------------
# The oracle's own input checks (a clear error naming the argument).
# -------------------------------------------------------------------------------------------------


def _advantages(advantages: Tensor, layout: _Layout) -> Tuple[Tensor, bool]:
    """Float64 advantages, flattened: ``[S]`` per response, or ``[N]`` per token (token order)."""
    _check_float("advantages", advantages)
    S = layout.num_seqs
    if tuple(advantages.shape) == (S,):
        return advantages.detach().double(), False
    if tuple(advantages.shape) == layout.token_shape:
        return advantages.detach().double().reshape(-1), True
    raise ValueError(f"advantages must be [S] = ({S},) (one per response) or the token shape {layout.token_shape} "
                     f"(one per token), got {tuple(advantages.shape)}")


def _per_token(name: str, value: Optional[Tensor], layout: _Layout) -> Optional[Tensor]:
    """A per-token input in the token shape, flattened to ``[N]`` float64 (detached unless it is the entropy)."""
    if value is None:
        return None
    _check_float(name, value)
    if tuple(value.shape) != layout.token_shape:
        raise ValueError(f"{name} must have the token shape {layout.token_shape}, got {tuple(value.shape)}")
    return (value if name == "entropy" else value.detach()).double().reshape(-1)


def _is_ratio(is_ratio: Optional[Tensor], layout: _Layout) -> Optional[Tensor]:
    """``is_ratio`` per token (token shape) or per response (``[S]`` / ``[S, 1]``), as ``[N]`` float64."""
    if is_ratio is None:
        return None
    _check_float("is_ratio", is_ratio)
    S = layout.num_seqs
    if tuple(is_ratio.shape) == layout.token_shape:
        return is_ratio.detach().double().reshape(-1)
    if tuple(is_ratio.shape) in ((S,), (S, 1)):
        per_response = is_ratio.detach().double().reshape(-1)
        N = math.prod(layout.token_shape)
        out = torch.zeros(N, dtype=torch.float64, device=is_ratio.device)
        for i, idx in enumerate(layout.responses):
            out[idx] = per_response[i]
        return out
    raise ValueError(f"is_ratio must be per token {layout.token_shape} or per response ({S},), "
                     f"got {tuple(is_ratio.shape)}")


def _logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    logits = hidden.double() @ weight.double().T
    return logits if bias is None else logits + bias.double()
