"""Bad input raises on every rank: the ranks agree on the first problem before any other collective.

A rank-local check can differ between ranks (one rank's labels out of range, one rank's shard of another size, one
context-parallel rank with another batch). A rank that raised alone would leave the others blocked in the next
collective. So each check only *records* a :class:`Problem` (an argument name and a message); :func:`agree` then
all-gathers one small integer row per rank over each group in turn (the tensor-parallel group, then the
context-parallel one), and every rank raises ``ValueError`` with the lowest-ranked problem, naming the argument and
the rank that found it. Going over the groups in turn spreads a problem found in one tensor-parallel group to the
context-parallel ranks of the others as well. The messages are formatted from integers on every rank, so that each
rank prints the same text.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

_SLOTS = 6  # integers a problem carries


@dataclasses.dataclass(frozen=True)
class Problem:
    """``code``: the message's index in :data:`MESSAGES`; ``values``: its integers (at most 6)."""

    code: int
    values: tuple = ()


def _shard(v):
    return (f"head: rank {v[0]}'s weight shard holds {v[1]} vocabulary rows, but megatron's vocabulary of {v[2]} "
            f"rows over {v[3]} tensor-parallel ranks gives each {v[2] // max(v[3], 1)} (the head does not fit the "
            f"parallel state)")


def _shards_differ(v):
    return (f"head: the tensor-parallel ranks' weight shards differ: rank {v[0]} holds [{v[1]}, {v[2]}] and rank "
            f"{v[3]} holds [{v[4]}, {v[5]}] (rows, hidden size)")


def _labels(v):
    return (f"labels: rank {v[0]} holds token ids in [{v[1]}, {v[2]}] at counted positions; they must lie in "
            f"[0, {v[3]}) (the head's vocabulary)")


def _hidden_len(v):
    gathered = f" after the sequence-parallel gather over {v[3]} ranks" if v[3] > 1 else ""
    return (f"hidden: rank {v[0]}'s hidden states cover {v[1]} positions x {v[2]} sequences{gathered}, but labels are "
            f"[B, S] = [{v[4]}, {v[5]}]; hidden must be [S, B, H] ([S / tp, B, H] for a sequence-parallel head)")


def _hidden_width(v):
    return f"hidden: rank {v[0]}'s hidden size is {v[1]} but the head's weight is [{v[2]}, {v[3]}]"


def _cp_count(v):
    return (f"cu_seqlens: the context-parallel ranks hold different batches: rank {v[0]} holds {v[1]} sequences and "
            f"rank {v[2]} holds {v[3]} (every rank passes its part of the same sequences, in the same order)")


def sequence_input_differs(name: str, rank: int, sequence: int, other: int) -> str:
    """The message of a per-sequence input (``advantages``, ``is_ratio``) that differs between context-parallel ranks
    (each rank finds the same difference in the all-gathered values, so every rank raises)."""
    return (f"{name}: the context-parallel ranks hold different sequences: sequence {sequence}'s value differs "
            f"between rank {rank} and rank {other} (every rank passes its part of the same sequences, in the same "
            f"order, with the same per-sequence {name})")


MESSAGES: List[Callable[[tuple], str]] = [_shard, _shards_differ, _labels, _hidden_len, _hidden_width, _cp_count]


def code(message: Callable[[tuple], str]) -> int:
    return MESSAGES.index(message)


def _device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_rows(group, row: torch.Tensor) -> List[torch.Tensor]:
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    return rows


def agree(groups: Sequence[Optional["dist.ProcessGroup"]], problem: Optional[Problem],
          compare: Iterable[tuple] = ()) -> None:
    """Raise the same ``ValueError`` on every rank of ``groups`` when any rank has a problem; a no-op otherwise.

    ``groups``: process groups, None entries skipped (one all-gather of ``2 + 6 + len(compare)`` integers each).
    ``compare``: ``(message, values)`` pairs every rank of the *first* group must hold alike (e.g. its shard
    shape); a rank whose values differ from the first rank's is a problem of ``message`` formatted as
    ``(rank_a, *values_a, rank_b, *values_b)`` (at most 2 values each).
    """
    compare = list(compare)
    for index, group in enumerate(g for g in groups if g is not None):
        device = _device(group)
        row = [0, 0] + [0] * _SLOTS
        if problem is not None:
            row[0], row[1] = 1, problem.code
            row[2:2 + len(problem.values)] = [int(v) for v in problem.values]
        extra = [int(v) for _, values in compare for v in values] if index == 0 else []
        rows = [r.tolist() for r in _gather_rows(group, torch.tensor(row + extra, dtype=torch.int64, device=device))]
        found = next((r for r in rows if r[0]), None)
        if found is not None:
            problem = Problem(found[1], tuple(found[2:2 + _SLOTS]))
        elif index == 0 and compare:
            problem = _first_difference(rows, compare)
    if problem is not None:
        raise ValueError(MESSAGES[problem.code](problem.values))


def _first_difference(rows: List[list], compare: List[tuple]) -> Optional[Problem]:
    offset = 2 + _SLOTS
    for message, values in compare:
        width = len(values)
        first = rows[0][offset:offset + width]
        for k, r in enumerate(rows):
            if r[offset:offset + width] != first:
                return Problem(code(message), (0, *first, k, *r[offset:offset + width]))
        offset += width
    return None
