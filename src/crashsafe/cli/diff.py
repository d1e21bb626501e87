"""``crashsafe diff``: which tensors and values differ between two steps, and by how much.

Exit code 0 when the steps are identical (same paths, every one bit-identical), 1 when they differ,
2 on an error (as diff(1)).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import typer
from rich.text import Text

from crashsafe.cli._common import (
    JsonOpt,
    OptionsOpt,
    check_step,
    console,
    emit_json,
    fail,
    locate,
    parse_options,
    step_option,
)
from crashsafe.cli._tables import Cell, Column, print_table
from crashsafe.diff import PathDiff, StepDiff, diff_steps
from crashsafe.errors import CrashsafeError

__all__ = ["diff_cmd"]

_STATUS = {  # status: (in a row, in the count, colour)
    "identical": ("identical", "identical", "green"),
    "differs": ("differs", "differ", "red"),
    "only_a": ("only in A", "only in A", "yellow"),
    "only_b": ("only in B", "only in B", "yellow"),
    "dtype_changed": ("dtype", "dtype changed", "red"),
    "shape_changed": ("shape", "shape changed", "red"),
}


def diff_cmd(
    first: Annotated[
        str, typer.Argument(metavar="DIR", help="the checkpoint (A and B are then its steps), or DIR_A")
    ],
    second: Annotated[str, typer.Argument(metavar="A", help="step A, or DIR_B")],
    third: Annotated[str | None, typer.Argument(metavar="B", help="step B (with DIR A B)")] = None,
    step_a: Annotated[
        int | None,
        typer.Option("--step-a", callback=step_option, help="with DIR_A DIR_B: A's step (default: newest)"),
    ] = None,
    step_b: Annotated[
        int | None,
        typer.Option("--step-b", callback=step_option, help="with DIR_A DIR_B: B's step (default: newest)"),
    ] = None,
    prefix: Annotated[
        list[str] | None, typer.Option("--prefix", help="only paths starting with this (repeatable)")
    ] = None,
    show_all: Annotated[bool, typer.Option("--all", help="also list the identical paths")] = False,
    storage_options: OptionsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Compare two steps path by path: only in A or B, dtype or shape changed, bit-identical, or the
    count of changed elements and the max/mean absolute difference. `crashsafe diff DIR A B` compares
    two steps of one checkpoint; `crashsafe diff DIR_A DIR_B` the newest steps of two. Exit code 0
    when identical, 1 when they differ."""
    if third is not None:
        if step_a is not None or step_b is not None:
            raise fail("--step-a/--step-b go with two directories; with DIR A B the steps are A and B")
        where_a, where_b, step_a, step_b = first, first, _step(second, "A"), _step(third, "B")
    else:
        where_a, where_b = first, second
    same = where_a == where_b
    where_a = locate(where_a)
    where_b = where_a if same else locate(where_b)
    try:
        result = diff_steps(
            where_a,
            step_a,
            where_b,
            step_b,
            prefixes=prefix or (),
            storage_options=parse_options(where_a, storage_options)
            or parse_options(where_b, storage_options),
        )
    except CrashsafeError as exc:
        hint = (
            "" if third is not None else " (to compare two steps of one checkpoint: crashsafe diff DIR A B)"
        )
        raise fail(f"{exc}{hint}") from None
    if as_json:
        emit_json(_json(result))
    else:
        _print(result, show_all)
    if not result.identical:
        raise typer.Exit(1)


def _step(text: str, name: str) -> int:
    """Step ``name`` (A or B) of ``crashsafe diff DIR A B``, checked as a step option is."""
    try:
        step = int(text)
    except ValueError:
        raise fail(
            f"{text!r} is not a step number; use crashsafe diff DIR A B or crashsafe diff DIR_A DIR_B"
        ) from None
    return check_step(step, f"step {name}")


def _json_value(value: Any) -> Any:
    """A python value as JSON: non-finite floats as the strings 'nan', 'inf', '-inf'."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def _json(result: StepDiff) -> dict[str, Any]:
    return {
        "a": {"location": result.location_a, "step": result.step_a},
        "b": {"location": result.location_b, "step": result.step_b},
        "identical": result.identical,
        "counts": result.counts,
        "paths": [
            {
                "path": p.path,
                "status": p.status,
                "kind": p.kind,
                "dtype_a": p.dtype_a,
                "dtype_b": p.dtype_b,
                "shape_a": None if p.shape_a is None else list(p.shape_a),
                "shape_b": None if p.shape_b is None else list(p.shape_b),
                "changed": p.changed,
                "nonfinite": p.nonfinite,
                "max_abs": p.max_abs,
                "mean_abs": p.mean_abs,
                "value_a": _json_value(p.value_a),
                "value_b": _json_value(p.value_b),
            }
            for p in result.paths
        ],
    }


def _layout(dtype: str | None, shape: tuple[int, ...] | None) -> str:
    return f"{dtype} {'x'.join(map(str, shape)) or '()'}" if shape is not None else str(dtype)


def _detail(p: PathDiff) -> str:
    """What changed, in a few words: the two dtypes, shapes or values, or the changed elements."""
    a, b = _layout(p.dtype_a, p.shape_a), _layout(p.dtype_b, p.shape_b)
    if p.status == "only_a":
        return a if p.kind == "tensor" else repr(p.value_a)
    if p.status == "only_b":
        return b if p.kind == "tensor" else repr(p.value_b)
    if p.status in ("dtype_changed", "shape_changed"):
        return f"{a} -> {b}"
    if p.kind == "value":
        return f"{p.value_a!r} -> {p.value_b!r}" if p.status == "differs" else repr(p.value_a)
    if p.status == "identical":
        return a
    size = math.prod(p.shape_a or ())
    nonfinite = f", {p.nonfinite} NaN/inf" if p.nonfinite else ""
    return f"{p.changed} of {size} elements{nonfinite}" if p.changed else "same values, other bits (-0.0/NaN)"


def _number(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _print(result: StepDiff, show_all: bool) -> None:
    if result.location_a == result.location_b:
        title = f"{result.location_a}: A = step {result.step_a}, B = step {result.step_b}"
    else:
        a, b = f"step {result.step_a} of {result.location_a}", f"step {result.step_b} of {result.location_b}"
        title = f"A = {a}, B = {b}"
    columns = [
        Column("path", folds=True, breaks=".", min_width=32),
        Column("status"),
        Column("what changed", folds=True, min_width=16, words=True),  # a number is never split
        Column("max abs", right=True, drop=1),
        Column("mean abs", right=True, drop=2),
    ]
    rows: list[list[Cell]] = []
    for p in result.paths:
        if show_all or p.status != "identical":
            label, _, style = _STATUS[p.status]
            rows.append(
                [p.path, Text(label, style=style), _detail(p), _number(p.max_abs), _number(p.mean_abs)]
            )
    if rows:
        print_table(title, columns, rows)
    else:
        console.print(Text(title))
    counts = ", ".join(f"{n} {_STATUS[s][1]}" for s, n in result.counts.items() if n)
    verdict = (
        Text("identical", style="bold green") if result.identical else Text("they differ", style="bold red")
    )
    console.print(Text.assemble(f"{len(result.paths)} paths ({counts or 'none'}): ", verdict))
