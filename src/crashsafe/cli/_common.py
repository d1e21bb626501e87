"""What the ``crashsafe`` subcommands share: the consoles, the error exit, byte and age formatting.

Every module of the command line imports these from here, never from the top-level ``app`` (which
imports the subcommands to register them).
"""

from __future__ import annotations

import time

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["age", "command_group", "console", "err", "fail", "human_bytes", "progress_bar"]

console = Console()
err = Console(stderr=True)


def command_group(name: str, help: str) -> typer.Typer:
    """A typer app for one command or group, with the settings every crashsafe command uses."""
    return typer.Typer(
        name=name, help=help, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False
    )


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` as an error on stderr; return the exit to raise (``raise fail(...)``)."""
    err.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


def progress_bar(label: str, counter: str, *, on: Console = err, transient: bool = True) -> Progress:
    """A bar: bold ``label``, the bar, ``counter`` (a rich template of the task), time elapsed."""
    return Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), TextColumn(counter), TimeElapsedColumn(), console=on,
        transient=transient,
    )


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def age(created: float | None) -> str:
    """Time since the Unix time ``created``, short: '42s', '3.5m', '2.0h', '1.5d' ('?' if unknown)."""
    if created is None:
        return "?"
    s = max(0.0, time.time() - created)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f}{unit}"
    return f"{s:.0f}s"
