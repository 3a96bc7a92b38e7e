"""Argument checks: one rule per check, each naming the argument and what was expected.

Two kinds (the policies are in ``docs/policies.md``):

* **structure** (types, shapes, dtypes, devices, scalar options): plain Python on metadata, raised at
  once as ``TypeError`` / ``ValueError`` naming the argument, in eager mode and under ``torch.compile``.
* **values** (labels in range at unmasked positions, ``mask`` holding only 0 and 1, ``cu_seqlens`` well
  formed, ``num_items_in_batch`` finite and > 0, and with ``check_finite=True`` the float inputs finite at
  unmasked positions): gathered in a :class:`ValueChecks` and read back with **one** host sync; a failure
  raises ``ValueError`` naming the argument, the position and the value. Under ``torch.compile`` the
  same conditions become ``torch._assert_async`` nodes in the graph (a ``RuntimeError`` with the rule's
  text on CPU, a device-side assert on CUDA): never skipped, never a host sync.

Meta tensors have no values to check or compute with: they are refused (:func:`check_same_device`).
Every option is validated here, once; the backends trust what reaches them. This module imports
nothing from the package.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple, Union

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# ---------------------------------------------------------------------------------------------
# Value checks: one host sync in eager mode, traced asserts under torch.compile.
# ---------------------------------------------------------------------------------------------


def tracing() -> bool:
    """True under ``torch.compile`` tracing: value checks become ``torch._assert_async`` graph nodes."""
    return torch.compiler.is_compiling()


def cuda_graph_capturing() -> bool:
    """True while the current CUDA stream is being captured into a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def host_reads_allowed() -> bool:
    """Whether the library may read a device value back to the host now: not under ``torch.compile`` tracing,
    not during CUDA-graph capture. When it may not, value checks become device asserts and the backward
    stages skip no zero-gradient rows that would need a count on the host (the results are the same)."""
    return not (tracing() or cuda_graph_capturing())


class ValueChecks:
    """Checks that read tensor values, gathered so that :meth:`run` reads them all with one host sync.

    Each check is a 0-dim bool tensor ``bad`` (True = the input breaks the rule), the rule's text (used
    as is under ``torch.compile``, where values cannot be printed) and a function that builds the eager
    error message from the offending values (called only on failure).
    """

    def __init__(self) -> None:
        self._checks: List[Tuple[Tensor, str, Callable[[], str]]] = []
        self._fetch: List[Tuple[str, Tensor]] = []
        self.fetched: dict = {}

    def add(self, bad: Tensor, rule: str, detail: Optional[Callable[[], str]] = None) -> None:
        # (not `detail or ...`: torch 2.11's dynamo cannot branch on a nested function's truth value)
        self._checks.append((bad.reshape(()), rule, detail if detail is not None else (lambda: rule)))

    def fetch(self, name: str, values: Tensor) -> None:
        """Read the integer ``values`` (1-D) back with the same host sync as the checks; after :meth:`run` they are
        in ``fetched[name]`` as a list of ints (not when no host read is allowed: the key is then absent)."""
        self._fetch.append((name, values.reshape(-1)))

    def run(self) -> None:
        """Raise ``ValueError`` (eager) for the first broken rule; under ``torch.compile`` assert each. The
        values asked for with :meth:`fetch` are read in the same sync (after the rules: a broken rule raises
        before anything read is used)."""
        checks, self._checks = self._checks, []
        fetch, self._fetch = self._fetch, []
        if not checks and not fetch:
            return
        if not host_reads_allowed():
            for bad, rule, _ in checks:
                torch._assert_async(torch.logical_not(bad), rule)
            return
        device = (checks[0][0] if checks else fetch[0][1]).device
        flags = [bad.to(device) for bad, _, _ in checks]
        if not fetch:  # the rules alone: read the flags as they are (one check: no stack either)
            read = (torch.stack(flags) if len(flags) > 1 else flags[0].reshape(1)).tolist()  # the one host sync
        else:
            parts = [torch.stack(flags).to(torch.int64)] if checks else []
            parts += [values.to(device=device, dtype=torch.int64) for _, values in fetch]
            read = torch.cat(parts).tolist()  # the one host sync
        flags, rest = read[: len(checks)], read[len(checks):]
        for flag, (_, _, detail) in zip(flags, checks):
            if flag:
                raise ValueError(detail())
        for name, values in fetch:
            self.fetched[name], rest = rest[: values.numel()], rest[values.numel():]


def first_true(bad: Tensor) -> int:
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
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor (fp16, bf16, fp32 or fp64), got {value.dtype}")
    return value


def check_integer(name: str, value: object) -> Tensor:
    value = check_tensor(name, value)
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    return value


def check_same_device(**tensors: Optional[Tensor]) -> torch.device:
    """All given tensors share one device, and it is not ``meta`` (the first one named sets the device the others must share)."""
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


def is_finite_number(value: object) -> bool:
    """Whether ``value`` is a finite Python ``int`` or ``float`` (a bool is not a number here)."""
    # ``v - v == 0`` is ``math.isfinite(v)`` (inf - inf and NaN - NaN are NaN), in a form torch.compile traces when
    # it makes a Python float symbolic (``dynamic=True``); math.isfinite is a graph break there
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value - value == 0


def check_temperature(temperature: object, name: str = "temperature") -> float:
    """The softmax temperature: a finite number > 0 (``GSPOConfig`` and the log-prob functions alike)."""
    if not is_finite_number(temperature) or temperature <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def check_softcap(value: object, name: str = "final_logit_softcapping") -> Optional[float]:
    """The logit soft cap ``c`` (logits ``z -> c * tanh(z / c)`` before the temperature): None (no cap) or a
    finite number > 0. A bool or a non-number is a ``TypeError``, any other bad value a ``ValueError``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be None or a finite number > 0, got {type(value).__name__} {value!r}")
    if not is_finite_number(value) or value <= 0:
        raise ValueError(f"{name} must be None or a finite number > 0, got {value!r}")
    return float(value)


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
# Labels and num_items_in_batch.
# ---------------------------------------------------------------------------------------------


def check_labels(
    labels: Tensor, vocab_size: int, checks: ValueChecks, counted: Optional[Tensor] = None
) -> Tensor:
    """Labels flattened to ``[N]`` int64. The rule: labels at counted positions lie in ``[0, V)``.

    ``counted``: ``[N]`` bool (the unmasked positions of a loss) or None (every position counts, as in
    :func:`gspo_kernels.token_logprobs`). Positions that do not count are set to 0.
    """
    labels = check_integer("labels", labels)
    flat = labels.detach().reshape(-1).to(torch.int64).contiguous()  # kernels index labels as a dense [N] array
    where = " at unmasked positions" if counted is not None else ""
    kept = flat if counted is None else torch.where(counted, flat, 0)  # one op: a scalar 0, no zeros tensor
    if flat.numel():
        # Floor division by V is 0 exactly for a label in [0, V) (and for the 0 of a masked position): one op
        # where the two compares, their "or" and the "and" with counted took four. The message (error path
        # only) finds the position again.
        checks.add(
            (kept // vocab_size).any(),
            f"labels must lie in [0, V) (the vocabulary size){where}",
            lambda: (lambda i: f"labels must lie in [0, {vocab_size}) (the vocabulary size){where}; flat position "
                     f"{i} holds {int(flat[i])}")(first_true((kept < 0) | (kept >= vocab_size))),
        )
    return kept


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
        if not (is_finite_number(value) and value > 0):
            raise ValueError(f"{rule}, got {value!r}")
        return torch.full((), float(value), device=device, dtype=torch.float32)  # a fill, no host-to-device copy
    raise TypeError(f"num_items_in_batch must be an int, float or scalar tensor, got {type(value).__name__}")



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
               lambda: f"{name} must be finite{where} (check_finite=True); flat position {first_true(bad)} "
               f"holds {flat[first_true(bad)].item()}")


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
    checks.add(bad.any(), rule, lambda: f"{rule}; flat row {first_true(bad)} breaks it "
               f"(row max {row_max[first_true(bad)].item()}, label logit {at_label[first_true(bad)].item()})")


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
               f"{first_true(bad_rows)} holds a NaN or inf")
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


def check_logprobs_out(logprobs_out: Optional[Tensor], labels: Tensor) -> None:
    """``logprobs_out``: None, or a contiguous floating tensor shaped like ``labels`` on their device."""
    if logprobs_out is None:
        return
    if not isinstance(logprobs_out, Tensor) or not logprobs_out.is_floating_point():
        got = logprobs_out.dtype if isinstance(logprobs_out, Tensor) else type(logprobs_out).__name__
        raise TypeError(f"logprobs_out must be a floating-point tensor, got {got}")
    if logprobs_out.shape != labels.shape or logprobs_out.device != labels.device:
        raise ValueError(f"logprobs_out must have labels' shape {tuple(labels.shape)} on {labels.device}, got "
                         f"{tuple(logprobs_out.shape)} on {logprobs_out.device}")
    if not logprobs_out.is_contiguous() or logprobs_out.requires_grad:
        raise ValueError("logprobs_out must be contiguous and not require grad (it receives detached values)")


def check_bool(name: str, value: object) -> bool:
    """A flag option: exactly ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value
