"""The rollout of :class:`~gspo_kernels.train.hf_trainer.GSPOTrainer` and its mini-batches: the responses' tensors,
their packed or padded model and loss inputs, and the completion mask both trainers use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor


@dataclass
class ScoredResponses:
    """The tensors of ``S`` sampled and scored responses that both trainers' rollouts carry (on the policy's
    device): ``completion_ids [S, C]`` (pad after the end), ``completion_mask [S, C]`` fp32 (1 up to and including
    the first end-of-sequence token), ``rewards [S]``, ``advantages [S]`` fp32; ``old_logprobs`` and
    ``ref_logprobs [S, C]`` fp32 (0 where masked), filled in after sampling."""

    completion_ids: Tensor
    completion_mask: Tensor
    rewards: Tensor
    advantages: Tensor
    old_logprobs: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None


@dataclass
class _RolloutTexts:
    prompts: List[str]
    completions: List[str]
    prompt_ids: List[List[int]]


@dataclass
class Rollout(ScoredResponses, _RolloutTexts):
    """One rollout of ``S = len(queries) * group_size`` responses (tensors on the policy's device).

    Its ``prompts`` and ``completions`` texts, ``prompt_ids``: each response's prompt token ids (no padding), then
    the responses' tensors (``ScoredResponses``), in that order.
    """


@dataclass
class MiniBatch:
    """Model inputs and loss inputs of some responses in one layout.

    Packed: ``input_ids``/``position_ids [1, L]``, ``attention_mask`` None, ``gather [N]`` (positions whose
    hidden state predicts a completion token), ``labels [N]``, ``cu_seqlens [S_mb + 1]``, ``mask`` None.
    Padded: ``input_ids``/``position_ids``/``attention_mask [S_mb, P + C - 1]``, ``labels``/``mask [S_mb, C]``,
    hidden states ``[:, P - 1:]``.
    """

    layout: str
    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Optional[Tensor]
    labels: Tensor
    mask: Optional[Tensor]
    cu_seqlens: Optional[Tensor]
    gather: Optional[Tensor]
    prompt_width: int
    rows: Tensor

    def per_token(self, values: Tensor, completion_mask: Tensor) -> Tensor:
        """``values [S, C]`` of the rollout in this mini-batch's token layout."""
        sub = values[self.rows]
        if self.layout == "packed":
            return sub[completion_mask[self.rows] > 0]
        return sub[:, : self.labels.shape[1]]

    def scatter(self, values: Tensor, completion_mask: Tensor) -> Tensor:
        """This layout's per-token ``values`` as ``[S_mb, C]`` (0 where masked)."""
        mask = completion_mask[self.rows] > 0
        out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
        if self.layout == "packed":
            out[mask] = values
        else:
            width = values.shape[1]
            out[:, :width] = torch.where(mask[:, :width], values, torch.zeros((), dtype=values.dtype))
        return out

    @property
    def model_tokens(self) -> int:
        """Positions the backbone runs on (padding included)."""
        return self.input_ids.numel()


def build_minibatch(rollout: Rollout, rows: Tensor, layout: str, pad_token_id: int) -> MiniBatch:
    """Model and loss inputs of ``rollout``'s responses ``rows`` in the ``"packed"`` or ``"padded"`` layout.

    Each sequence is its prompt then its completion without the completion's last token (which predicts
    nothing); the hidden state at position ``t`` predicts token ``t + 1``.
    """
    device = rollout.completion_ids.device
    lengths = rollout.completion_mask[rows].sum(dim=1).long().tolist()
    completions = rollout.completion_ids[rows].tolist()
    prompts = [rollout.prompt_ids[i] for i in rows.tolist()]
    if layout == "packed":
        ids: List[int] = []
        positions: List[int] = []
        gather: List[int] = []
        labels: List[int] = []
        cu = [0]
        for prompt, completion, n in zip(prompts, completions, lengths):
            seq = prompt + completion[: n - 1]
            start = len(ids)
            ids.extend(seq)
            positions.extend(range(len(seq)))
            gather.extend(range(start + len(prompt) - 1, start + len(prompt) - 1 + n))
            labels.extend(completion[:n])
            cu.append(cu[-1] + n)
        as_long = dict(dtype=torch.long, device=device)
        return MiniBatch(layout="packed", input_ids=torch.tensor([ids], **as_long),
                         position_ids=torch.tensor([positions], **as_long), attention_mask=None,
                         labels=torch.tensor(labels, **as_long), mask=None,
                         cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
                         gather=torch.tensor(gather, **as_long), prompt_width=0, rows=rows)
    width = max(len(p) for p in prompts)
    c = max(lengths)
    input_ids = torch.full((len(prompts), width + c - 1), pad_token_id, dtype=torch.long)
    attention = torch.zeros(input_ids.shape, dtype=torch.long)
    for r, (prompt, completion, n) in enumerate(zip(prompts, completions, lengths)):
        seq = prompt + completion[: n - 1]
        input_ids[r, width - len(prompt) : width - len(prompt) + len(seq)] = torch.tensor(seq)
        attention[r, width - len(prompt) : width - len(prompt) + len(seq)] = 1
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    labels = rollout.completion_ids[rows, :c]
    mask = rollout.completion_mask[rows, :c]
    return MiniBatch(layout="padded", input_ids=input_ids.to(device), position_ids=position_ids.to(device),
                     attention_mask=attention.to(device), labels=labels, mask=mask, cu_seqlens=None, gather=None,
                     prompt_width=width, rows=rows)


def completion_mask_of(completion_ids: Tensor, eos_token_ids: Union[int, Sequence[int]]) -> Tensor:
    """1 up to and including the first end-of-sequence token of each row, 0 after it (``[S, C]`` fp32).

    ``completion_ids [S, C]`` integer; ``eos_token_ids``: one token id or several (any of them ends a row).
    Both trainers' mask (``train/toy_trainer.py`` imports it)."""
    if isinstance(eos_token_ids, int):
        eos_token_ids = [eos_token_ids]
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_token_ids), device=completion_ids.device))
    is_eos = is_eos.to(torch.int64)
    return ((is_eos.cumsum(dim=1) - is_eos) == 0).to(torch.float32)
