"""The table fitting every command uses: folding at separators, the least important columns left
out first, plain text when not a terminal."""

from __future__ import annotations

import io
from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from crashsafe.cli._tables import Column, fold, print_table

from .conftest import BOX, assert_fits

names = st.text(st.sampled_from("abcxyz_0123"), min_size=1, max_size=30)


@given(st.lists(names, min_size=1, max_size=8), st.integers(4, 60))
def test_fold_keeps_every_character_and_breaks_after_dots(parts: list[str], width: int) -> None:
    path = ".".join(parts)
    lines = fold(path, width, ".").split("\n")
    assert "".join(lines) == path  # nothing cut, nothing added
    assert all(len(line) <= width for line in lines)
    for line, following in pairwise(lines):
        if line.endswith("."):  # right after the last dot that fitted
            assert "." not in following[: width - len(line)]
        else:  # no dot fitted: cut at the width
            assert len(line) == width and "." not in line


def _render(columns: list[Column], rows: list[list[str]], width: int, terminal: bool) -> str:
    out = io.StringIO()
    on = Console(file=out, width=width, force_terminal=terminal, color_system=None)
    print_table("title", columns, rows, on=on)
    return out.getvalue()


def test_least_important_columns_go_first_and_are_named() -> None:
    columns = [
        Column("path", folds=True, breaks=".", min_width=30),
        Column("dtype"),
        Column("size", right=True, drop=2),
        Column("ratio", right=True, drop=5),
        Column("codec", drop=3),
    ]
    rows = [
        ["model.encoder.layers.0.attention.query.weight", "bfloat16", "1.5 MiB", "3.00x", "zstd(level=3)"]
    ]
    wide = _render(columns, rows, 120, terminal=False)
    assert "ratio" in wide and "left out" not in wide
    narrow = _render(columns, rows, 60, terminal=False)
    header = narrow.splitlines()[1].split()
    assert header == ["path", "dtype", "size"]  # ratio (5) went first, then codec (3)
    assert "(left out at 60 columns: ratio, codec; see --json)" in narrow
    assert_fits(narrow, 60)
    assert "bfloat16" in narrow and "1.5 MiB" in narrow  # kept columns are never squeezed


def test_plain_when_not_a_terminal_boxed_when_it_is() -> None:
    columns = [Column("path", folds=True, breaks="."), Column("status", folds=True, min_width=10)]
    rows = [["a.b", "damaged: checkpoint step 3 fails its checksum (data.bin bytes 0..7391 are damaged)"]]
    plain = _render(columns, rows, 40, terminal=False)
    boxed = _render(columns, rows, 40, terminal=True)
    assert not set(plain) & BOX and set(boxed) & BOX
    assert all(line == line.rstrip() for line in plain.splitlines())  # no padding after the last column
    for text in (plain, boxed):
        assert_fits(text, 40)
        words = " ".join(line.strip("│┃ ") for line in text.splitlines())
        assert "(data.bin bytes 0..7391 are damaged)" in " ".join(words.split())  # wrapped, whole


def test_markup_in_cells_is_shown_as_it_is() -> None:
    rows = [["state[0].w[bold]", "x"]]
    text = _render([Column("path", folds=True), Column("v")], rows, 80, terminal=False)
    assert "state[0].w[bold]" in text
