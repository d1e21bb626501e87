"""``crashsafe`` commands: ls, show, verify, diff, export, gc, demo, simulate (and the subsystems'
groups). Each command lives in its own module; this one registers them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn

from crashsafe.cli._common import (
    Dir,
    JsonOpt,
    OptionsOpt,
    StepOpt,
    command_group,
    console,
    err,
    fail,
    finish,
    human_bytes,
)
from crashsafe.cli._common import parse_options as _options
from crashsafe.cli.diff import diff_cmd
from crashsafe.cli.show import show_cmd
from crashsafe.cli.steps import gc_cmd, ls_cmd, verify_cmd
from crashsafe.errors import CrashsafeError

app = command_group("crashsafe", "Crash-consistent, verified checkpoints for ML training.")
app.command("ls")(ls_cmd)
app.command("show")(show_cmd)
app.command("verify")(verify_cmd)
app.command("diff")(diff_cmd)
app.command("gc")(gc_cmd)


@app.command("export")
def export_cmd(
    directory: Dir,
    output: Annotated[Path, typer.Option("--output", "-o", help="the .safetensors file to write")],
    step: StepOpt = None,
    prefix: Annotated[str, typer.Option(help="only tensors whose path starts with this")] = "",
    storage_options: OptionsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Export a step's tensors to a safetensors file (verified on the way)."""
    from crashsafe.export import export_safetensors

    try:
        with Progress(
            TextColumn("[bold]exporting"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} tensors"),
            console=err,
            transient=True,
        ) as progress:
            task = progress.add_task("export", total=None)

            def tick(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            found, count, nbytes = export_safetensors(
                directory,
                output,
                step=step,
                prefix=prefix,
                progress=tick,
                storage_options=_options(directory, storage_options),
            )
    except CrashsafeError as exc:
        raise fail(str(exc)) from None
    finish(
        as_json,
        {"step": found, "tensors": count, "bytes": nbytes, "output": str(output)},
        f"wrote {count} tensors ({human_bytes(nbytes)}) of step {found} to {output}",
    )


@app.command("demo")
def demo_cmd(
    directory: Annotated[
        Path | None, typer.Option(help="work directory, kept (default: a temporary one, removed at the end)")
    ] = None,
    kills: Annotated[int, typer.Option(help="how many times to SIGKILL the trainer")] = 3,
    steps: Annotated[int, typer.Option(help="training steps")] = 600,
    seed: Annotated[int, typer.Option(help="seed of the kill times")] = 0,
    codec: Annotated[str, typer.Option(help="codec for model tensors: raw, zstd, incremental, lc")] = "raw",
) -> None:
    """Train a CNN on digits, SIGKILL it at random moments, resume, and compare bit for bit."""
    from crashsafe.cli.demo import run_demo

    ok = run_demo(directory=directory, kills=kills, steps=steps, seed=seed, codec=codec, console=console)
    if not ok:
        raise typer.Exit(1)


from crashsafe.cli.shelf import app as shelf_app  # noqa: E402 - registered after the core commands

app.add_typer(shelf_app, name="shelf")
from crashsafe.cli.ps import app as ps_app  # noqa: E402

app.add_typer(ps_app, name="ps")
from crashsafe.cli.simulate import simulate_cmd  # noqa: E402

app.command("simulate")(simulate_cmd)
