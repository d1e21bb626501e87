"""What the ``crashsafe`` subcommands share: the consoles, the error exit, the options every command
takes (a location, its storage options, ``--json``), JSON output, byte and age formatting.

Every module of the command line imports these from here, never from the top-level ``app`` (which
imports the subcommands to register them).
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from crashsafe.format.manifest import MAX_STEP
from crashsafe.storage.layout import TRASH_PREFIX, committed_steps, parse_step_name
from crashsafe.storage.stores import is_url

if TYPE_CHECKING:
    from crashsafe.verification import StepReport

__all__ = [
    "Dir",
    "JsonOpt",
    "OptionsOpt",
    "StepOpt",
    "age",
    "check_step",
    "command_group",
    "console",
    "emit_json",
    "err",
    "fail",
    "finish",
    "human_bytes",
    "leftover_line",
    "locate",
    "memory_directory",
    "nested_store",
    "parse_options",
    "part_rank",
    "progress_bar",
    "referred",
    "report_json",
    "step_option",
]

console = Console()
err = Console(stderr=True)

Dir = Annotated[str, typer.Argument(help="checkpoint directory, or an fsspec URL such as s3://bucket/run")]


def check_step(value: int, option: str = "--step") -> int:
    """``value`` if it can be a step number (0 to 2**63-1, as the format allows), else a clear exit 2:
    a step outside that range could never be committed, and the format would refuse it mid-read."""
    if not 0 <= value <= MAX_STEP:
        raise fail(
            f"{option} {value} is not a step number: steps are whole numbers from 0 to {MAX_STEP}; "
            "`crashsafe ls DIR` lists the committed ones"
        )
    return value


def step_option(param: typer.CallbackParam, value: int | None) -> int | None:
    """The callback of a step option: :func:`check_step` under the option's own name."""
    return None if value is None else check_step(value, param.opts[0] if param.opts else "--step")


StepOpt = Annotated[
    int | None,
    typer.Option(
        "--step",
        "-s",
        callback=step_option,
        help="step (default: the newest committed step, even a damaged one; `crashsafe ls` shows which "
        "are intact)",
    ),
]
OptionsOpt = Annotated[
    str | None,
    typer.Option(
        "--storage-options",
        help='JSON for fsspec, for URLs (e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\'); '
        "credentials also come from the usual environment variables",
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="print one JSON document on stdout instead (schema: docs/cli.md)")
]


def parse_options(location: str, text: str | None) -> dict[str, Any] | None:
    """``--storage-options`` as a dict for a URL (None for a local directory or when not given)."""
    if text is None or not is_url(location):
        return None
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise fail(f"--storage-options is not valid JSON: {exc}") from None
    if not isinstance(options, dict):
        raise fail("--storage-options must be a JSON object")
    return options


# stores the integrations keep inside a folder of their framework's: what each is
_NESTED = {
    ".crashsafe": "the store of a Lightning checkpoint folder (CrashsafeCheckpointIO)",
    "crashsafe": "the store of a Hugging Face output_dir (CrashsafeTrainer)",
}


def nested_store(location: str) -> tuple[str, str] | None:
    """(path, what it is) of the crashsafe store an integration keeps inside the local folder
    ``location`` (``ckpt/.crashsafe``, ``output_dir/crashsafe``), when ``location`` holds no committed
    step itself and that store (a real directory, not a link) holds some; else None."""
    if is_url(location) or not location:
        return None
    try:
        if committed_steps(location):
            return None
        for name, what in _NESTED.items():
            inner = os.path.join(location, name)
            if stat.S_ISDIR(os.lstat(inner).st_mode) and committed_steps(inner):
                return inner, what
    except OSError:  # not a folder, not there, not readable: the command says so itself
        return None
    return None


_PART = re.compile(r"^rank_(0|[1-9][0-9]{0,8})$")  # a memory tier's part store: rank_<r>


def part_rank(name: str) -> int | None:
    """The rank whose part store the entry ``name`` of a memory directory is (``rank_3``: 3), or None."""
    match = _PART.match(name)
    return None if match is None else int(match.group(1))


def memory_directory(location: str) -> list[str] | None:
    """The names of the part stores (``rank_<r>``) of the local folder ``location`` when it is a
    memory tier's directory: it holds such entries and no committed step of its own (nor an
    integration's store). Decided by the names alone: nothing there is opened (a link or a FIFO
    named ``rank_0`` is refused when the part is opened, never followed)."""
    if is_url(location) or not location:
        return None
    try:
        names = os.listdir(location)
    except OSError:  # not a folder, not there, not readable: the command says so itself
        return None
    parts = sorted((n for n in names if part_rank(n) is not None), key=lambda n: part_rank(n) or 0)
    if not parts or any(parse_step_name(n) is not None for n in names) or nested_store(location):
        return None
    return parts


def locate(location: str) -> str:
    """The store a reading command reads: ``location``, or the integration's store inside it (see
    :func:`nested_store`), said on stderr, so ``crashsafe ls ckpt`` lists a Lightning folder's steps.
    A memory tier's directory is not one store: a command that reads one is pointed at a part."""
    parts = memory_directory(location)
    if parts is not None:
        raise fail(
            f"{location} is a memory tier's directory, not one store: `crashsafe ls` and `crashsafe "
            f"verify` read it whole; this command reads one part's store, e.g. "
            f"{os.path.join(location, parts[0])}"
        )
    found = nested_store(location)
    if found is None:
        return location
    note = f"note: {location} holds no committed step itself; reading {found[0]}, {found[1]}"
    err.print(Text(note), soft_wrap=not err.is_terminal)  # piped: one line
    return found[0]


def report_json(r: StepReport) -> dict[str, Any]:
    """One step's verification in JSON (docs/cli.md: ``step``)."""
    return {
        "step": r.step,
        "ok": r.ok,
        "problem": r.problem,
        "stored_bytes": r.stored_bytes,
        "raw_bytes": r.raw_bytes,
        "created": r.created,
        "bases": sorted(r.bases),
        "metrics": r.metrics,
        "saved_as": r.saved_as,
        "references": sorted(r.references),
        "referenced_bytes": r.referenced_bytes,
    }


def emit_json(document: dict[str, Any]) -> None:
    """Print ``document`` as the command's one JSON document on stdout (strict JSON: no NaN)."""
    typer.echo(json.dumps(document, indent=2, allow_nan=False))


def finish(as_json: bool, document: dict[str, Any], text: str) -> None:
    """A command's last word: ``document`` as its JSON with --json, else ``text`` for people."""
    if as_json:
        emit_json(document)
    else:
        console.print(Text(text))  # no markup: it quotes paths


def command_group(name: str, help: str) -> typer.Typer:
    """A typer app for one command or group, with the settings every crashsafe command uses."""
    return typer.Typer(
        name=name,
        help=help,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode="markdown",
    )


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` as an error on stderr; return the exit to raise (``raise fail(...)``)."""
    # a Text, not markup: a message quotes paths, names and hints ("crashsafe[torch]", "run[a]",
    # "a[/]b") that markup would drop or choke on (a MarkupError traceback)
    line = Text.assemble(("error:", "bold red"), f" {message}")
    err.print(line, soft_wrap=not err.is_terminal)  # piped: one line
    return typer.Exit(code)


def progress_bar(label: str, counter: str, *, on: Console = err, transient: bool = True) -> Progress:
    """A bar: bold ``label``, the bar, ``counter`` (a rich template of the task), time elapsed."""
    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        TextColumn(counter),
        TimeElapsedColumn(),
        console=on,
        transient=transient,
        disable=not on.is_terminal,  # no bar, nor the blank line it leaves, in a log or a pipe
    )


def leftover_line(name: str, where: str = "") -> Text:
    """A leftover as ``verify`` prints it: a torn save, or a deleted step's files (one a memory
    store keeps to write its next step over, docs/memory.md, looks the same)."""
    what = (
        "a deleted step's files, or one a memory store keeps to write its next step over; ignored"
        if name.startswith(TRASH_PREFIX)
        else "a torn save; ignored, cleaned by the next writer"
    )
    return Text.assemble(("leftover", "yellow"), f" {where}{name} ({what})")


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def referred(nbytes: int, steps: Iterable[int]) -> str:
    """The bytes a step refers to and the steps holding them: '409.6 MiB (step 10)', or '-'."""
    held = sorted(steps)
    if not held:
        return "-"
    return f"{human_bytes(nbytes)} ({'step' if len(held) == 1 else 'steps'} {', '.join(map(str, held))})"


def age(created: float | None) -> str:
    """Time since the Unix time ``created``, short: '42s', '3.5m', '2.0h', '1.5d' ('?' if unknown)."""
    if created is None:
        return "?"
    s = max(0.0, time.time() - created)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f}{unit}"
    return f"{s:.0f}s"
