"""Steps lost per failure: the training job (bench/memory_tier/job.py) on its ranks, one of them
SIGKILLed at a random instant, the others killed at once (as a launcher's agent stops the group),
then the job restarted; the last step every rank completed before the kill against the step the
restart restores. Trials are chained: each restart trains on until the next kill."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.distributed import ROOT, _die_with_launcher, _store_socket, rank_env

STEP_TIMEOUT = 120.0  # seconds without a new step (or a restart's restore): the trial failed


class Ranks:
    """A running job: one process per rank, each one's lines read on a thread as they come."""

    def __init__(self, world: int, config: Path, log: Path) -> None:
        self.lines: list[list[str]] = [[] for _ in range(world)]
        self.last_change = time.monotonic()
        self.procs: list[subprocess.Popen[str]] = []
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self._threads = []
        with _store_socket() as listener:
            for rank in range(world):
                env, fds = rank_env(rank, world, listener, ROOT / "src")
                proc = subprocess.Popen(
                    [sys.executable, "-m", "bench.memory_tier.job", str(config)], env=env, cwd=ROOT,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, pass_fds=fds,
                    preexec_fn=_die_with_launcher,
                )  # fmt: skip
                self.procs.append(proc)
                thread = threading.Thread(target=self._read, args=(rank, proc), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _read(self, rank: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._log.write(f"rank {rank}: {line}")
            self.lines[rank].append(line.strip())
            self.last_change = time.monotonic()

    def last(self, prefix: str) -> list[str | None]:
        """Each rank's last line starting with ``prefix`` (None: none yet)."""
        return [next((x for x in reversed(lines) if x.startswith(prefix)), None) for lines in self.lines]

    def steps(self) -> list[int]:
        return [int(x.split()[1]) if x else 0 for x in self.last("step ")]

    def resumed(self) -> tuple[int, list[str], float]:
        """Once every rank restored: the step, each rank's source, the slowest rank's seconds."""
        self.wait_for(lambda: all(self.last("resumed ")), "restoring")
        parts = [str(x).split() for x in self.last("resumed ")]
        return int(parts[0][1]), [p[2].replace("_", " ") for p in parts], max(float(p[3]) for p in parts)

    def reach(self, step: int) -> None:
        """Wait until every rank printed ``step N`` for some N >= ``step``."""
        self.wait_for(lambda: min(self.steps()) >= step, f"training to step {step}")

    def exited(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def wait_for(self, ready: Any, what: str) -> None:
        while not ready():
            if any(p.poll() not in (None, 0) for p in self.procs):
                raise RuntimeError(f"a rank failed while {what}:\n{self.tail()}")
            if time.monotonic() - self.last_change > STEP_TIMEOUT:
                raise RuntimeError(f"no progress for {STEP_TIMEOUT:.0f} s while {what}:\n{self.tail()}")
            time.sleep(0.01)

    def stop(self) -> list[int]:
        """Kill every rank still running; wait for all and read their last lines; exit codes."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        codes = [p.wait() for p in self.procs]
        for thread in self._threads:
            thread.join(10)
        self._log.close()
        return codes

    def tail(self) -> str:
        return "\n".join(f"rank {r}: {x}" for r, lines in enumerate(self.lines) for x in lines[-5:])


def trials(
    cfg: dict[str, Any],
    world: int,
    count: int,
    span: tuple[int, int],
    rng: random.Random,
    work: Path,
    name: str,
) -> list[dict[str, Any]]:
    """``count`` kills of the job ``cfg``, of a random rank at a random instant of the step after
    the ``span``-th (drawn at random, both ends in) after the step the job resumed from; the
    instant is drawn over the length of the step before it."""
    out: list[dict[str, Any]] = []
    for trial in range(count + 1):
        final = trial == count
        config = work / f"{name}-{trial}.cfg.json"
        config.write_text(json.dumps({**cfg, "stop": 0 if final else 1 << 30}))
        ranks = Ranks(world, config, work / f"{name}-{trial}.log")
        try:
            resumed, sources, seconds = ranks.resumed()
            if out:
                out[-1].update(restored=resumed, sources=sources, restore_seconds=seconds)
                out[-1]["lost"] = out[-1]["completed"] - resumed
                done = out[-1]["completed"]
                print(
                    f"   {name}: killed after step {done}, restored {resumed}: {done - resumed} lost",
                    flush=True,
                )
            if final:
                ranks.wait_for(ranks.exited, "leaving")
                break
            at = resumed + rng.randint(*span)
            ranks.reach(at - 1)
            started = time.monotonic()
            ranks.reach(at)
            step_time = time.monotonic() - started  # step at's length; then a random instant in the next
            time.sleep(rng.uniform(0.0, step_time))
            victim = rng.randrange(world)
            ranks.procs[victim].send_signal(signal.SIGKILL)
            seen = ranks.steps()
        finally:
            codes = ranks.stop()
        last = ranks.steps()  # every line the ranks printed before they died
        kill = {"victim": victim, "seen_at_kill": seen, "last_steps": last, "completed": min(last)}
        out.append({**kill, "step_time": step_time})
    if codes != [0] * world:
        raise RuntimeError(f"{name}: the last restart failed, exit codes {codes}:\n{ranks.tail()}")
    return out
