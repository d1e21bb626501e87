"""``crashsafe demo``: train the digits CNN, SIGKILL it at random moments, resume, compare bit for bit.

A supervisor runs the trainer (``python -m crashsafe.workloads.digits``) as a child process,
follows its JSON-line event log, and SIGKILLs it when it reaches randomly chosen steps (after a
random extra delay, so kills land anywhere: mid-step, mid-snapshot, mid-persist, mid-commit). Each
restart resumes from the newest intact checkpoint. An uninterrupted reference run trains alongside;
at the end the final model and optimizer states of both are compared bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["DemoResult", "compare_final", "run_demo", "run_supervised"]


@dataclass
class DemoResult:
    """What the supervised run did, read from the trainer's event log."""

    kills: list[int] = field(default_factory=list)  # step reached when each kill happened
    restarts: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    wall: float = 0.0

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    @property
    def lost_steps(self) -> int:
        """Steps computed but not committed before a kill, so trained again after the restart."""
        lost = 0
        starts = self.of("start")
        for start in starts[1:]:
            resumed = start["resumed_from"] or 0
            before = [e["step"] for e in self.events if e["event"] == "step" and e["t"] < start["t"]]
            lost += max(before) - resumed if before else 0
        return lost


def _trainer_cmd(directory: Path, log: Path, steps: int, every: int, codec: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "crashsafe.workloads.digits",
        "--dir",
        str(directory),
        "--steps",
        str(steps),
        "--every",
        str(every),
        "--codec",
        codec,
        "--log",
        str(log),
    ]


def _read_events(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    events = []
    for line in log.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by the kill
    return events


def run_supervised(
    work: Path,
    *,
    steps: int,
    every: int,
    kills: int,
    seed: int,
    codec: str = "raw",
    progress: Any = None,
    task: Any = None,
    timeout: float = 600.0,
) -> DemoResult:
    """Run the trainer under a supervisor that SIGKILLs it ``kills`` times at random moments."""
    rng = random.Random(seed)
    targets = sorted(rng.sample(range(every, steps - 1), kills))
    log = work / "events.jsonl"
    result = DemoResult()
    began = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    while True:
        proc = subprocess.Popen(
            _trainer_cmd(work / "ckpt", log, steps, every, codec),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        target = targets[len(result.kills)] if len(result.kills) < len(targets) else None
        delay = rng.uniform(0.0, 0.05)
        while proc.poll() is None:
            if time.perf_counter() - began > timeout:
                proc.kill()
                raise RuntimeError("the demo trainer did not finish in time")
            events = _read_events(log)
            reached = max((e["step"] for e in events if e["event"] == "step"), default=0)
            if progress is not None:
                progress.update(task, completed=reached)
            if (
                target is not None
                and reached >= target
                and any(e["event"] == "start" and e["pid"] == proc.pid for e in events)
            ):
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                result.kills.append(reached)
                break
            time.sleep(0.005)
        else:
            if proc.returncode != 0:
                stderr = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"the demo trainer failed (exit {proc.returncode}):\n{stderr}")
            break
        if proc.stderr:
            proc.stderr.close()
        result.restarts += 1
    if proc.stderr:
        proc.stderr.close()
    result.events = _read_events(log)
    result.wall = time.perf_counter() - began
    return result


def compare_final(a: Path, b: Path) -> tuple[bool, float, int]:
    """Compare the newest checkpoints of two runs: (bit-identical, max abs diff, tensors compared)."""
    from crashsafe.manager import CheckpointManager

    sa = CheckpointManager(a, read_only=True).load(numpy=True)
    sb = CheckpointManager(b, read_only=True).load(numpy=True)
    from crashsafe.state.tree import flatten

    _, la = flatten({"model": sa["model"], "optim": sa["optim"], "step": sa["step"]})
    _, lb = flatten({"model": sb["model"], "optim": sb["optim"], "step": sb["step"]})
    same = len(la) == len(lb) and sa["step"] == sb["step"]
    worst = 0.0
    for x, y in zip(la, lb, strict=False):
        xa, ya = np.asarray(x.source), np.asarray(y.source)
        same = same and xa.shape == ya.shape and xa.tobytes() == ya.tobytes()
        if xa.shape == ya.shape and xa.dtype.kind == "f":
            worst = max(worst, float(np.max(np.abs(xa - ya), initial=0.0)))
    return same, worst, len(la)


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
    """The main job: supervised run with kills vs uninterrupted run, then a summary table."""
    from crashsafe.codecs.registry import get_codec

    lossy = get_codec(codec).lossy
    tmp = None
    if directory is None:
        tmp = tempfile.TemporaryDirectory(prefix="crashsafe-demo-")
        directory = Path(tmp.name)
    killed_dir, ref_dir = directory / "killed", directory / "reference"
    for d in (killed_dir, ref_dir):
        d.mkdir(parents=True, exist_ok=True)
        for stale in d.glob("events.jsonl"):
            stale.unlink()
    console.print(
        f"[bold]crashsafe demo[/]: digits CNN (scikit-learn's bundled 8x8 digits), {steps} "
        f"steps, checkpoint every {every}, codec {codec}; {kills} random SIGKILLs. "
        f"Work dir: {directory}"
    )
    reference = subprocess.Popen(
        _trainer_cmd(ref_dir / "ckpt", ref_dir / "events.jsonl", steps, every, codec),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    with Progress(
        TextColumn("[bold]training (killed run)"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("train", total=steps)
        result = run_supervised(
            killed_dir,
            steps=steps,
            every=every,
            kills=kills,
            seed=seed,
            codec=codec,
            progress=progress,
            task=task,
        )
        progress.update(task, completed=steps)
    _, ref_err = reference.communicate()
    if reference.returncode != 0:
        console.print(f"[red]the reference run failed:[/]\n{ref_err.decode()}")
        return False
    same, worst, count = compare_final(killed_dir / "ckpt", ref_dir / "ckpt")
    _summary(console, result, steps)
    done = result.of("done")[-1] if result.of("done") else {}
    console.print(f"held-out accuracy after {steps} steps: {done.get('accuracy', float('nan')):.3f}")
    if same:
        console.print(
            f"[bold green]final model and optimizer state are bit-identical to the "
            f"uninterrupted run[/] ({count} tensors compared)"
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
    if tmp is not None:
        tmp.cleanup()
    return same or lossy


def _summary(console: Console, result: DemoResult, steps: int) -> None:
    committed = result.of("committed")
    starts = result.of("start")
    recoveries = [s["recovery_s"] for s in starts[1:]]
    restores = [s["restore_s"] for s in starts[1:]]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    table = Table(title="crashsafe demo: training through SIGKILLs")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("training steps", f"{steps}"),
        ("SIGKILLs (at steps)", f"{len(result.kills)} ({', '.join(map(str, result.kills))})"),
        ("checkpoints committed", f"{len(committed)}"),
        ("mean training stall per save", f"{mean([c['stall'] for c in committed]) * 1e3:.2f} ms"),
        ("mean persist time (background)", f"{mean([c['persist'] for c in committed]) * 1e3:.2f} ms"),
        ("bytes per checkpoint", f"{mean([c['stored_bytes'] for c in committed]) / 1024:.1f} KiB"),
        ("compression ratio", f"{mean([c['raw_bytes'] / c['stored_bytes'] for c in committed]):.2f}x"),
        ("mean restore time (read + verify + load)", f"{mean(restores) * 1e3:.1f} ms"),
        ("mean recovery time (process start to restored)", f"{mean(recoveries):.2f} s"),
        ("lost steps (trained again after kills)", f"{result.lost_steps}"),
        ("wall time", f"{result.wall:.1f} s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
