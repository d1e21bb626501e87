"""``crashsafe`` commands: ls, show, verify, export, gc, demo (and the subsystems' groups)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from crashsafe.cli._common import age, command_group, console, err, fail, human_bytes, progress_bar
from crashsafe.errors import CrashsafeError
from crashsafe.storage.stores import is_url, open_store
from crashsafe.verification import StepReport, VerifyReport, verify

app = command_group("crashsafe", "Crash-consistent, verified checkpoints for ML training.")

Dir = Annotated[str, typer.Argument(help="checkpoint directory, or an fsspec URL such as s3://bucket/run")]
StepOpt = Annotated[int | None, typer.Option("--step", "-s", help="step (default: newest intact)")]
OptionsOpt = Annotated[
    str | None,
    typer.Option(
        "--storage-options",
        help='JSON for fsspec, for URLs (e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\'); '
        "credentials also come from the usual environment variables",
    ),
]
MirrorOpt = Annotated[str | None, typer.Option("--mirror", help="the second tier (URL) to list beside DIR")]


def _options(location: str, text: str | None) -> dict[str, Any] | None:
    if text is None or not is_url(location):
        return None
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise fail(f"--storage-options is not valid JSON: {exc}") from None
    if not isinstance(options, dict):
        raise fail("--storage-options must be a JSON object")
    return options


def _steps(location: str, options: dict[str, Any] | None) -> list[int]:
    try:
        store = open_store(location, storage_options=options)
        try:
            return store.steps()
        finally:
            store.close()
    except CrashsafeError as exc:
        raise fail(str(exc)) from None


def _verify_with_progress(location: str, options: dict[str, Any] | None) -> VerifyReport:
    steps = _steps(location, options)
    with progress_bar(f"verifying {location}", "{task.completed}/{task.total} steps") as progress:
        task = progress.add_task("verify", total=len(steps))
        return verify(
            location, progress=lambda _: progress.advance(task), steps=steps, storage_options=options
        )


@app.command("ls")
def ls_cmd(directory: Dir, mirror: MirrorOpt = None, storage_options: OptionsOpt = None) -> None:
    """List committed steps with size, age and integrity status (of both tiers, with --mirror)."""
    tiers = {"local": directory} if mirror is None else {"local": directory, "mirror": mirror}
    reports: dict[int, dict[str, StepReport]] = {}
    for tier, location in tiers.items():
        for r in _verify_with_progress(location, _options(location, storage_options)).steps:
            reports.setdefault(r.step, {})[tier] = r
    if not reports:
        console.print(f"no committed checkpoints in {' or '.join(tiers.values())}")
        return
    table = Table(title=" + ".join(tiers.values()))
    columns = ("step", "tier") if mirror is not None else ("step",)
    for col in (*columns, "stored", "raw", "ratio", "age", "status"):
        table.add_column(col, justify="left" if col in ("tier", "status") else "right")
    for step in sorted(reports):
        by_tier = reports[step]
        r = next((r for r in by_tier.values() if r.ok), next(iter(by_tier.values())))
        ratio = f"{r.raw_bytes / r.stored_bytes:.2f}x" if r.ok and r.stored_bytes else "-"
        status = "; ".join(
            ("[green]ok[/]" if t.ok else f"[red]damaged[/]: {t.problem}") + (f" ({tier})" if mirror else "")
            for tier, t in by_tier.items()
        )
        cells = [str(step), "+".join(by_tier)] if mirror is not None else [str(step)]
        raw = human_bytes(r.raw_bytes) if r.ok else "-"
        table.add_row(*cells, human_bytes(r.stored_bytes), raw, ratio, age(r.created), status)
    console.print(table)


@app.command("show")
def show_cmd(directory: Dir, step: StepOpt = None, storage_options: OptionsOpt = None) -> None:
    """Show the tensors of a step: path, dtype, shape, codec (and delta base), bytes, ratio."""
    from crashsafe.manager import CheckpointManager

    try:
        mgr = CheckpointManager(
            directory, read_only=True, storage_options=_options(directory, storage_options)
        )
        manifest = mgr.manifest(step)
    except CrashsafeError as exc:
        raise fail(str(exc)) from None
    table = Table(title=f"{directory} step {manifest.step}")
    for col in ("path", "kind", "dtype", "shape", "codec", "delta of", "raw", "stored", "ratio"):
        table.add_column(col, justify="right" if col in ("delta of", "raw", "stored", "ratio") else "left")
    for p in manifest.payloads:
        ratio = f"{p.raw_nbytes / p.nbytes:.2f}x" if p.nbytes else "-"
        codec = ",".join(f"{k}={v}" for k, v in p.codec.items() if k != "id")
        table.add_row(
            p.path,
            p.kind,
            p.dtype,
            "x".join(map(str, p.shape)) or "()",
            p.codec["id"] + (f"({codec})" if codec else ""),
            "-" if p.base is None else f"step {p.base}",
            human_bytes(p.raw_nbytes),
            human_bytes(p.nbytes),
            ratio,
        )
    console.print(table)
    metrics = ", ".join(f"{k}={v}" for k, v in manifest.metrics.items())
    console.print(
        f"{len(manifest.payloads)} tensors, {human_bytes(manifest.raw_nbytes)} raw, "
        f"{human_bytes(manifest.stored_nbytes)} stored" + (f"; metrics: {metrics}" if metrics else "")
    )


@app.command("verify")
def verify_cmd(directory: Dir, storage_options: OptionsOpt = None) -> None:
    """Check every committed step as a load reads it (checksums, decoding, delta chains); exit 1 if
    any step is damaged."""
    report = _verify_with_progress(directory, _options(directory, storage_options))
    reports = report.steps
    for r in reports:
        if r.ok:
            console.print(f"[green]ok[/]      step {r.step}  {human_bytes(r.stored_bytes)}")
        else:
            console.print(f"[red]DAMAGED[/] step {r.step}: {r.problem}")
    for name in report.leftovers:
        console.print(f"[yellow]leftover[/] {name} (a torn save; ignored, cleaned by the next writer)")
    bad = [r for r in reports if not r.ok]
    if bad:
        intact = [r.step for r in reports if r.ok]
        hint = f"newest intact step: {intact[-1]}" if intact else "no intact step"
        err.print(
            f"[bold red]{len(bad)} of {len(reports)} steps damaged[/]; {hint}. Restore falls "
            "back to the newest intact step; delete damaged ones with `crashsafe gc`."
        )
        raise typer.Exit(1)
    console.print(f"[bold green]all {len(reports)} steps intact[/]")


@app.command("export")
def export_cmd(
    directory: Dir,
    output: Annotated[Path, typer.Option("--output", "-o", help="the .safetensors file to write")],
    step: StepOpt = None,
    prefix: Annotated[str, typer.Option(help="only tensors whose path starts with this")] = "",
    storage_options: OptionsOpt = None,
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
    console.print(f"wrote {count} tensors ({human_bytes(nbytes)}) of step {found} to {output}")


@app.command("gc")
def gc_cmd(
    directory: Dir,
    keep_last: Annotated[int, typer.Option("--keep-last", min=1, help="steps to keep")] = 3,
    keep_every: Annotated[int | None, typer.Option(help="also keep multiples of this")] = None,
    delete_damaged: Annotated[bool, typer.Option(help="also delete damaged steps")] = False,
    storage_options: OptionsOpt = None,
) -> None:
    """Delete old steps (and torn leftovers) crash-safely, keeping the newest N."""
    from crashsafe.manager import CheckpointManager

    options = _options(directory, storage_options)
    if not is_url(directory) and not Path(directory).is_dir():
        raise fail(f"{directory} is not a directory")
    try:  # opening as the writer removes torn leftovers; gc keeps every delta base a kept step needs
        store = open_store(directory, storage_options=options)
        torn = store.leftovers()
        store.close()
        with CheckpointManager(
            directory, keep_last=keep_last, keep_every=keep_every, async_save=False, storage_options=options
        ) as mgr:
            deleted = mgr.gc(delete_damaged=delete_damaged)
            kept = mgr.steps()
    except CrashsafeError as exc:
        raise fail(str(exc)) from None
    console.print(f"deleted {len(deleted)} steps and {len(torn)} leftovers; kept {kept}")


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
