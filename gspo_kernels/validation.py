"""Input validation and the canonical flat token layout every backend works on.

Both layouts of the spec end up as ``N`` tokens in response order:

* padded: labels ``[B, T]`` with an optional ``mask [B, T]``; token ``b * T + t``; ``S = B``;
* packed: labels ``[N]`` with ``cu_seqlens [S + 1]`` (int32/int64) and an optional token ``mask [N]``.

Every check raises ``ValueError`` / ``TypeError`` naming the argument, before any kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class TokenBatch:
    """Where the ``N`` tokens of a batch belong.

    Attributes:
        mask: ``[N]`` float32, 1 for tokens that count, 0 otherwise.
        seq_index: ``[N]`` int64, the response each token belongs to.
        cu_seqlens: ``[S + 1]`` int32, response boundaries (``arange(0, B*T+1, T)`` when padded).
        num_seqs: ``S``.
        token_shape: ``(B, T)`` for the padded layout, ``(N,)`` for the packed one.
    """

    mask: Tensor
    seq_index: Tensor
    cu_seqlens: Tensor
    num_seqs: int
    token_shape: tuple

    @property
    def num_tokens(self) -> int:
        return int(self.mask.shape[0])

    @property
    def padded(self) -> bool:
        return len(self.token_shape) == 2

    def unflatten(self, per_token: Tensor) -> Tensor:
        """``[N]`` -> the caller's token shape (``[B, T]`` or ``[N]``)."""
        return per_token.reshape(self.token_shape)


@dataclass(frozen=True)
class LossInputs:
    """Validated, flattened loss inputs: per-token tensors ``[N]``, fp16/bf16 upcast to fp32, fp64 kept."""

    labels: Tensor  # [N] int64, in [0, V) everywhere (masked positions set to 0)
    batch: TokenBatch
    advantages: Tensor  # [S] (per response) or [N] (per token); fp32, or fp64 when given fp64
    advantages_per_token: bool
    old_logprobs: Optional[Tensor]
    ref_logprobs: Optional[Tensor]
    is_ratio: Optional[Tensor]  # [N], per-sequence ratios already broadcast to tokens
    num_items_in_batch: Optional[Tensor]  # 0-dim float32


def _check_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_float(name: str, value: object) -> Tensor:
    value = _check_tensor(name, value)
    if value.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor (fp16, bf16, fp32 or fp64), got {value.dtype}")
    return value


def check_same_device(**tensors: Optional[Tensor]) -> torch.device:
    device = None
    first = None
    for name, value in tensors.items():
        if not isinstance(value, Tensor):
            continue
        if device is None:
            device, first = value.device, name
        elif value.device != device:
            raise ValueError(f"{name} is on {value.device} but {first} is on {device}: all tensors must share a device")
    return device


def flatten_token_layout(
    labels: Tensor,
    *,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> TokenBatch:
    """Validate the token layout and build the :class:`TokenBatch`."""
    labels = _check_tensor("labels", labels)
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    device = labels.device
    if cu_seqlens is None:
        if labels.dim() != 2:
            raise ValueError(
                f"labels must be [B, T] for the padded layout (or [N] with cu_seqlens for the packed one), "
                f"got shape {tuple(labels.shape)}"
            )
        B, T = labels.shape
        token_mask = _token_mask(mask, (B, T), device)
        cu = torch.arange(0, B * T + 1, max(T, 1), device=device, dtype=torch.int32)[: B + 1]
        if T == 0:
            cu = torch.zeros(B + 1, device=device, dtype=torch.int32)
        seq_index = torch.arange(B, device=device).repeat_interleave(T)
        return TokenBatch(token_mask.reshape(-1), seq_index, cu, B, (B, T))

    cu_seqlens = _check_tensor("cu_seqlens", cu_seqlens)
    if labels.dim() != 1:
        raise ValueError(f"labels must be [N] when cu_seqlens is given (packed layout), got shape {tuple(labels.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [S + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but labels is on {device}")
    N = labels.shape[0]
    S = cu_seqlens.numel() - 1
    token_mask = _token_mask(mask, (N,), device)
    cu = cu_seqlens.detach()
    lengths = cu[1:] - cu[:-1]
    if not tracing():
        cu_host = cu.to("cpu", torch.int64)
        if int(cu_host[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {int(cu_host[0])}")
        host_lengths = cu_host[1:] - cu_host[:-1]
        if bool((host_lengths < 0).any()):
            bad = int(torch.nonzero(host_lengths < 0)[0, 0])
            raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{bad + 1}] < cu_seqlens[{bad}]")
        if int(cu_host[-1]) != N:
            raise ValueError(
                f"cu_seqlens must end at N = {N} (the number of labels), got cu_seqlens[-1] = {int(cu_host[-1])}"
            )
    seq_index = torch.repeat_interleave(torch.arange(S, device=device), lengths.to(torch.int64), output_size=N)
    return TokenBatch(token_mask, seq_index, cu.to(torch.int32), S, (N,))


def tracing() -> bool:
    """True under ``torch.compile`` tracing: value checks (a host sync each) are skipped there.

    Shape, dtype and device checks always run; the checks that read values (labels in range,
    ``cu_seqlens`` well formed) run in eager mode only.
    """
    return torch.compiler.is_compiling()


def _token_mask(mask: Optional[Tensor], shape: tuple, device: torch.device) -> Tensor:
    if mask is None:
        return torch.ones(shape, device=device, dtype=torch.float32)
    mask = _check_tensor("mask", mask)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask must have shape {tuple(shape)} (like labels), got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but labels is on {device}")
    if mask.dtype.is_complex:
        raise TypeError(f"mask must be bool, integer or float (0/1), got {mask.dtype}")
    return (mask != 0).to(torch.float32).reshape(shape)


def check_labels(labels: Tensor, batch: TokenBatch, vocab_size: int) -> Tensor:
    """Flatten labels to ``[N]`` int64; unmasked labels must lie in ``[0, V)``; masked ones become 0."""
    flat = labels.reshape(-1).to(torch.int64)
    counted = batch.mask > 0
    bad = counted & ((flat < 0) | (flat >= vocab_size))
    if flat.numel() and not tracing() and bool(bad.any()):
        index = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"labels must lie in [0, {vocab_size}) (the vocabulary size) at unmasked positions; "
            f"flat position {index} holds {int(flat[index])}"
        )
    return torch.where(counted, flat, torch.zeros_like(flat))


def _per_token(name: str, value: Optional[Tensor], batch: TokenBatch, device: torch.device) -> Optional[Tensor]:
    if value is None:
        return None
    value = check_float(name, value)
    if tuple(value.shape) != tuple(batch.token_shape):
        raise ValueError(f"{name} must have the token shape {tuple(batch.token_shape)}, got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but labels is on {device}")
    return _upcast(value.detach().reshape(-1))


def _upcast(x: Tensor) -> Tensor:
    """fp16 / bf16 -> fp32; fp32 and fp64 are kept (the float64 oracle keeps full precision)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)


def prepare_loss_inputs(
    labels: Tensor,
    advantages: Tensor,
    vocab_size: int,
    *,
    old_logprobs: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    is_ratio: Optional[Tensor] = None,
    num_items_in_batch: Union[None, int, float, Tensor] = None,
    beta: float = 0.0,
) -> LossInputs:
    """Validate every loss input against the layout and flatten it to ``[N]`` / ``[S]``."""
    batch = flatten_token_layout(labels, mask=mask, cu_seqlens=cu_seqlens)
    device = labels.device
    flat_labels = check_labels(labels, batch, vocab_size)

    advantages = check_float("advantages", advantages)
    if advantages.device != device:
        raise ValueError(f"advantages is on {advantages.device} but labels is on {device}")
    S = batch.num_seqs
    if tuple(advantages.shape) == (S,):
        per_token = False
    elif tuple(advantages.shape) == tuple(batch.token_shape):
        per_token = True
    else:
        raise ValueError(
            f"advantages must be [S] = ({S},) (one per response) or the token shape "
            f"{tuple(batch.token_shape)} (one per token), got {tuple(advantages.shape)}"
        )
    adv = _upcast(advantages.detach().reshape(-1))

    old = _per_token("old_logprobs", old_logprobs, batch, device)
    ref = _per_token("ref_logprobs", ref_logprobs, batch, device)
    if beta > 0 and ref is None:
        raise ValueError("ref_logprobs is required when beta > 0 (the KL term needs the reference log-probs)")

    ratio = None
    if is_ratio is not None:
        is_ratio = check_float("is_ratio", is_ratio)
        if is_ratio.device != device:
            raise ValueError(f"is_ratio is on {is_ratio.device} but labels is on {device}")
        if tuple(is_ratio.shape) == tuple(batch.token_shape):
            ratio = _upcast(is_ratio.detach().reshape(-1))
        elif tuple(is_ratio.shape) in ((S,), (S, 1)):
            ratio = _upcast(is_ratio.detach().reshape(-1))[batch.seq_index]
        else:
            raise ValueError(
                f"is_ratio must be per token {tuple(batch.token_shape)} or per response ({S},), "
                f"got {tuple(is_ratio.shape)}"
            )

    items = None
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, Tensor):
            if num_items_in_batch.numel() != 1:
                raise ValueError(f"num_items_in_batch must be a scalar, got shape {tuple(num_items_in_batch.shape)}")
            items = _upcast(num_items_in_batch.detach().reshape(()).to(device)).float()
        elif isinstance(num_items_in_batch, (int, float)) and not isinstance(num_items_in_batch, bool):
            if num_items_in_batch <= 0:
                raise ValueError(f"num_items_in_batch must be > 0, got {num_items_in_batch}")
            items = torch.tensor(float(num_items_in_batch), device=device)
        else:
            raise TypeError(f"num_items_in_batch must be an int, float or scalar tensor, got {type(num_items_in_batch).__name__}")

    return LossInputs(flat_labels, batch, adv, per_token, old, ref, ratio, items)


def check_logits(logits: Tensor, labels: Tensor, cu_seqlens: Optional[Tensor]) -> Tensor:
    """``logits`` must be ``[B, T, V]`` (padded) or ``[N, V]`` (packed), matching ``labels``."""
    logits = check_float("logits", logits)
    _check_tensor("labels", labels)
    want = tuple(labels.shape)
    if logits.dim() != len(want) + 1 or tuple(logits.shape[:-1]) != want:
        raise ValueError(
            f"logits must have shape {want + ('V',)} to match labels {want}, got {tuple(logits.shape)}"
        )
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a vocabulary dimension V >= 1")
    if logits.device != labels.device:
        raise ValueError(f"logits is on {logits.device} but labels is on {labels.device}")
    return logits


def check_linear(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor
) -> None:
    """``hidden [B, T, H]`` / ``[N, H]``, ``weight [V, H]``, ``bias [V]``, matching ``labels``."""
    hidden = check_float("hidden", hidden)
    weight = check_float("weight", weight)
    _check_tensor("labels", labels)
    want = tuple(labels.shape)
    if hidden.dim() != len(want) + 1 or tuple(hidden.shape[:-1]) != want:
        raise ValueError(f"hidden must have shape {want + ('H',)} to match labels {want}, got {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = {hidden.shape[-1]} (hidden's last dimension), got {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError("weight must have V >= 1 rows")
    if bias is not None:
        bias = check_float("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [V] = ({weight.shape[0]},), got {tuple(bias.shape)}")
    check_same_device(labels=labels, hidden=hidden, weight=weight, bias=bias)
