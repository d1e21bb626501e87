"""``crashsafe demo``: train the digits CNN, SIGKILL it at random moments, resume, compare bit for bit.

The kill-and-resume supervisor (:mod:`crashsafe.workloads.supervisor`) runs the trainer
(``python -m crashsafe.workloads.digits``) as a child process and SIGKILLs it when training reaches
randomly chosen steps (after a random extra delay, so kills land anywhere: mid-step, mid-snapshot,
mid-persist, mid-commit). Each restart resumes from the newest intact checkpoint. An uninterrupted
reference run trains alongside; at the end the final model and optimizer states of both are
compared bit for bit.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.text import Text

from crashsafe.cli._common import progress_bar
from crashsafe.cli._tables import Column, print_table
from crashsafe.errors import CrashsafeError
from crashsafe.workloads.supervisor import AtSteps, KillRun, spawn, supervise

__all__ = ["check_demo", "compare_final", "run_demo", "run_supervised"]

_RUNS = ("killed", "reference")  # the demo's two runs, each in its own subdirectory of the work dir


def _trainer_cmd(work: Path, steps: int, every: int, codec: str) -> list[str]:
    """The trainer of one run: checkpoints in ``work/ckpt``, events in ``work/events.jsonl``."""
    return [
        sys.executable,
        "-m",
        "crashsafe.workloads.digits",
        "--dir",
        str(work / "ckpt"),
        "--steps",
        str(steps),
        "--every",
        str(every),
        "--codec",
        codec,
        "--log",
        str(work / "events.jsonl"),
    ]


def run_supervised(
    work: Path,
    *,
    steps: int,
    every: int,
    kills: int,
    seed: int,
    codec: str = "raw",
    on_step: Callable[[int], None] | None = None,
    timeout: float = 600.0,
) -> KillRun:
    """Run the trainer in ``work`` under a supervisor that SIGKILLs it ``kills`` times at random moments.

    It writes ``work/ckpt`` (checkpoints), ``work/events.jsonl`` (its events) and ``work/trainer.log``
    (its stderr). The kill steps and delays are drawn from ``seed``.
    """
    rng = random.Random(seed)
    targets = sorted(rng.sample(range(every, steps - 1), kills))
    plan = AtSteps(targets, [rng.uniform(0.0, 0.05) for _ in targets])
    return supervise(
        _trainer_cmd(work, steps, every, codec),
        work / "events.jsonl",
        plan,
        stderr=work / "trainer.log",
        name="the demo trainer",
        timeout=timeout,
        on_step=on_step,
    )


# What training depends on. Python's and numpy's global RNGs are saved too, but the trainer never
# seeds them (it draws batches from its own seeded generator): two runs start them differently.
_COMPARED = ("model.", "optim.", "sched.", "rng.torch", "step")


def compare_final(a: Path, b: Path) -> tuple[bool, float, int]:
    """Compare the newest checkpoints of two runs as ``crashsafe diff`` does, on the paths training
    depends on: (bit-identical, max abs diff, paths compared)."""
    from crashsafe.diff import diff_steps

    result = diff_steps(a, None, b, None, prefixes=_COMPARED)
    return result.identical, result.max_abs, len(result.paths)


def check_demo(*, directory: Path | None, kills: int, steps: int, codec: str, every: int = 10) -> bool:
    """Refuse options the demo cannot run with, before it starts anything (CrashsafeError, CodecError
    for an unknown codec): at least 1 step, kills at distinct steps from ``every`` to ``steps - 2``,
    a work directory that is (or can be) a directory. Returns whether ``codec`` is lossy."""
    from crashsafe.codecs.registry import get_codec

    if steps < 1:
        raise CrashsafeError(f"--steps {steps}: the demo trains at least 1 step; try --steps 600")
    if kills < 0:
        raise CrashsafeError(f"--kills {kills}: the number of SIGKILLs is 0 or more; try --kills 3")
    if kills > steps - 1 - every:  # kills land at distinct steps in range(every, steps - 1)
        raise CrashsafeError(
            f"--kills {kills} needs --steps {kills + every + 1} or more (the kills land at distinct steps "
            f"from {every} to --steps minus 2); raise --steps or lower --kills"
        )
    lossy = get_codec(codec).lossy
    if directory is not None:
        for path in (directory, *(directory / name for name in _RUNS)):
            if path.exists() and not path.is_dir():
                raise CrashsafeError(
                    f"--directory: {path} exists and is not a directory; pass a new or empty folder, or "
                    "leave --directory out for a temporary one"
                )
    return lossy


def run_demo(
    *,
    directory: Path | None,
    kills: int,
    steps: int,
    seed: int,
    codec: str,
    console: Console,
    every: int = 10,
) -> bool:
    """The main job: supervised run with kills vs uninterrupted run, then a summary table.

    Returns whether the final states agree (bit for bit, or within a lossy codec's error). Files go
    to ``directory``, or to a temporary directory removed at the end unless something went wrong.
    """
    lossy = check_demo(directory=directory, kills=kills, steps=steps, codec=codec, every=every)
    temporary = directory is None
    work = Path(tempfile.mkdtemp(prefix="crashsafe-demo-")) if directory is None else directory
    killed_dir, ref_dir = (work / name for name in _RUNS)
    if any((work / name / "ckpt").exists() for name in _RUNS):
        console.print(
            f"[bold red]error:[/] {work} holds checkpoints of an earlier demo; the trainers would resume "
            "from them. Pass a new --directory, or delete its killed/ and reference/ directories."
        )
        return False
    _make_runs(killed_dir, ref_dir)
    plural = "" if kills == 1 else "s"
    console.print(
        f"[bold]crashsafe demo[/]: digits CNN (scikit-learn's bundled 8x8 digits), {steps} steps, "
        f"checkpoint every {every}, codec {codec}; {kills} random SIGKILL{plural}."
    )
    kept = " (temporary: removed at the end unless a check fails; keep it with --directory)"
    console.print(f"work dir: {work}" + (kept if temporary else ""))
    console.print(f"  {killed_dir.name}/      the run that is SIGKILLed and resumed")
    console.print(f"  {ref_dir.name}/   the uninterrupted run")
    console.print("  each holds ckpt/ (checkpoints), events.jsonl (events), trainer.log (stderr)")
    ok = _train_and_compare(
        work, steps=steps, every=every, kills=kills, seed=seed, codec=codec, lossy=lossy, console=console
    )
    if temporary and ok:
        shutil.rmtree(work, ignore_errors=True)
        console.print(f"removed the work dir {work}")
    elif not ok:
        console.print(f"files kept in {work}")
    return ok


def _make_runs(*runs: Path) -> None:
    """Create each run's directory, without the events and log of an earlier demo; a directory that
    cannot be made (no permission, a file on the way) is a CrashsafeError naming it."""
    for d in runs:
        try:
            d.mkdir(parents=True, exist_ok=True)
            for stale in ("events.jsonl", "trainer.log"):
                (d / stale).unlink(missing_ok=True)
        except OSError as exc:
            raise CrashsafeError(
                f"cannot prepare the demo's work directory {d}: {exc.strerror or exc}; pass --directory "
                "a folder you can write, or leave it out for a temporary one"
            ) from None


def _train_and_compare(
    work: Path, *, steps: int, every: int, kills: int, seed: int, codec: str, lossy: bool, console: Console
) -> bool:
    """Both runs side by side, then the summary and the verdict; False if a run failed or they differ."""
    killed_dir, ref_dir = (work / name for name in _RUNS)
    reference = spawn(_trainer_cmd(ref_dir, steps, every, codec), ref_dir / "trainer.log")
    try:
        with progress_bar(
            "training (killed run)", "step {task.completed}/{task.total}", on=console, transient=False
        ) as progress:
            task = progress.add_task("train", total=steps)
            result = run_supervised(
                killed_dir,
                steps=steps,
                every=every,
                kills=kills,
                seed=seed,
                codec=codec,
                on_step=lambda step: progress.update(task, completed=step),
            )
            progress.update(task, completed=steps)
        if reference.wait() != 0:
            console.print(
                f"[bold red]the reference run failed (exit {reference.returncode})[/]: see "
                f"{ref_dir / 'trainer.log'}"
            )
            return False
    except (RuntimeError, TimeoutError) as exc:
        console.print(Text(str(exc), style="bold red"))
        return False
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
    same, worst, count = compare_final(killed_dir / "ckpt", ref_dir / "ckpt")
    _summary(console, result, steps)
    done = result.of("done")[-1] if result.of("done") else {}
    console.print(f"held-out accuracy after {steps} steps: {done.get('accuracy', float('nan')):.3f}")
    if same:
        console.print(
            f"[bold green]final model, optimizer, scheduler, torch RNG and step are bit-identical to "
            f"the uninterrupted run[/] ({count} paths compared, as `crashsafe diff` does)"
        )
    elif lossy:
        console.print(
            f"[yellow]lossy codec {codec}: final state differs from the uninterrupted run "
            f"by at most {worst:.3g} (expected with a lossy codec)[/]"
        )
    else:
        console.print(
            f"[bold red]MISMATCH: the resumed run differs from the uninterrupted run "
            f"(max abs diff {worst:.3g})[/]"
        )
    return same or lossy


def _summary(console: Console, result: KillRun, steps: int) -> None:
    committed = result.of("committed")
    starts = result.of("start")
    recoveries = [s["recovery_s"] for s in starts[1:]]
    restores = [s["restore_s"] for s in starts[1:]]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    rows = [
        ("training steps", f"{steps}"),
        ("SIGKILLs (at steps)", f"{len(result.kills)} ({', '.join(str(k.step) for k in result.kills)})"),
        ("checkpoints committed", f"{len(committed)}"),
        ("mean training stall per save", f"{mean([c['stall'] for c in committed]) * 1e3:.2f} ms"),
        ("mean persist time (background)", f"{mean([c['persist'] for c in committed]) * 1e3:.2f} ms"),
        ("bytes per checkpoint", f"{mean([c['stored_bytes'] for c in committed]) / 1024:.1f} KiB"),
        ("compression ratio", f"{mean([c['raw_bytes'] / c['stored_bytes'] for c in committed]):.2f}x"),
        ("mean restore time (read + verify + load)", f"{mean(restores) * 1e3:.1f} ms"),
        ("mean recovery time (process start to restored)", f"{mean(recoveries):.2f} s"),
        (
            "  of which start-up: interpreter, imports, model",
            f"{mean([r - s for r, s in zip(recoveries, restores, strict=True)]):.2f} s",
        ),
        ("lost steps (trained again after kills)", f"{result.lost_steps}"),
        ("wall time", f"{result.wall:.1f} s"),
    ]
    columns = [Column("measure", folds=True), Column("value", right=True)]
    print_table("crashsafe demo: training through SIGKILLs", columns, rows, on=console)
