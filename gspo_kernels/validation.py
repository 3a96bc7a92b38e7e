"""Input validation (one rule per check) and the canonical flat token layout every backend works on.

Both layouts of the spec end up as ``N`` tokens in response order:

* padded: labels ``[B, T]`` with an optional ``mask [B, T]``; token ``b * T + t``; ``S = B``;
* packed: labels ``[N]`` with ``cu_seqlens [S + 1]`` (int32/int64) and an optional token ``mask [N]``.

Two kinds of checks (the policies are in ``docs/policies.md``):

* **structure** (types, shapes, dtypes, devices, scalar options): plain Python on metadata, raised at
  once as ``TypeError`` / ``ValueError`` naming the argument, in eager mode and under ``torch.compile``.
* **values** (labels in range at unmasked positions, ``mask`` holding only 0 and 1, ``cu_seqlens`` well
  formed, ``num_items_in_batch`` finite and > 0, and with ``check_finite=True`` the float inputs finite at
  unmasked positions): gathered in a :class:`ValueChecks` and read back with **one** host sync; a failure
  raises ``ValueError`` naming the argument, the position and the value. Under ``torch.compile`` the
  same conditions become ``torch._assert_async`` nodes in the graph (a ``RuntimeError`` with the rule's
  text on CPU, a device-side assert on CUDA): never skipped, never a host sync.

Meta tensors have no values to check or compute with: they are refused (:func:`check_same_device`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple, Union

import torch
from torch import Tensor

if TYPE_CHECKING:  # config.py imports this module (the temperature rule); no import cycle at run time
    from gspo_kernels.config import GSPOConfig

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class TokenBatch:
    """Where the ``N`` tokens of a batch belong.

    Attributes:
        mask: ``[N]`` float32, 1 for tokens that count, 0 otherwise.
        seq_index: ``[N]`` int64, the response each token belongs to (always in ``[0, S)``).
        cu_seqlens: ``[S + 1]`` int32, response boundaries (``arange(0, B*T+1, T)`` when padded).
        num_seqs: ``S``.
        token_shape: ``(B, T)`` for the padded layout, ``(N,)`` for the packed one.
    """

    mask: Tensor
    seq_index: Tensor
    cu_seqlens: Tensor
    num_seqs: int
    token_shape: tuple


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
    num_items_in_batch: Optional[Tensor]  # 0-dim float32, finite and > 0


# ---------------------------------------------------------------------------------------------
# Value checks: one host sync in eager mode, traced asserts under torch.compile.
# ---------------------------------------------------------------------------------------------


def tracing() -> bool:
    """True under ``torch.compile`` tracing: value checks become ``torch._assert_async`` graph nodes."""
    return torch.compiler.is_compiling()


class ValueChecks:
    """Checks that read tensor values, gathered so that :meth:`run` reads them all with one host sync.

    Each check is a 0-dim bool tensor ``bad`` (True = the input breaks the rule), the rule's text (used
    as is under ``torch.compile``, where values cannot be printed) and a function that builds the eager
    error message from the offending values (called only on failure).
    """

    def __init__(self) -> None:
        self._checks: List[Tuple[Tensor, str, Callable[[], str]]] = []

    def add(self, bad: Tensor, rule: str, detail: Optional[Callable[[], str]] = None) -> None:
        self._checks.append((bad.reshape(()), rule, detail or (lambda: rule)))

    def run(self) -> None:
        """Raise ``ValueError`` (eager) for the first broken rule; under ``torch.compile`` assert each."""
        checks, self._checks = self._checks, []
        if not checks:
            return
        if tracing():
            for bad, rule, _ in checks:
                torch._assert_async(torch.logical_not(bad), rule)
            return
        device = checks[0][0].device
        flags = torch.stack([bad.to(device) for bad, _, _ in checks]).tolist()  # the one host sync
        for flag, (_, _, detail) in zip(flags, checks):
            if flag:
                raise ValueError(detail())


def _first(bad: Tensor) -> int:
    """Flat index of the first True of ``bad`` (error path only)."""
    return int(torch.nonzero(bad.reshape(-1))[0, 0])


# ---------------------------------------------------------------------------------------------
# Structure: types, dtypes, devices, scalar options.
# ---------------------------------------------------------------------------------------------


def check_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_float(name: str, value: object) -> Tensor:
    value = check_tensor(name, value)
    if value.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor (fp16, bf16, fp32 or fp64), got {value.dtype}")
    return value


def check_integer(name: str, value: object) -> Tensor:
    value = check_tensor(name, value)
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    return value


def check_same_device(**tensors: Optional[Tensor]) -> torch.device:
    """All given tensors share one device, and it is not ``meta`` (the first one named is the reference)."""
    device = None
    first = None
    for name, value in tensors.items():
        if not isinstance(value, Tensor):
            continue
        if device is None:
            device, first = value.device, name
        elif value.device != device:
            raise ValueError(f"{name} is on {value.device} but {first} is on {device}: all tensors must share a device")
    if device is not None and device.type == "meta":
        raise ValueError(
            f"{first} is on the meta device: gspo_kernels computes on real tensors only (meta tensors have "
            f"shapes but no values to check or compute with)"
        )
    return device


def check_temperature(temperature: object, name: str = "temperature") -> float:
    """The softmax temperature: a finite number > 0 (``GSPOConfig`` and the log-prob functions alike)."""
    if (
        not isinstance(temperature, (int, float))
        or isinstance(temperature, bool)
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def check_logits(logits: Tensor, labels: Tensor, cu_seqlens: Optional[Tensor]) -> Tensor:
    """``logits`` must be ``[B, T, V]`` (padded) or ``[N, V]`` (packed), matching ``labels``."""
    logits = check_float("logits", logits)
    check_tensor("labels", labels)
    want = tuple(labels.shape)
    if logits.dim() != len(want) + 1 or tuple(logits.shape[:-1]) != want:
        raise ValueError(
            f"logits must have shape {want + ('V',)} to match labels {want}, got {tuple(logits.shape)}"
        )
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a vocabulary dimension V >= 1")
    check_same_device(logits=logits, labels=labels, cu_seqlens=cu_seqlens)
    return logits


def check_linear(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor
) -> None:
    """``hidden [B, T, H]`` / ``[N, H]``, ``weight [V, H]``, ``bias [V]``, matching ``labels``."""
    hidden = check_float("hidden", hidden)
    weight = check_float("weight", weight)
    check_tensor("labels", labels)
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


# ---------------------------------------------------------------------------------------------
# The token layout, labels, mask, num_items_in_batch.
# ---------------------------------------------------------------------------------------------


def flatten_token_layout(
    labels: Tensor,
    *,
    mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    checks: Optional[ValueChecks] = None,
) -> TokenBatch:
    """Validate the token layout and build the :class:`TokenBatch`.

    Value rules (``mask`` only 0/1, ``cu_seqlens`` from 0 to ``N`` non-decreasing) are added to ``checks``;
    without ``checks`` they run before returning.
    """
    own = checks is None
    checks = ValueChecks() if own else checks
    labels = check_integer("labels", labels)
    device = check_same_device(labels=labels, mask=mask, cu_seqlens=cu_seqlens)
    if cu_seqlens is None:
        if labels.dim() != 2:
            raise ValueError(
                f"labels must be [B, T] for the padded layout (or [N] with cu_seqlens for the packed one), "
                f"got shape {tuple(labels.shape)}"
            )
        B, T = labels.shape
        token_mask = _token_mask(mask, (B, T), device, checks)
        cu = torch.arange(0, B * T + 1, max(T, 1), device=device, dtype=torch.int32)[: B + 1]
        if T == 0:
            cu = torch.zeros(B + 1, device=device, dtype=torch.int32)
        seq_index = torch.arange(B, device=device).repeat_interleave(T)
        batch = TokenBatch(token_mask.reshape(-1), seq_index, cu, B, (B, T))
    else:
        batch = _packed_layout(labels, mask, check_tensor("cu_seqlens", cu_seqlens), checks)
    if own:
        checks.run()
    return batch


def _packed_layout(labels: Tensor, mask: Optional[Tensor], cu_seqlens: Tensor, checks: ValueChecks) -> TokenBatch:
    device = labels.device
    if labels.dim() != 1:
        raise ValueError(f"labels must be [N] when cu_seqlens is given (packed layout), got shape {tuple(labels.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [S + 1], got shape {tuple(cu_seqlens.shape)}")
    N = labels.shape[0]
    S = cu_seqlens.numel() - 1
    if S == 0 and N > 0:
        raise ValueError(f"cu_seqlens = [0] describes no response but labels holds N = {N} tokens")
    token_mask = _token_mask(mask, (N,), device, checks)
    cu = cu_seqlens.detach().to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    checks.add(cu[0] != 0, "cu_seqlens must start at 0",
               lambda: f"cu_seqlens must start at 0, got cu_seqlens[0] = {int(cu[0])}")
    checks.add((lengths < 0).any(), "cu_seqlens must be non-decreasing",
               lambda: (lambda i: f"cu_seqlens must be non-decreasing, but cu_seqlens[{i + 1}] < cu_seqlens[{i}]")(
                   _first(lengths < 0)))
    checks.add(cu[-1] != N, "cu_seqlens must end at N (the number of labels)",
               lambda: f"cu_seqlens must end at N = {N} (the number of labels), got cu_seqlens[-1] = {int(cu[-1])}")
    # Token t belongs to the response i with cu[i] <= t < cu[i + 1]. searchsorted + clamp keeps every index
    # in [0, S) whatever cu_seqlens holds, so nothing downstream can index out of bounds even when the
    # value checks above are device asserts that have not fired yet.
    positions = torch.arange(N, device=device, dtype=torch.int64)
    seq_index = torch.searchsorted(cu[1:].contiguous(), positions, right=True).clamp_(max=max(S - 1, 0))
    return TokenBatch(token_mask, seq_index, cu.to(torch.int32), S, (N,))


def _token_mask(mask: Optional[Tensor], shape: tuple, device: torch.device, checks: ValueChecks) -> Tensor:
    """The 0/1 float32 token mask; ``mask`` may be bool, integer or float, holding only 0 and 1."""
    if mask is None:
        return torch.ones(shape, device=device, dtype=torch.float32)
    mask = check_tensor("mask", mask)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask must have shape {tuple(shape)} (like labels), got {tuple(mask.shape)}")
    if mask.dtype.is_complex:
        raise TypeError(f"mask must be bool, integer or float (0/1), got {mask.dtype}")
    mask = mask.detach()
    if mask.dtype != torch.bool:
        not_binary = (mask != 0) & (mask != 1)  # NaN included
        checks.add(
            not_binary.any(),
            "mask must hold only 0 and 1 (bool, integer or float)",
            lambda: f"mask must hold only 0 and 1 (bool, integer or float); flat position "
            f"{_first(not_binary)} holds {mask.reshape(-1)[_first(not_binary)].item()}",
        )
    return (mask != 0).to(torch.float32).reshape(shape)


def check_labels(
    labels: Tensor, vocab_size: int, checks: ValueChecks, counted: Optional[Tensor] = None
) -> Tensor:
    """Labels flattened to ``[N]`` int64. The rule: labels at counted positions lie in ``[0, V)``.

    ``counted``: ``[N]`` bool (the unmasked positions of a loss) or None (every position counts, as in
    :func:`gspo_kernels.token_logprobs`). Positions that do not count are set to 0.
    """
    labels = check_integer("labels", labels)
    flat = labels.detach().reshape(-1).to(torch.int64)
    out_of_range = (flat < 0) | (flat >= vocab_size)
    where = " at unmasked positions" if counted is not None else ""
    if counted is not None:
        out_of_range = out_of_range & counted
    if flat.numel():
        checks.add(
            out_of_range.any(),
            f"labels must lie in [0, V) (the vocabulary size){where}",
            lambda: f"labels must lie in [0, {vocab_size}) (the vocabulary size){where}; flat position "
            f"{_first(out_of_range)} holds {int(flat[_first(out_of_range)])}",
        )
    return flat if counted is None else torch.where(counted, flat, torch.zeros_like(flat))


def check_num_items(value: Union[None, int, float, Tensor], device: torch.device, checks: ValueChecks) -> Optional[Tensor]:
    """``num_items_in_batch``: one rule for ints, floats and tensors: a finite number > 0.

    A tensor must hold one element, be integer or float, and live on the inputs' device (a 0-dim CPU
    tensor is also accepted, as PyTorch accepts CPU scalars); its value is checked like a number's
    (eagerly with the other value checks, as an assert under ``torch.compile``). Returns a 0-dim float32
    tensor on ``device``, used as given (never clamped).
    """
    if value is None:
        return None
    rule = "num_items_in_batch must be a finite number > 0"
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"num_items_in_batch must be a scalar, got shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.dtype.is_complex:
            raise TypeError(f"num_items_in_batch must be an integer or float tensor, got {value.dtype}")
        if value.device != device and not (value.device.type == "cpu" and value.dim() == 0):
            raise ValueError(f"num_items_in_batch is on {value.device} but labels is on {device}")
        items = value.detach().reshape(()).to(device=device, dtype=torch.float32)
        bad = ~(torch.isfinite(items) & (items > 0))
        checks.add(bad, rule, lambda: f"{rule}, got {value.item()!r}")
        return items
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{rule}, got {value!r}")
        return torch.tensor(float(value), device=device, dtype=torch.float32)
    raise TypeError(f"num_items_in_batch must be an int, float or scalar tensor, got {type(value).__name__}")


def _per_token(name: str, value: Optional[Tensor], batch: TokenBatch) -> Optional[Tensor]:
    if value is None:
        return None
    value = check_float(name, value)
    if tuple(value.shape) != tuple(batch.token_shape):
        raise ValueError(f"{name} must have the token shape {tuple(batch.token_shape)}, got {tuple(value.shape)}")
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
    config: Optional["GSPOConfig"] = None,
    beta: Optional[float] = None,
    check_finite: bool = False,
    checks: Optional[ValueChecks] = None,
) -> LossInputs:
    """Validate every loss input against the layout and flatten it to ``[N]`` / ``[S]``.

    ``config`` (or, for callers without one, ``beta``) says whether ``ref_logprobs`` is required.
    ``check_finite``: also require the float inputs to be finite at unmasked positions. The value checks
    run before returning, with those already in ``checks`` (one host sync for all of them).
    """
    check_same_device(labels=labels, advantages=advantages, old_logprobs=old_logprobs, mask=mask,
                      cu_seqlens=cu_seqlens, ref_logprobs=ref_logprobs, is_ratio=is_ratio)
    checks = ValueChecks() if checks is None else checks
    beta = (config.beta if config is not None else 0.0) if beta is None else beta
    batch = flatten_token_layout(labels, mask=mask, cu_seqlens=cu_seqlens, checks=checks)
    device = labels.device
    counted = batch.mask > 0
    flat_labels = check_labels(labels, vocab_size, checks, counted)

    advantages = check_float("advantages", advantages)
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

    old = _per_token("old_logprobs", old_logprobs, batch)
    ref = _per_token("ref_logprobs", ref_logprobs, batch)
    if beta > 0 and ref is None:
        raise ValueError("ref_logprobs is required when beta > 0 (the KL term needs the reference log-probs)")

    ratio = None
    if is_ratio is not None:
        is_ratio = check_float("is_ratio", is_ratio)
        if tuple(is_ratio.shape) == tuple(batch.token_shape):
            ratio = _upcast(is_ratio.detach().reshape(-1))
        elif tuple(is_ratio.shape) in ((S,), (S, 1)):
            ratio = _upcast(is_ratio.detach().reshape(-1))[batch.seq_index]
        else:
            raise ValueError(
                f"is_ratio must be per token {tuple(batch.token_shape)} or per response ({S},), "
                f"got {tuple(is_ratio.shape)}"
            )

    items = check_num_items(num_items_in_batch, device, checks)

    if check_finite:
        if per_token:
            check_finite_values("advantages", adv, checks, counted)
        else:  # the advantage of a response with at least one unmasked token
            has_tokens = torch.zeros(S, device=device).index_add_(0, batch.seq_index, batch.mask) > 0
            check_finite_values("advantages", adv, checks, has_tokens)
        for name, value in (("old_logprobs", old), ("ref_logprobs", ref if beta > 0 else None), ("is_ratio", ratio)):
            if value is not None:
                check_finite_values(name, value, checks, counted)
    checks.run()
    return LossInputs(flat_labels, batch, adv, per_token, old, ref, ratio, items)


# ---------------------------------------------------------------------------------------------
# check_finite=True: non-finite values at unmasked positions become errors (docs/policies.md).
# ---------------------------------------------------------------------------------------------


def check_finite_values(name: str, values: Tensor, checks: ValueChecks, counted: Optional[Tensor] = None) -> None:
    """``values`` (any shape; ``counted`` flat ``[numel]`` bool or None) hold no NaN / inf where counted."""
    flat = values.detach().reshape(-1)
    bad = ~torch.isfinite(flat)
    if counted is not None:
        bad = bad & counted
    where = " at unmasked positions" if counted is not None else ""
    checks.add(bad.any(), f"{name} must be finite{where} (check_finite=True)",
               lambda: f"{name} must be finite{where} (check_finite=True); flat position {_first(bad)} "
               f"holds {flat[_first(bad)].item()}")


def check_finite_logits(
    logits: Tensor, labels: Optional[Tensor], checks: ValueChecks, counted: Optional[Tensor] = None
) -> None:
    """Rows of ``logits [..., V]`` that count hold no NaN or +inf, and a finite logit at their label.

    ``-inf`` on other columns is valid (vocabulary masking). One pass of row maxima over the logits:
    no ``[N, V]`` temporary. ``labels``: flat ``[N]`` int64 in ``[0, V)``, or None for a vocabulary shard
    (``vocab_parallel``) that may not hold the label: NaN / +inf only, and a shard may be all ``-inf``.
    """
    logits = logits.detach()
    row_max = logits.amax(dim=-1).reshape(-1)  # NaN if the row holds a NaN, +inf if it holds +inf
    if labels is None:
        at_label = row_max.new_zeros(())
        row_max = torch.where(row_max == float("-inf"), 0.0, row_max)
    else:
        index = labels.clamp(0, logits.shape[-1] - 1).reshape(logits.shape[:-1]).unsqueeze(-1)  # in bounds
        at_label = logits.gather(-1, index).reshape(-1)
    bad = ~(torch.isfinite(row_max) & torch.isfinite(at_label))
    if counted is not None:
        bad = bad & counted
    rule = "logits must hold no NaN or +inf and a finite logit at the label in every unmasked row (check_finite=True)"
    checks.add(bad.any(), rule, lambda: f"{rule}; flat row {_first(bad)} breaks it "
               f"(row max {row_max[_first(bad)].item()}, label logit {at_label[_first(bad)].item()})")


def check_finite_linear(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Optional[Tensor], checks: ValueChecks,
    counted: Optional[Tensor] = None,
) -> None:
    """``hidden`` rows that count and all of ``weight`` are finite; ``bias`` holds no NaN / +inf and is
    finite at the labels of counted rows (``-inf`` elsewhere masks a vocabulary entry, which is valid).
    ``labels`` None: a vocabulary shard that may not hold the labels (the bias label check is skipped)."""
    rows_ok = torch.isfinite(hidden.detach()).all(dim=-1).reshape(-1)
    bad_rows = ~rows_ok if counted is None else (~rows_ok & counted)
    checks.add(bad_rows.any(), "hidden must be finite at unmasked positions (check_finite=True)",
               lambda: f"hidden must be finite at unmasked positions (check_finite=True); flat row "
               f"{_first(bad_rows)} holds a NaN or inf")
    check_finite_values("weight", weight, checks)
    if bias is not None:
        b = bias.detach()
        at_label = b.new_zeros(()) if labels is None else b[labels.clamp(0, b.shape[0] - 1)]
        if counted is not None and labels is not None:
            at_label = torch.where(counted, at_label, b.new_zeros(()))
        bad = torch.isnan(b).any() | (b == float("inf")).any() | ~torch.isfinite(at_label).all()
        checks.add(bad, "bias must hold no NaN or +inf, and be finite at the labels of unmasked rows (check_finite=True)")


def check_memory_budget(memory_budget: Optional[int]) -> None:
    """``memory_budget``: None (the backend's default) or an int number of bytes >= 0."""
    if memory_budget is None:
        return
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 0:
        raise ValueError(f"memory_budget must be None or a number of bytes >= 0 (an int), got {memory_budget!r}")
