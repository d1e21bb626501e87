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
    locate,
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
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="the .safetensors file to write")
    ] = None,
    step: StepOpt = None,
    prefix: Annotated[
        str | None,
        typer.Option(
            help="only tensors whose path starts with this, named without it: --prefix model. gives the "
            "names of model.state_dict() (default: all tensors; 'model.' with --hf-dir)"
        ),
    ] = None,
    keep_prefix: Annotated[bool, typer.Option("--keep-prefix", help="keep the prefix in the names")] = False,
    hf_dir: Annotated[
        Path | None,
        typer.Option("--hf-dir", help="write a folder for from_pretrained: model.safetensors, config.json"),
    ] = None,
    storage_options: OptionsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Export a step's tensors to a safetensors file or a Hugging Face folder (verified on the way)."""
    from crashsafe.export import export_hf, export_safetensors

    if (output is None) == (hf_dir is None):
        raise fail("give one of --output FILE and --hf-dir FOLDER")
    if hf_dir is not None and keep_prefix:
        raise fail("--keep-prefix does not apply to --hf-dir: from_pretrained wants the model's own names")
    directory = locate(directory)
    options = _options(directory, storage_options)
    config = False
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

            if hf_dir is not None:
                found, count, nbytes, config = export_hf(
                    directory,
                    hf_dir,
                    step=step,
                    prefix="model." if prefix is None else prefix,
                    progress=tick,
                    storage_options=options,
                )
            else:
                found, count, nbytes = export_safetensors(
                    directory,
                    output or Path(),
                    step=step,
                    prefix=prefix or "",
                    keep_prefix=keep_prefix,
                    progress=tick,
                    storage_options=options,
                )
    except CrashsafeError as exc:
        raise fail(str(exc)) from None
    target = str(hf_dir if hf_dir is not None else output)
    extra = " and config.json" if config else ""
    finish(
        as_json,
        {"step": found, "tensors": count, "bytes": nbytes, "output": target, "config": config},
        f"wrote {count} tensors ({human_bytes(nbytes)}){extra} of step {found} to {target}",
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

    try:
        ok = run_demo(directory=directory, kills=kills, steps=steps, seed=seed, codec=codec, console=console)
    except CrashsafeError as exc:
        raise fail(str(exc)) from None
    if not ok:
        raise typer.Exit(1)


from crashsafe.cli.shelf import app as shelf_app  # noqa: E402 - registered after the core commands

app.add_typer(shelf_app, name="shelf")
from crashsafe.cli.ps import app as ps_app  # noqa: E402

app.add_typer(ps_app, name="ps")
from crashsafe.cli.simulate import simulate_cmd  # noqa: E402

app.command("simulate")(simulate_cmd)
