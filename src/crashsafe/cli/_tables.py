"""Tables that stay readable in an 80-column terminal and turn into plain text when piped.

Each column says how it may give way when the table is too wide: a column that ``folds`` (a tensor
path, an error message) wraps over several lines, paths at their dots; other columns keep their
full width, and the least important ones (highest ``drop``) are left out first, with a note naming
them. Nothing is ever cut with an ellipsis. When stdout is not a terminal the table is plain
aligned text: no box characters, no colours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from crashsafe.cli._common import console

__all__ = ["Cell", "Column", "fold", "print_table"]


@dataclass(frozen=True)
class Column:
    """One column: its header, alignment, and how it gives way in a narrow terminal."""

    name: str
    drop: int = 0  # 0: always shown; when too wide, the highest ``drop`` goes first
    right: bool = False  # right-aligned (numbers)
    folds: bool = False  # may wrap over lines instead of widening the table
    breaks: str = ""  # a folding column breaks lines after these characters (".": a dotted path)
    min_width: int = 20  # a folding column narrower than this (or its content) drops other columns first
    words: bool = False  # a folding column that wraps between words only: never narrower than its
    # longest word (a number), while dropping other columns can make room for it


def fold(text: str, width: int, breaks: str) -> str:
    """``text`` broken into lines of at most ``width`` characters, each after the last of
    ``breaks`` that fits (mid-word only where none does)."""
    lines: list[str] = []
    rest = text
    while len(rest) > width:
        cut = max(rest.rfind(b, 0, width) for b in breaks) + 1 or width
        lines.append(rest[:cut])
        rest = rest[cut:]
    return "\n".join([*lines, rest])


Cell = str | Text  # a str is shown as it is (no markup: paths may hold brackets); Text carries style


def print_table(
    title: str | None, columns: Sequence[Column], rows: Sequence[Sequence[Cell]], *, on: Console = console
) -> None:
    """Print ``rows`` fitted to the console's width, boxed on a terminal, plain text otherwise."""
    plain = not on.is_terminal
    natural = [max([len(c.name)] + [_cell_len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    columns = [_word_floor(c, [r[i] for r in rows]) for i, c in enumerate(columns)]
    shown = _fit(columns, natural, on.width, plain)
    widths = _widths([columns[i] for i in shown], [natural[i] for i in shown], on.width, plain)
    table = Table(
        title=None if title is None else Text(title),
        box=None if plain else box.HEAVY_HEAD,
        pad_edge=not plain,
        title_justify="left",
    )
    for i, width in zip(shown, widths, strict=True):
        c = columns[i]
        table.add_column(  # a Text: a metric's name is the user's (or a manifest's), never markup
            Text(c.name),
            justify="right" if c.right else "left",
            width=width,
            no_wrap=not c.folds,
            overflow="fold",
        )
    for row in rows:
        table.add_row(*(_cell(row[i], w, columns[i].breaks) for i, w in zip(shown, widths, strict=True)))
    if plain:  # no colours to keep: plain lines, without the padding rich puts after the last column
        with on.capture() as captured:
            on.print(table)
        on.out("\n".join(line.rstrip() for line in captured.get().splitlines()), highlight=False)
    else:
        on.print(table)
    left_out = [c.name for i, c in enumerate(columns) if i not in shown]
    if left_out:
        on.print(Text(f"(left out at {on.width} columns: {', '.join(left_out)}; see --json)"))


def _word_floor(column: Column, cells: Sequence[Cell]) -> Column:
    """``column`` with its ``min_width`` raised to its longest word, if it wraps between words."""
    if not column.words:
        return column
    words = [cell_len(w) for c in cells for w in (c.plain if isinstance(c, Text) else c).split()]
    return replace(column, min_width=max([column.min_width, *words]))


def _cell_len(cell: Cell) -> int:
    return cell.cell_len if isinstance(cell, Text) else cell_len(cell)


def _cell(cell: Cell, width: int, breaks: str) -> Text:
    if isinstance(cell, Text):
        return cell
    return Text(fold(cell, width, breaks) if breaks else cell)


def _overhead(count: int, plain: bool) -> int:
    """Cells a table of ``count`` columns spends besides their contents (padding, borders)."""
    return 2 * (count - 1) if plain else 3 * count + 1


def _floor(column: Column, natural: int) -> int:
    """The narrowest a column may be before less important columns are dropped."""
    return min(natural, max(column.min_width, len(column.name))) if column.folds else natural


def _need(columns: Sequence[Column], natural: Sequence[int], plain: bool) -> int:
    return _overhead(len(columns), plain) + sum(_floor(c, n) for c, n in zip(columns, natural, strict=True))


def _fit(columns: Sequence[Column], natural: Sequence[int], width: int, plain: bool) -> list[int]:
    """Indices of the columns to show: all, minus the least important ones while it is too wide."""
    shown = list(range(len(columns)))
    while _need([columns[i] for i in shown], [natural[i] for i in shown], plain) > width:
        droppable = [i for i in shown if columns[i].drop > 0]
        if not droppable:
            break
        shown.remove(max(droppable, key=lambda i: (columns[i].drop, i)))
    return shown


def _widths(columns: Sequence[Column], natural: Sequence[int], width: int, plain: bool) -> list[int]:
    """Each shown column's width: its content's, except that folding columns share what is left,
    the most important first (each keeps at least its floor, or 8 cells when nothing is left)."""
    widths = list(natural)
    folding = sorted((i for i, c in enumerate(columns) if c.folds), key=lambda i: (columns[i].drop, i))
    floors = [_floor(c, n) for c, n in zip(columns, natural, strict=True)]
    left = (
        width
        - _overhead(len(columns), plain)
        - sum(n for c, n in zip(columns, natural, strict=True) if not c.folds)
    )
    for k, i in enumerate(folding):
        reserve = sum(floors[j] for j in folding[k + 1 :])
        widths[i] = max(min(natural[i], left - reserve), min(floors[i], max(len(columns[i].name), 8)))
        left -= widths[i]
    return widths
