"""Crash recovery of the workloads, really tested: SIGKILL a running KMeans/GMM at random moments,
restart it, let it resume from its shelf, and compare the final state bit for bit with an
uninterrupted run. The same harness shows that plain ``np.savez`` checkpoints are torn by a kill
during their write, while ``savez-safe`` survives the same kill."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from crashsafe.workloads.checkpoint_modes import SavezStore, UnreadableCheckpointError

Start = Callable[..., "subprocess.Popen[str]"]
KILLS_PER_RUN = 6
WORKLOADS = {  # ~1.5 s of work each: six kills within 0.15 s of a (re)start all land mid-run
    "kmeans": ["--algo", "kmeans", "--k", "16", "--data", "blobs:400:1024:16", "--max-iter", "1500"],
    "gmm": ["--algo", "gmm", "--k", "4", "--data", "blobs:1000:32:4", "--max-iter", "900"],
}


def finish(start: Start, args: list[str]) -> str:
    proc = start(*args)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out


def kill_and_resume(start: Start, args: list[str], seed: int) -> tuple[int, int]:
    """SIGKILL the workload KILLS_PER_RUN times at random moments of its run, then let it finish.

    Returns (real kills, restarts that rolled back a transaction the kill interrupted)."""
    rng = random.Random(seed)
    killed = rolled_back = 0
    for _ in range(KILLS_PER_RUN):
        proc = start(*args)
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()  # the shelf holds a state (recovered if need be): iterations begin
        assert line.startswith("ready"), proc.stderr.read()
        rolled_back += "recovered=True" in line
        time.sleep(rng.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed += proc.returncode == -signal.SIGKILL
        proc.stdout.close()
        proc.stderr.close()
    out = finish(start, args)
    rolled_back += "recovered=True" in out
    assert "resumed_from=" in out and "resumed_from=None" not in out
    return killed, rolled_back


def same_state(a: Path, b: Path) -> None:
    with np.load(a) as left, np.load(b) as right:
        assert sorted(left.files) == sorted(right.files)
        for name in left.files:
            assert left[name].dtype == right[name].dtype, name
            assert left[name].tobytes() == right[name].tobytes(), name


@pytest.mark.timeout(600)
def test_random_sigkills_resume_bit_identically(shm_dir: Path, tmp_path: Path, workload: Start) -> None:
    """30 kills over five runs: KMeans and GMM, undo and shadow transactions, tmpfs and disk."""
    runs = [("kmeans", "undo", shm_dir), ("kmeans", "shadow", shm_dir), ("kmeans", "shadow", tmp_path),
            ("gmm", "undo", shm_dir), ("gmm", "shadow", shm_dir)]

    def reference(algo: str) -> Path:
        out = shm_dir / f"{algo}-reference.npz"
        finish(workload, [*WORKLOADS[algo], "--dir", shm_dir / f"{algo}-reference", "--out", out])
        return out

    def trial(index: int) -> tuple[int, int]:
        algo, tx_mode, where = runs[index]
        directory = where / f"run{index}"
        out = where / f"run{index}.npz"
        args = [*WORKLOADS[algo], "--tx-mode", tx_mode, "--dir", directory, "--out", out]
        result = kill_and_resume(workload, args, seed=index)
        same_state(out, references[algo])
        return result

    with ThreadPoolExecutor(2) as pool:
        references = dict(zip(WORKLOADS, pool.map(reference, WORKLOADS), strict=True))
        results = list(pool.map(trial, range(len(runs))))
    killed = sum(k for k, _ in results)
    print(f"{killed} SIGKILLs; {sum(r for _, r in results)} of them interrupted a transaction")
    assert killed >= 30


def watch_and_kill_mid_write(proc: subprocess.Popen[str], path: Path, deadline: float) -> bool:
    """Kill ``proc`` the moment ``path`` is seen shorter than before: a rewrite is in progress."""
    largest = 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            continue
        if size < largest:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        largest = size
    return False


BIG_STATE = ["--algo", "kmeans", "--k", "32", "--data", "blobs:64:32768:32", "--max-iter", "100000"]


@pytest.mark.timeout(300)
def test_plain_savez_is_torn_by_a_kill_during_its_write(tmp_path: Path, workload: Start) -> None:
    """The harness kills the workload while it rewrites its 8 MiB ``np.savez`` checkpoint in place:
    the file is left unreadable and the run cannot resume. ``savez-safe`` writes a temporary file
    and renames it: the same kill leaves the previous checkpoint intact and the run resumes."""
    for attempt in range(5):
        directory = tmp_path / f"savez{attempt}"
        proc = workload(*BIG_STATE, "--mode", "savez", "--dir", directory)
        assert watch_and_kill_mid_write(proc, directory / "state.npz", time.monotonic() + 60)
        try:
            SavezStore(directory).load()
        except UnreadableCheckpointError:
            break  # torn
        # the write had just completed when the kill landed: try again
    else:
        pytest.fail("five kills during np.savez writes left no torn file")
    resumed = workload(*BIG_STATE, "--mode", "savez", "--dir", directory, "--max-iter", "1")
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode != 0 and "UnreadableCheckpointError" in err

    safe_dir = tmp_path / "safe"
    proc = workload(*BIG_STATE, "--mode", "savez-safe", "--dir", safe_dir)
    assert watch_and_kill_mid_write(proc, safe_dir / "state.npz.tmp", time.monotonic() + 60)
    state = SavezStore(safe_dir).load()
    assert state is not None  # the previous checkpoint, intact
    resumed = workload(*BIG_STATE, "--mode", "savez-safe", "--dir", safe_dir,
                       "--max-iter", str(int(state["iteration"]) + 1))
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0 and f"resumed_from={int(state['iteration'])}" in out, err
