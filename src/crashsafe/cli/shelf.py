"""``crashsafe shelf ...``: look inside a persistent-memory shelf file."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from crashsafe.cli._common import command_group, console, err, fail, human_bytes

app = command_group("shelf", "Inspect persistent-memory shelves (crash-consistent in-place state).")


def _when(timestamp: object) -> str:
    if not isinstance(timestamp, (int, float)):
        return "?"
    return datetime.datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="seconds")


def _value(kind: str, value: Any) -> str:
    if kind == "array":
        return ""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@app.command("inspect")
def inspect_cmd(
    path: Annotated[Path, typer.Argument(help="the shelf file")],
    verify: Annotated[bool, typer.Option(help="check every variable's checksum")] = True,
) -> None:
    """List variables (type, shape, size, version), the last committed transaction, and any
    transaction a crash left to roll back. Exits 1 if a variable fails its checksum."""
    from crashsafe.errors import CrashsafeError
    from crashsafe.shelf.inspect import inspect_shelf

    try:
        with Progress(
            TextColumn("[bold]verifying"), BarColumn(), DownloadColumn(), console=err, transient=True
        ) as progress:
            task = progress.add_task("verify", total=None)
            report = inspect_shelf(
                path,
                verify=verify,
                progress=lambda done, total: progress.update(task, completed=done, total=total),
            )
    except CrashsafeError as exc:
        raise fail(str(exc)) from None
    # names and values are the shelf's (anyone's): shown as Text, never read as markup ("a[/]b")
    table = Table(title=Text(f"{path}  (format {report.format_version}, created {_when(report.created)})"))
    for col in ("variable", "kind", "dtype", "shape", "bytes", "version", "value", "status"):
        table.add_column(col, justify="right" if col in ("bytes", "version") else "left")
    for v in report.variables:
        status = {True: "[green]ok[/]", False: "[red]DAMAGED[/]", None: "-"}[v.intact]
        shape = ("x".join(map(str, v.shape)) or "()") if v.kind == "array" else ""
        size = human_bytes(v.nbytes) if v.kind != "scalar" else ""
        value = Text(_value(v.kind, v.value))
        table.add_row(Text(v.name), v.kind, v.dtype, shape, size, str(v.version), value, status)
    console.print(table)
    tx = report.last_transaction
    console.print(
        Text(
            f"arena {human_bytes(report.size)}: {human_bytes(report.used)} of "
            f"{human_bytes(report.data_bytes)} data in use by {len(report.variables)} variables"
        )
    )
    console.print(
        Text(
            f"last committed transaction: #{tx.get('seq', '?')} at {_when(tx.get('time'))}; "
            f"changed {tx.get('changed', [])}, deleted {tx.get('deleted', [])}  "
            f"(metadata seq {report.seq}; other copy: {report.spare_slot})"
        )
    )
    if report.loop:
        console.print(
            Text(f"loop over {list(report.loop)}: each array has a spare block; its commits are loop records")
        )
    if report.last_rollback:
        rb = report.last_rollback
        console.print(
            Text(
                f"last rollback: transaction #{rb.get('tx')} at {_when(rb.get('time'))} "
                f"({rb.get('reason')}); restored in place: {rb.get('restored')}"
            )
        )
    if report.pending:
        console.print(
            f"[yellow]incomplete transaction #{report.pending.seq}[/] (began "
            f"{_when(report.pending.started)}, {len(report.pending.undo)} blocks overwritten "
            "in place): the next Shelf(path) rolls it back"
        )
    if report.lost:
        first, last = report.lost
        err.print(
            f"[bold red]committed loop transactions #{first}..#{last} are lost[/]: the loop's newest "
            f"record is damaged, so the shelf holds #{first - 1}. Restore the file from a copy, or "
            "run those iterations again"
        )
    if report.damaged:
        err.print(
            f"[bold red]{len(report.damaged)} variable(s) fail their checksums:[/] "
            f"{escape(', '.join(report.damaged))}. Restore the file from a copy."
        )
    if report.damaged or report.lost:
        raise typer.Exit(1)
