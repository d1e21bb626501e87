"""Retention benchmark: what keep policies cost a save, by policy and by the number of committed steps.

Side by side in one run, the policies interleaved save by save: a manager that keeps every step
(no retention work but the listing) against ``KeepLast(n)`` (step numbers only), and
``KeepLast(n) | KeepBest(3, "val_loss")`` and ``KeepLast(n) | KeepEveryInterval("1h")`` (each step's
metrics or commit time, read from its manifest once and cached). Each keeps about n committed steps
(the union deletes one old step per save), so every save pays the retention of a run with n steps.
Reported: a sync save's time (what training waits for without ``async_save``), ``gc()`` with nothing
to delete (the retention decision alone, cache warm), and the first ``gc()`` of a manager reopened
over the n steps (every manifest read). States are tiny, so retention is a large share of a save.

    python -m bench retention [--quick] [--saves K]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import crashsafe as cs
from crashsafe.policies import KeepBest, KeepEveryInterval, KeepLast, KeepPolicy

HERE = Path(__file__).parent
RESULTS = HERE / "results"
BASELINE = "keep all"


def policies(n: int) -> dict[str, KeepPolicy | None]:
    """The compared retention settings for runs of ``n`` committed steps (None keeps every step)."""
    return {
        BASELINE: None,
        f"KeepLast({n})": KeepLast(n),
        f'KeepLast({n}) | KeepBest(3, "val_loss")': KeepLast(n) | KeepBest(3, "val_loss"),
        f'KeepLast({n}) | KeepEveryInterval("1h")': KeepLast(n) | KeepEveryInterval("1h"),
    }


def state(step: int) -> dict[str, Any]:
    return {"w": np.full(16, float(step), np.float32), "step": step}


def metrics(rng: random.Random) -> dict[str, float]:
    return {"loss": rng.random(), "val_loss": rng.random()}


def build(template: Path, n: int) -> None:
    """A run of ``n`` committed steps with a loss and a validation loss each."""
    rng = random.Random(0)
    with cs.CheckpointManager(template, keep_last=None, async_save=False) as mgr:
        for step in range(n):
            mgr.save(step, state(step), metrics(rng))


def timed(fn: Callable[[], object]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def measure(root: Path, n: int, saves: int) -> dict[str, dict[str, float]]:
    """Per policy: median sync save and warm gc, and the cold first gc, over ``n`` committed steps."""
    template = root / f"template-{n}"
    build(template, n)
    compared = policies(n)
    cold: dict[str, list[float]] = {name: [] for name in compared}
    for _ in range(3):  # the cold gc, three times each, interleaved
        for name, keep in compared.items():
            copy = root / "cold"
            shutil.copytree(template, copy)
            kwargs: dict[str, Any] = {"keep_last": None} if keep is None else {"keep": keep}
            with cs.CheckpointManager(copy, async_save=False, **kwargs) as mgr:
                cold[name].append(timed(mgr.gc))
            shutil.rmtree(copy)
    managers = {}
    for i, (name, keep) in enumerate(compared.items()):
        copy = root / f"run{i}"
        shutil.copytree(template, copy)
        kwargs = {"keep_last": None} if keep is None else {"keep": keep}
        managers[name] = cs.CheckpointManager(copy, async_save=False, **kwargs)
        managers[name].gc()  # warm the caches (the cold case is measured above)
    save_times: dict[str, list[float]] = {name: [] for name in compared}
    gc_times: dict[str, list[float]] = {name: [] for name in compared}
    rng = random.Random(1)
    for step in range(n, n + saves):
        values, saved = metrics(rng), state(step)
        for name, mgr in managers.items():
            save_times[name].append(timed(functools.partial(mgr.save, step, saved, values)))
            gc_times[name].append(timed(mgr.gc))
    kept = {name: len(mgr.steps()) for name, mgr in managers.items()}
    for mgr in managers.values():
        mgr.close()
    return {
        name: {
            "save": statistics.median(save_times[name]),
            "gc": statistics.median(gc_times[name]),
            "cold": statistics.median(cold[name]),
            "kept": kept[name],
        }
        for name in compared
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"


def report(results: dict[int, dict[str, dict[str, float]]], saves: int, argv: list[str], took: float,
           load: tuple[float, float]) -> str:  # fmt: skip
    args = "".join(" " + a for a in argv)
    lines = [
        "# Retention: what keep policies cost a save",
        "",
        f'Command: `make bench BENCH="retention{args}"` (`.venv/bin/python -m bench retention{args}`). '
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}; "
        f"checkpoints on tmpfs (/dev/shm); the run took {took:.0f} s; 1-minute load average "
        f"{load[0]:.2f} at the start, {load[1]:.2f} at the end (other jobs shared the machine; the "
        "policies were measured interleaved, save by save, so the load hits each alike).",
        "",
        "Compared: a manager that keeps every step (baseline: retention does nothing but list the "
        "steps) against `KeepLast(n)` (looks at step numbers only) and two unions that also need each "
        "step's metrics or commit time, read from its manifest once and then cached. Each keeps about "
        "n steps, deleting one old step per save, so every save pays the retention of a run with n "
        "committed steps. Columns: a sync save (`async_save=False`: what a save costs in all, "
        "retention included; the state is tiny, so retention is a large share of it); `gc()` with "
        "nothing to delete (the retention decision alone, caches warm); the first `gc()` of a manager "
        "reopened over the n steps (caches cold: each kept step's manifest read for its delta bases, "
        "and for the last two policies for its facts too, in the same read). "
        f"Medians of {saves} saves per policy; cold: median of 3 reopened managers.",
        "",
    ]
    for n, rows in results.items():
        base = rows[BASELINE]
        lines += [
            f"## {n} committed steps",
            "",
            "| retention | steps kept | sync save | vs keep all | gc, warm | gc, cold (reopened) |",
            "|---|---|---|---|---|---|",
        ]
        for name, row in rows.items():
            lines.append(
                f"| `{name.replace('|', chr(92) + '|')}` | {row['kept']:.0f} | {_ms(row['save'])} "
                f"| {row['save'] / base['save']:.2f}x | {_ms(row['gc'])} | {_ms(row['cold'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench retention")
    parser.add_argument("--quick", action="store_true", help="100 steps and 10 saves (smoke run)")
    parser.add_argument("--saves", type=int, default=None, help="timed saves per policy (default 40)")
    args = parser.parse_args(argv)
    sizes = [100] if args.quick else [100, 1000]
    saves = args.saves or (10 if args.quick else 40)
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    results = {}
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        for n in sizes:
            print(f"{n} committed steps...", flush=True)
            results[n] = measure(Path(tmp) / str(n), n, saves)
    text = report(results, saves, argv, time.perf_counter() - began, (load_before, os.getloadavg()[0]))
    print(text)
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "retention.md").write_text(text + "\n")
