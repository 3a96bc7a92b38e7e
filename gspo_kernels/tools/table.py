"""The one table printer of the reports (``bench``, ``bench --gpu``, ``h100-report``, ``verify``): fixed-width text
columns, and Markdown rows.

A report declares its columns once (title, width, alignment, the format of a number) and hands each row's values:
a number is formatted with its column's spec, a string is shown as it is; both are padded to the column's width (a
longer cell pushes the rest of its row right, unless the column clips it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Sequence


@dataclass(frozen=True)
class Column:
    """One text column: ``title``, ``width`` (characters), ``align`` (``"<"`` left, ``">"`` right), ``spec`` (the
    format of a number cell, e.g. ``".2f"``), ``clip`` (cut a longer cell to ``width``)."""

    title: str
    width: int
    align: str = ">"
    spec: str = ""
    clip: bool = False

    def __post_init__(self):
        if self.align not in ("<", ">"):
            raise ValueError(f"Column {self.title!r}: align must be '<' or '>', got {self.align!r}")
        if self.width < 1:
            raise ValueError(f"Column {self.title!r}: width must be >= 1, got {self.width}")

    def cell(self, value: object) -> str:
        """``value`` formatted and padded to the column's width."""
        text = value if isinstance(value, str) else format(value, self.spec)
        if self.clip:
            text = text[: self.width]
        return f"{text:{self.align}{self.width}}"


def text_row(columns: Sequence[Column], values: Sequence[object], indent: str = "", tail: str = "") -> str:
    """One line: ``indent``, the cells separated by a space, then ``tail`` (a status, notes) after two spaces when
    there is one."""
    if len(values) != len(columns):
        raise ValueError(f"text_row: {len(values)} values for {len(columns)} columns")
    line = indent + " ".join(column.cell(value) for column, value in zip(columns, values))
    return f"{line}  {tail}" if tail else line


def text_header(columns: Sequence[Column], indent: str = "", tail: str = "") -> str:
    """The columns' titles, aligned as their cells."""
    return text_row(columns, [column.title for column in columns], indent, tail)


def markdown_row(values: Iterable[object]) -> str:
    """``| a | b | c |``."""
    return "| " + " | ".join(str(value) for value in values) + " |"


def markdown_header(titles: Sequence[str]) -> List[str]:
    """A Markdown table's title row and its rule."""
    return [markdown_row(titles), "|---" * len(titles) + "|"]
