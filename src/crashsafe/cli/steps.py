"""``crashsafe ls``, ``verify`` and ``gc``: the committed steps of a checkpoint, checked as a load
reads them, listed with the metrics they were saved with, and collected."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from crashsafe.cli._common import (
    Dir,
    JsonOpt,
    OptionsOpt,
    age,
    console,
    emit_json,
    err,
    fail,
    finish,
    human_bytes,
    leftover_line,
    locate,
    memory_directory,
    nested_store,
    parse_options,
    progress_bar,
    referred,
    report_json,
)
from crashsafe.cli._tables import Cell, Column, print_table
from crashsafe.cli.keep import (
    KeepBestOpt,
    KeepEveryOpt,
    KeepIntervalOpt,
    KeepLastOpt,
    KeepMetricOpt,
    KeepMissingOpt,
    KeepModeOpt,
    keep_policy,
)
from crashsafe.cli.memory import ls_memory, verify_memory
from crashsafe.errors import CrashsafeError
from crashsafe.storage.stores import is_url, open_store
from crashsafe.verification import StepReport, VerifyReport, verify

__all__ = ["gc_cmd", "ls_cmd", "verify_cmd"]

MirrorOpt = Annotated[str | None, typer.Option("--mirror", help="the second tier (URL) to list beside DIR")]
MetricOpt = Annotated[
    str | None, typer.Option("--metric", help="mark the step with the best value of this metric")
]
ModeOpt = Annotated[
    str, typer.Option("--mode", help="min: the lowest value is best (a loss); max: the highest")
]


def _verify_with_progress(location: str, options: dict[str, Any] | None) -> VerifyReport:
    try:
        store = open_store(location, storage_options=options, existing=True)
        try:
            steps = store.steps()
        finally:
            store.close()
        with progress_bar(f"verifying {location}", "{task.completed}/{task.total} steps") as progress:
            task = progress.add_task("verify", total=len(steps))
            return verify(
                location, progress=lambda _: progress.advance(task), steps=steps, storage_options=options
            )
    except CrashsafeError as exc:
        raise fail(str(exc)) from None


def _number(value: object) -> float | None:
    """A metric as a finite number, or None (missing, not a number, NaN or infinite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _best(reports: list[StepReport], metric: str, mode: str) -> int | None:
    """The intact step with the best finite ``metric`` (ties: the newest), or None."""
    scored = [(v, r.step) for r in reports if r.ok and (v := _number(r.metrics.get(metric))) is not None]
    if not scored:
        return None
    sign = 1.0 if mode == "min" else -1.0
    return min(scored, key=lambda vs: (sign * vs[0], -vs[1]))[1]


def _metric_columns(reports: list[StepReport], metric: str | None) -> list[str]:
    """The metric keys any intact step records (in the order first seen), plus ``metric``: a step
    that did not record one shows "-" (a Hugging Face step saved where nothing was logged)."""
    keys = list(dict.fromkeys(k for r in reports if r.ok for k in r.metrics))
    return [*keys, metric] if metric is not None and metric not in keys else keys


def _metric_text(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))  # a step or an epoch counted in a float: 2000, not 2e+03
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def ls_cmd(
    directory: Dir,
    mirror: MirrorOpt = None,
    metric: MetricOpt = None,
    mode: ModeOpt = "min",
    storage_options: OptionsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List committed steps with the metrics they were saved with, size, age and integrity status
    (of both tiers, with --mirror); --metric loss marks the best intact step."""
    if mode not in ("min", "max"):
        raise fail(f"--mode {mode!r}: use min (the lowest value is best) or max")
    parts = memory_directory(directory)
    if parts is not None:
        if mirror is not None or metric is not None:
            raise fail(f"{directory} is a memory tier's directory: --mirror and --metric apply to a store")
        return ls_memory(directory, parts, as_json)
    directory = locate(directory)
    tiers = {"local": directory} if mirror is None else {"local": directory, "mirror": mirror}
    by_step: dict[int, dict[str, StepReport]] = {}
    for tier, location in tiers.items():
        for r in _verify_with_progress(location, parse_options(location, storage_options)).steps:
            by_step.setdefault(r.step, {})[tier] = r
    # each step as read from its first intact tier
    chosen = [
        next((r for r in t.values() if r.ok), next(iter(t.values()))) for _, t in sorted(by_step.items())
    ]
    best = None if metric is None else _best(chosen, metric, mode)
    if metric is not None and best is None and chosen:
        seen = sorted({k for r in chosen for k in r.metrics})
        raise fail(
            f"no intact step records the metric {metric!r} as a finite number; the steps record: "
            + (", ".join(seen) or "no metrics (pass metrics= to save)")
        )
    if as_json:
        emit_json(
            {
                "location": directory,
                "mirror": mirror,
                "metric": None if metric is None else {"name": metric, "mode": mode, "best_step": best},
                "steps": [
                    report_json(r)
                    | {"tiers": {t: {"ok": x.ok, "problem": x.problem} for t, x in by_step[r.step].items()}}
                    for r in chosen
                ],
            }
        )
        return
    if not chosen:
        console.print(Text(f"no committed checkpoints in {' or '.join(tiers.values())}"))
        return
    metrics = _metric_columns(chosen, metric)
    named = any(r.saved_as is not None for r in chosen)  # Lightning's: the file each step was saved as
    columns = [Column("step", right=True)]
    columns += [Column("tier")] if mirror is not None else []
    columns += [Column("saved as", drop=3)] if named else []
    columns += [  # a metric named "step" (older Hugging Face stores recorded HF's) is not the step
        Column(f"metric {k}" if k == "step" else k, right=True, drop=2 if k == metric else 5) for k in metrics
    ]
    refers = any(r.references for r in chosen)  # steps that refer to earlier steps' bytes (format 4)
    columns += [Column("stored", right=True, drop=7)]
    columns += [Column("refers to", right=True, drop=4)] if refers else []
    columns += [
        Column("raw", right=True, drop=9),
        Column("ratio", right=True, drop=8),
        Column("age", right=True, drop=6),
        Column("status", folds=True, min_width=32),
    ]
    rows: list[list[Cell]] = []
    for r in chosen:
        on = by_step[r.step]
        cells: list[Cell] = [str(r.step), "+".join(on)] if mirror is not None else [str(r.step)]
        cells += [r.saved_as or "-"] if named else []
        for k in metrics:
            text = _metric_text(r.metrics.get(k))
            cells.append(
                Text(text + " (best)", style="bold green") if k == metric and r.step == best else text
            )
        held = r.stored_bytes + r.referenced_bytes  # what a load reads
        cells += [human_bytes(r.stored_bytes)]
        cells += [referred(r.referenced_bytes, r.references)] if refers else []
        cells += [
            human_bytes(r.raw_bytes) if r.ok else "-",
            f"{r.raw_bytes / held:.2f}x" if r.ok and held else "-",
            age(r.created),
            _status(on, mirror is not None),
        ]
        rows.append(cells)
    print_table(" + ".join(tiers.values()), columns, rows)
    for r in chosen:
        if metric is not None and r.step == best:
            console.print(Text(f"best {metric} ({mode}): step {best} ({_metric_text(r.metrics[metric])})"))


def _status(on: dict[str, StepReport], name_tiers: bool) -> Text:
    text = Text()
    for tier, t in on.items():
        if text:
            text.append("; ")
        text.append("ok" if t.ok else "damaged", style="green" if t.ok else "red")
        text.append(f": {t.problem}" if not t.ok else "")
        text.append(f" ({tier})" if name_tiers else "")
    return text


def verify_cmd(directory: Dir, storage_options: OptionsOpt = None, as_json: JsonOpt = False) -> None:
    """Check every committed step as a load reads it (checksums, decoding, delta chains); exit 1 if
    any step is damaged (in a memory tier's directory: every part store's steps)."""
    parts = memory_directory(directory)
    if parts is not None:
        return verify_memory(directory, parts, as_json)
    directory = locate(directory)
    report = _verify_with_progress(directory, parse_options(directory, storage_options))
    reports = report.steps
    bad = [r for r in reports if not r.ok]
    if as_json:
        emit_json(
            {
                "location": directory,
                "ok": report.ok,
                "steps": [report_json(r) for r in reports],
                "leftovers": report.leftovers,
            }
        )
    else:
        for r in reports:
            if r.ok:
                refers = f", refers to {referred(r.referenced_bytes, r.references)}" if r.references else ""
                console.print(f"[green]ok[/]      step {r.step}  {human_bytes(r.stored_bytes)}{refers}")
            else:
                console.print(Text.assemble(("DAMAGED", "red"), f" step {r.step}: {r.problem}"))
        for name in report.leftovers:
            console.print(leftover_line(name))
    if bad:
        intact = [r.step for r in reports if r.ok]
        if intact:
            hint = (
                f"newest intact step: {intact[-1]}. Restore falls back to the newest intact step; delete "
                "damaged ones with `crashsafe gc --delete-damaged`."
            )
        else:
            hint = (
                "no step is intact, so restore has none to fall back to (it raises). Look for another "
                "copy of the run (a mirror, a backup) before deleting anything."
            )
        err.print(f"[bold red]{len(bad)} of {len(reports)} steps damaged[/]; {hint}")
        raise typer.Exit(1)
    if not as_json:
        if reports:
            console.print(f"[bold green]all {len(reports)} steps intact[/]")
        else:
            console.print(Text(f"no committed checkpoints in {directory}: nothing to verify"))


ForceOpt = Annotated[
    bool,
    typer.Option("--force", help="delete even when one step or none would be left (nothing to fall back to)"),
]


def gc_cmd(
    directory: Dir,
    keep_last: KeepLastOpt = None,
    keep_every: KeepEveryOpt = None,
    keep_interval: KeepIntervalOpt = None,
    keep_best: KeepBestOpt = None,
    metric: KeepMetricOpt = None,
    mode: KeepModeOpt = "min",
    missing: KeepMissingOpt = "keep",
    delete_damaged: Annotated[bool, typer.Option(help="also delete damaged steps")] = False,
    force: ForceOpt = False,
    storage_options: OptionsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Delete old steps (and torn leftovers) crash-safely, keeping the newest N, or what the --keep-*
    options name (their union), the newest step and every delta base a kept step needs. Deleting
    down to a single step (nothing left to fall back to) needs --force."""
    from crashsafe.chain import doomed_steps, protected_steps
    from crashsafe.manager import CheckpointManager
    from crashsafe.verification import verify

    keep = keep_policy(keep_last, keep_every, keep_interval, keep_best, metric, mode, missing)
    options = parse_options(directory, storage_options)
    if not is_url(directory) and not Path(directory).is_dir():
        raise fail(f"{directory} is not a directory")
    try:
        with contextlib.closing(open_store(directory, storage_options=options, existing=True)) as store:
            torn, steps = store.leftovers(), store.steps()
        if not steps and not torn:
            _nothing_to_collect(directory, as_json)
            return
        # opening as the writer removes torn leftovers; gc keeps every delta base a kept step needs
        with (
            CheckpointManager(directory, keep=keep, async_save=False, storage_options=options) as mgr,
            contextlib.closing(open_store(directory, storage_options=options, existing=True)) as store,
        ):
            damaged: set[int] = set()
            if delete_damaged:  # every step that does not verify and no intact step needs
                report = verify(directory, storage_options=options)
                damaged = {r.step for r in report.damaged} - protected_steps(store, report.intact)
            left = [s for s in store.steps() if s not in damaged]
            doomed = doomed_steps(store, keep, steps=left)
            if (damaged or doomed) and len(left) - len(doomed) < 2 and not force:
                raise _single_step(sorted(damaged | set(doomed)), sorted(set(left) - set(doomed)))
            if damaged:
                mgr.delete(sorted(damaged))
            deleted = sorted(damaged | set(mgr.gc()))
            kept = mgr.steps()
    except CrashsafeError as exc:
        raise fail(str(exc)) from None
    finish(
        as_json,
        {"location": directory, "deleted": deleted, "leftovers": torn, "kept": kept},
        f"deleted {len(deleted)} steps and {len(torn)} leftovers; kept {kept}",
    )


def _nothing_to_collect(directory: str, as_json: bool) -> None:
    """gc of a folder with no step and no leftover: no writer is opened there (it would leave a
    ``.lock`` in a folder that is not a store); an integration's store inside it is named."""
    found = nested_store(directory)
    if found is not None:
        raise fail(
            f"{directory} holds no committed step itself; {found[0]} is {found[1]}. Its framework "
            f"decides what that store keeps; to collect it anyway: crashsafe gc {found[0]}"
        )
    finish(
        as_json,
        {"location": directory, "deleted": [], "leftovers": [], "kept": []},
        f"nothing to collect in {directory}: no committed step, no leftover",
    )


def _single_step(deleting: list[int], staying: list[int]) -> typer.Exit:
    """The refusal of a gc that would leave one step or none without --force."""
    left = f"only step {staying[0]}" if staying else "no step at all"
    return fail(
        f"this would delete steps {deleting} and leave {left}: nothing to fall back to if "
        f"{'it' if staying else 'a step'} is damaged. Add --force to delete them anyway, or keep more "
        "steps (e.g. --keep-last 2); nothing was deleted"
    )
