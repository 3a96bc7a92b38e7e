"""The reports' one table printer (``tools/table.py``): columns padded to their width and aligned as declared,
numbers formatted by their column, titles over their cells, Markdown rows; bad declarations refused."""

from __future__ import annotations

import pytest

from gspo_kernels.tools.table import Column, markdown_header, markdown_row, text_header, text_row

COLUMNS = (Column("name", 6, "<"), Column("ms", 7, spec=".2f"), Column("err", 9, spec=".1e"))


def test_cells_are_formatted_padded_and_aligned_under_their_titles():
    header = text_header(COLUMNS, indent="  ", tail="result")
    row = text_row(COLUMNS, ["abc", 3.14159, 2.5e-7], indent="  ", tail="pass")
    assert header == "  name        ms       err  result"
    assert row == "  abc       3.14   2.5e-07  pass"
    # every title ends (right-aligned) or starts (left-aligned) where its cells do
    assert header.index("ms") + 2 == row.index("3.14") + 4 and header.index("name") == row.index("abc")
    assert header.index("result") == row.index("pass")


def test_a_string_cell_is_shown_as_it_is_and_no_tail_leaves_no_trailing_space():
    assert text_row(COLUMNS, ["x", "-", "n/a"]) == "x            -       n/a"


def test_a_long_cell_pushes_its_row_unless_the_column_clips_it():
    assert text_row(COLUMNS[:2], ["abcdefgh", 1.0]) == "abcdefgh    1.00"
    clipped = (Column("name", 6, "<", clip=True), COLUMNS[1])
    assert text_row(clipped, ["abcdefgh", 1.0]) == "abcdef    1.00"


def test_markdown_rows():
    assert markdown_header(["a", "b"]) == ["| a | b |", "|---|---|"]
    assert markdown_row(["x", 0.5, ""]) == "| x | 0.5 |  |"


def test_bad_declarations_and_rows_are_refused():
    with pytest.raises(ValueError, match="align"):
        Column("a", 3, "^")
    with pytest.raises(ValueError, match="width"):
        Column("a", 0)
    with pytest.raises(ValueError, match="2 values for 3 columns"):
        text_row(COLUMNS, ["a", 1.0])
