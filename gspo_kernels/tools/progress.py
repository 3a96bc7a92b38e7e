"""The progress of a run of steps, on stderr: tqdm's bar on a terminal, one plain line per step anywhere else.

tqdm writes a carriage-return frame per update whatever its stream is, so a log or a pipe (CI) would hold one
endless line of them; there (and where tqdm is not installed) each step gets a line of its own instead:
``[3/27] 41 s  linear / gspo-cpu``, then ``done: 27 steps in 512 s``.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Iterator, Optional, Sequence, TextIO, TypeVar

T = TypeVar("T")


def _tqdm_bar(total: int, stream: TextIO):
    """tqdm's bar on ``stream`` when it is a terminal and tqdm is installed; None otherwise."""
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, file=stream, dynamic_ncols=True, bar_format="{l_bar}{bar}| {n}/{total} "
                "[{elapsed}<{remaining}] {postfix}")


def track(items: Sequence[T], label: Callable[[T], str], stream: Optional[TextIO] = None) -> Iterator[T]:
    """Yield each of ``items`` in order, showing ``label(item)`` while its step runs (on ``stream``, default
    stderr): a tqdm bar on a terminal, else one line as each step starts and one when the last has ended."""
    stream = sys.stderr if stream is None else stream
    total, start = len(items), time.time()
    bar = _tqdm_bar(total, stream)
    try:
        for i, item in enumerate(items):
            if bar is not None:
                bar.set_postfix_str(label(item)[:48])
            else:
                stream.write(f"[{i + 1}/{total}] {time.time() - start:.0f} s  {label(item)}\n")
                stream.flush()
            yield item
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if bar is None:
        stream.write(f"done: {total} steps in {time.time() - start:.0f} s\n")
        stream.flush()
