"""Field test of the memory tier (issue 30): a 4-rank FSDP2 job on 2 pretended hosts (ranks 0, 1
on host a; 2, 3 on host b), saving to the memory tier every step and to the persistent tier every
5th save, run by a supervisor that acts as torchrun does. A few seconds after each restore (sooner
if the run has gone its share of the steps left, so that every kill asked fits in) it SIGKILLs a
random rank, tears the rest of the group down (SIGTERM, then SIGKILL after a grace, as
torchrun's agent stops its workers) and starts all 4 again; now and then it first wipes the killed
rank's host's memory directory, as if that host had been replaced. The run must end bit-identical
to one never stopped, each restart restored from the memory tier (a wiped host's ranks from their
peers' copies), and the persistent tier never read: every job gets JOB_PERSISTENT_FAULT=1 (see
tests/distributed/scripts/job.py), a fault injected in the job that makes every read of the
persistent tier during a restore fail loudly once it holds a step.

A host is wiped only while the other host holds a complete memory step (every part committed
there): without one, the only copies of a part may be gone and the persistent tier is rightly read.

    python -m bench memory_field [--kills 10] [--wipes 3] [--steps 600] [--life 2 6] [--seed 0]
                                 [--width 64] [--report PATH] [--json PATH] [--work DIR]

Results: bench/results/memory_field.md. tests/distributed/test_memory_field.py runs a short one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from crashsafe.storage.layout import committed_steps

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "distributed" / "scripts"
PATH = f"{ROOT / 'src'}:{SCRIPTS}:{ROOT}"  # as tests/distributed/conftest.py gives the job scripts
HOSTS = ["a", "a", "b", "b"]
PERSIST_EVERY = 5
GRACE = 5.0  # seconds between SIGTERM and SIGKILL when the group is torn down (torchrun: 30)


@dataclass
class Config:
    kills: int = 10
    wipes: int = 3
    steps: int = 600
    life: tuple[float, float] = (2.0, 6.0)  # seconds of training between a restore and the next kill
    seed: int = 0
    width: int = 64
    timeout: float = 30.0  # the job's coordination timeout
    start_timeout: float = 180.0  # seconds a launch may take to restore on a busy machine


@dataclass
class Restart:
    """One kill and the restart after it."""

    killed: int  # the rank SIGKILLed
    after: float  # seconds of training (since the restore) before the kill
    reached: int  # the newest step any rank had finished when it was killed
    complete_on_other: int | None  # the newest step the other host held complete in memory
    wiped: bool  # the killed rank's host's memory directory was wiped before the restart
    expected: int | None = None  # the newest step every part has a copy of in memory at the restart
    persistent: list[int] = field(default_factory=list)  # persistent steps at the restart
    resumed: list[int] = field(default_factory=list)  # per rank
    sources: list[str] = field(default_factory=list)  # per rank
    recovery: list[float] = field(default_factory=list)  # per rank: Recovery.seconds
    restart: float = 0.0  # seconds from the launch to every rank restored (imports, rendezvous, restore)


@dataclass
class Field:
    config: Config
    first: list[str] = field(default_factory=list)  # the first launch's sources
    restarts: list[Restart] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)  # FAULT lines: the persistent tier read
    problems: list[str] = field(default_factory=list)
    identical: bool = False
    seconds: float = 0.0
    straight_seconds: float = 0.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class LaunchFailed(Exception):
    """A launch's ranks did not all restore."""


class Launch:
    """One start of the job's 4 ranks (gloo on 127.0.0.1), as torchrun starts them; each rank's
    stdout is read line by line on a thread, its stderr goes to a log."""

    def __init__(self, cfg: Config, work: Path, name: str, out: Path, env: dict[str, str]) -> None:
        port = free_port()
        self.began = time.monotonic()
        self.lines: list[list[str]] = [[] for _ in HOSTS]
        self.logs = [work / f"{name}-rank{rank}.log" for rank in range(len(HOSTS))]
        self._changed = threading.Condition()
        self.procs: list[subprocess.Popen[str]] = []
        self._readers = []
        args = ["fsdp", work / "disk", cfg.steps, 1, out, cfg.timeout]
        for rank, log in enumerate(self.logs):
            environ = {
                **os.environ, "PYTHONPATH": PATH, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "RANK": str(rank), "WORLD_SIZE": str(len(HOSTS)), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "JOB_WIDTH": str(cfg.width), **env,
            }  # fmt: skip
            with open(log, "w") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, str(SCRIPTS / "job.py"), *map(str, args)], env=environ,
                    stdout=subprocess.PIPE, stderr=stderr, text=True,
                )  # fmt: skip
            self.procs.append(proc)
            reader = threading.Thread(target=self._read, args=(rank, proc), daemon=True)
            reader.start()
            self._readers.append(reader)

    def _read(self, rank: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._changed:
                self.lines[rank].append(line.strip())
                self._changed.notify_all()
        proc.wait()
        with self._changed:
            self._changed.notify_all()

    def said(self, rank: int, key: str) -> list[str]:
        """The values of rank's ``key VALUE`` lines so far."""
        with self._changed:
            return [line[len(key) + 1 :] for line in self.lines[rank] if line.startswith(key + " ")]

    def restored(self, timeout: float) -> float:
        """Wait until every rank has restored (printed its recovery); the seconds since the launch.
        Raises if a rank exits first or the launch takes longer than ``timeout``."""
        deadline = self.began + timeout
        with self._changed:
            while not all(self.said(r, "recovery") for r in range(len(HOSTS))):
                gone = [
                    r
                    for r, p in enumerate(self.procs)
                    if p.poll() is not None and not self.said(r, "recovery")
                ]
                if gone:
                    last = (self.tail(gone[0]).strip().splitlines() or ["(nothing)"])[-1]
                    raise LaunchFailed(f"rank {gone[0]} exited {self.procs[gone[0]].returncode} before it "
                                       f"restored: {last}")  # fmt: skip
                if time.monotonic() > deadline:
                    raise LaunchFailed(f"the ranks did not restore within {timeout:.0f} s")
                self._changed.wait(0.1)
        return time.monotonic() - self.began

    def run_for(self, seconds: float, last: int) -> bool:
        """Let the ranks train for ``seconds``, or until a rank finished step ``last``; whether they
        all exited by then."""
        deadline = time.monotonic() + seconds
        with self._changed:
            while (
                any(p.poll() is None for p in self.procs)
                and time.monotonic() < deadline
                and self.reached() < last
            ):
                self._changed.wait(min(0.05, max(deadline - time.monotonic(), 0.001)))
        return all(p.poll() is not None for p in self.procs)

    def reached(self) -> int:
        return max((int(s) for r in range(len(HOSTS)) for s in self.said(r, "step")), default=0)

    def kill(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGKILL)

    def tear_down(self) -> None:
        """As torchrun's agent stops its workers once one failed: SIGTERM to the others, SIGKILL
        to what still runs after a grace period."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
        self.wait(GRACE)

    def wait(self, timeout: float) -> list[int]:
        """Every rank's exit code (SIGKILL whatever still runs after ``timeout``)."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for reader in self._readers:
            reader.join()
        return [p.returncode for p in self.procs]

    def tail(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")[-2000:]

    def faults(self) -> list[str]:
        """The FAULT lines of the ranks' logs: the persistent tier read while restoring."""
        found = []
        for log in self.logs:
            lines = log.read_text(errors="replace").splitlines()
            found += [f"{log.name}: {line}" for line in lines if line.startswith("FAULT")]
        return found


def complete_step(*hosts: Path) -> int | None:
    """The newest step of which the memory directories of ``hosts`` hold every rank's part committed
    (a copy on any of them): the step a restore from the memory tier takes."""
    held = [
        set().union(*(committed_steps(host / f"rank_{owner}") for host in hosts))
        for owner in range(len(HOSTS))
    ]
    return max(set.intersection(*held), default=None)


def identical(left: Path, right: Path) -> list[str]:
    """The arrays of two of job.py's OUT files that differ (by name); none: bit-identical."""
    with np.load(left) as a, np.load(right) as b:
        names = sorted(set(a.files) | set(b.files))
        return [n for n in names if n not in a.files or n not in b.files or not np.array_equal(a[n], b[n])]


def straight(cfg: Config, work: Path) -> Path:
    """The run never stopped (same job, memory tier and all, no kill): its final state."""
    work.mkdir(parents=True, exist_ok=True)
    env = {
        "JOB_MEMORY": str(work / "mem"),
        "JOB_HOSTS": ",".join(HOSTS),
        "JOB_PERSIST_EVERY": str(PERSIST_EVERY),
    }
    launch = Launch(cfg, work, "straight", work / "out.npz", env)
    codes = launch.wait(cfg.start_timeout + cfg.steps * 2)
    if codes != [0] * len(HOSTS):
        bad = codes.index(next(c for c in codes if c != 0))
        raise RuntimeError(
            f"the uninterrupted run failed: exit codes {codes}; rank {bad}: {launch.tail(bad)}"
        )
    return work / "out.npz"


def run_field(cfg: Config, work: Path, memory: Path) -> tuple[Field, Path]:
    """Kill, wipe and restart until the run reaches its last step; what happened, and the final state."""
    rng = random.Random(cfg.seed)
    record = Field(cfg)
    env = {
        "JOB_MEMORY": str(memory), "JOB_HOSTS": ",".join(HOSTS), "JOB_PERSIST_EVERY": str(PERSIST_EVERY),
        "JOB_PERSISTENT_FAULT": "1",
    }  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    out, wipes, began = work / "out.npz", 0, time.monotonic()
    launches: list[Launch] = []
    for life in range(3 * (cfg.kills + cfg.wipes) + 1):  # (bounded: a wipe may have to wait)
        launch = Launch(cfg, work, f"life{life:02d}", out, env)
        launches.append(launch)
        try:
            took = launch.restored(cfg.start_timeout)
        except LaunchFailed as failed:
            launch.tear_down()
            record.problems.append(f"launch {life + 1}: {failed}")
            break
        sources = [launch.said(r, "source")[0] for r in range(len(HOSTS))]
        if record.restarts:
            last = record.restarts[-1]
            last.sources, last.restart = sources, took
            last.resumed = [int(launch.said(r, "resumed")[0]) for r in range(len(HOSTS))]
            last.recovery = [float(launch.said(r, "recovery")[0]) for r in range(len(HOSTS))]
        else:
            record.first = sources
        if len(record.restarts) >= cfg.kills and wipes >= cfg.wipes:
            codes = launch.wait(cfg.start_timeout + cfg.steps * 2)
            if codes != [0] * len(HOSTS):
                record.problems.append(f"the last launch ended with exit codes {codes}")
            break
        kills_left, wipes_left = cfg.kills - len(record.restarts), cfg.wipes - wipes
        resumed = int(launch.said(0, "resumed")[0])  # (the kills spread over the steps left: none is lost)
        stop_at = resumed + max((cfg.steps - resumed) // (max(kills_left, wipes_left) + 1), 1)
        began_life = time.monotonic()
        finished = launch.run_for(rng.uniform(*cfg.life), stop_at)
        if not finished and launch.reached() >= stop_at:  # (the kill lands anywhere in the next step)
            finished = launch.run_for(rng.uniform(0, 0.25), cfg.steps)
        if finished:
            record.problems.append(f"the run reached its last step after {len(record.restarts)} kills: "
                                   "give it more steps (--steps)")  # fmt: skip
            break
        victim, reached, after = rng.randrange(len(HOSTS)), launch.reached(), time.monotonic() - began_life
        launch.kill(victim)
        launch.tear_down()
        host = HOSTS[victim]
        other = complete_step(memory / next(h for h in HOSTS if h != host))
        wanted = wipes_left > 0 and (wipes_left >= kills_left or rng.random() < cfg.wipes / cfg.kills)
        wipe = wanted and other is not None
        if wipe:
            shutil.rmtree(memory / host)
            wipes += 1
        expected = complete_step(*(memory / h for h in sorted(set(HOSTS))))
        persistent = committed_steps(work / "disk")
        record.restarts.append(Restart(victim, round(after, 2), reached, other, wipe, expected, persistent))
        print(f"kill {len(record.restarts)}: rank {victim} at step {reached}"
              f"{', host ' + host + ' wiped' if wipe else ''}", flush=True)  # fmt: skip
    record.seconds = time.monotonic() - began
    record.faults = [line for launch in launches for line in launch.faults()]
    return record, out


def judge(record: Field) -> None:
    """Add to ``record.problems`` whatever the field test forbids."""
    cfg = record.config
    if len(record.restarts) < cfg.kills or sum(r.wiped for r in record.restarts) < cfg.wipes:
        record.problems.append(f"{len(record.restarts)} kills and {sum(r.wiped for r in record.restarts)} "
                               f"wipes, fewer than the {cfg.kills} and {cfg.wipes} asked")  # fmt: skip
    record.problems += [f"the persistent tier was read: {line}" for line in record.faults]
    for n, restart in enumerate(record.restarts, 1):
        if not restart.sources:
            continue  # (its launch failed: a problem already)
        if len(set(restart.resumed)) != 1:
            record.problems.append(f"restart {n}: the ranks resumed different steps {restart.resumed}")
        if restart.expected is not None and restart.resumed != [restart.expected] * len(HOSTS):
            record.problems.append(f"restart {n}: the memory tier held step {restart.expected} complete, and "
                                   f"the ranks resumed {restart.resumed} ({restart.sources})")  # fmt: skip
        if restart.expected is not None and not all(
            s == "memory" or s.startswith("peer ") for s in restart.sources
        ):
            record.problems.append(f"restart {n} did not restore from the memory tier: {restart.sources}")
        wiped = [s for h, s in zip(HOSTS, restart.sources, strict=True) if h == HOSTS[restart.killed]]
        if restart.wiped and not all(s.startswith("peer ") for s in wiped):
            record.problems.append(f"restart {n}: the wiped host's ranks did not pull from peers: {wiped}")
    if not record.identical:
        record.problems.append("the final state differs from the uninterrupted run's")


def markdown(record: Field, command: str, mismatched: list[str]) -> str:
    cfg = record.config
    wipes = sum(r.wiped for r in record.restarts)
    lost = [r.reached - r.resumed[0] for r in record.restarts if r.resumed]
    final = "**bit-identical**" if record.identical else "**differs** in " + ", ".join(mismatched)
    lines = [
        "# Memory tier field test: 4-rank FSDP2, random SIGKILLs, wiped hosts",
        "",
        f"Produced by `{command}` on {time.strftime('%Y-%m-%d')}: {os.cpu_count()} cores "
        f"({platform.machine()}), Linux {platform.release()}, Python {platform.python_version()}; "
        f"{record.seconds / 60:.1f} min for the run with kills, {record.straight_seconds / 60:.1f} min "
        "for the run never stopped. The job is tests/distributed/scripts/job.py: FSDP2 over gloo, 4 "
        f"ranks on 2 pretended hosts (ranks 0, 1: host a; 2, 3: host b), an MLP of width {cfg.width} "
        f"with AdamW, {cfg.steps} steps, a memory-tier save every step (2 copies of each part, on both "
        f"hosts), a persistent one every {PERSIST_EVERY}th save of a launch. The supervisor "
        f"(bench/memory_field.py, seed {cfg.seed}) acts as torchrun: {cfg.life[0]:g} to {cfg.life[1]:g} s "
        "after each restore (sooner once the run has gone its share of the steps left, so that every "
        "kill fits in) it SIGKILLs a random rank, SIGTERMs the other 3 (SIGKILL after a grace) and "
        "starts all 4 again; before some restarts it wipes the killed rank's host's memory directory "
        "(only while the other host holds a complete memory step). Every launch runs with the "
        "persistent tier failing every read during the restore once it holds a step "
        "(JOB_PERSISTENT_FAULT=1, a fault injected in the job), so a restore that read it would fail "
        "and say so.",
        "",
        "## Verdict",
        "",
        f"- Kills: {len(record.restarts)} (asked {cfg.kills}); wiped hosts: {wipes} (asked {cfg.wipes}).",
        f"- Final model and optimizer state against the run never stopped: {final}.",
        f"- Reads of the persistent tier during a restore: {len(record.faults)}; restores from it: "
        f"{sum('persistent' in r.sources for r in record.restarts)}.",
        f"- Steps lost per restart: {', '.join(map(str, lost))} (mean {np.mean(lost) if lost else 0:.1f}).",
        f"- Problems: {'; '.join(record.problems) if record.problems else 'none'}.",
        "",
        "## Restarts",
        "",
        "Step: the newest step any rank had finished at the kill. Other host: the newest step of which "
        "the other host held every part at the kill. In memory: the newest step of which the memory "
        "tier held every part at the restart (after the wipe), the step the restore must take. "
        "Persistent: the persistent tier's steps. Resumed: the step every rank restored; sources per "
        "rank 0..3 (`memory`: its own copy, `peer r`: pulled from rank r). Restore: the slowest rank's "
        "`Recovery.seconds`; restart: from the launch to every rank restored (imports, rendezvous, "
        "restore, on 2 shared cores).",
        "",
        "| # | killed | after | step | other host | wiped | in memory | persistent | resumed | sources "
        "| lost | restore | restart |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, r in enumerate(record.restarts, 1):
        resumed = r.resumed[0] if len(set(r.resumed)) == 1 else "/".join(map(str, r.resumed))
        cells = [
            n, f"rank {r.killed} (host {HOSTS[r.killed]})", f"{r.after:.1f} s", r.reached,
            r.complete_on_other, "**yes**" if r.wiped else "no", r.expected,
            ", ".join(map(str, r.persistent)) or "-", resumed, ", ".join(r.sources),
            r.reached - r.resumed[0] if r.resumed else "-", f"{max(r.recovery, default=0):.2f} s",
            f"{r.restart:.1f} s",
        ]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", f"The first launch's sources: {', '.join(record.first)} (nothing to restore).", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench memory_field")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--wipes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--life", type=float, nargs=2, default=(2.0, 6.0), metavar=("LO", "HI"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--report", type=Path, default=ROOT / "bench" / "results" / "memory_field.md")
    parser.add_argument("--json", type=Path, help="also write the record as JSON")
    parser.add_argument("--work", type=Path, help="work directory (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    cfg = Config(args.kills, args.wipes, args.steps, tuple(args.life), args.seed, args.width)
    work = Path(tempfile.mkdtemp(prefix="memory-field-", dir=args.work))
    memory = work / "mem"  # (with --work: kept, with the ranks' logs, for a look afterwards)
    if not args.work and Path("/dev/shm").is_dir():  # a RAM disk, as a memory tier would have
        memory = Path(tempfile.mkdtemp(prefix="memory-field-", dir="/dev/shm"))
    try:
        began = time.monotonic()
        reference = straight(cfg, work / "straight")
        straight_seconds = time.monotonic() - began
        record, out = run_field(cfg, work / "field", memory)
        record.straight_seconds = straight_seconds
        mismatched = identical(reference, out) if out.exists() else ["(no final state)"]
        record.identical = not mismatched
        judge(record)
        command = "python -m bench memory_field " + " ".join(argv)
        args.report.write_text(markdown(record, command.strip(), mismatched))
        if args.json:
            args.json.write_text(json.dumps(asdict(record), indent=1))
    finally:
        if not args.work:
            shutil.rmtree(memory, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
    verdict = "bit-identical" if record.identical else "DIFFERS"
    wipes = sum(r.wiped for r in record.restarts)
    print(f"{len(record.restarts)} kills, {wipes} wipes; {verdict}; report: {args.report}", flush=True)
    if record.problems:
        raise SystemExit("field test failed: " + "; ".join(record.problems))
