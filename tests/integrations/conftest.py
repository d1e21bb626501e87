"""Real training runs for the integration tests, killed with SIGKILL at random moments.

Runs are forked from a forkserver that imported Lightning and transformers once, so a run costs its
training, not the ~10 s import; each is still its own process, killed for real.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from crashsafe.storage.layout import committed_steps

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(
    [
        "crashsafe.workloads.lightning_digits",
        "crashsafe.workloads.hf_tiny",
        "crashsafe.integrations.transformers",
    ]
)

Run = Callable[[Callable[[list[str]], int], list[str]], None]


def run_to_end(main: Callable[[list[str]], int], argv: list[str], timeout: float = 120) -> None:
    """Run ``main(argv)`` in a fresh process to the end; it must succeed."""
    process = _CTX.Process(target=main, args=(argv,))
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail(f"{main.__module__} {argv} did not finish in {timeout} s")
    assert process.exitcode == 0, f"{main.__module__} {argv} exited with {process.exitcode}"


def kill_after_commits(
    main: Callable[[list[str]], int], argv: list[str], store: Path, kills: int, rng: random.Random
) -> int:
    """Start ``main(argv)`` ``kills`` times and SIGKILL it a few ms after its 1st-4th new commit in
    ``store`` (so the kill lands in training, a staging copy or the next background commit, never
    after the run ended: a tiny run takes well under a second), then run it to the end; return how
    many runs were really killed."""

    def newest() -> int:
        steps = committed_steps(store)
        return steps[-1] if steps else -1

    killed = 0
    for _ in range(kills):
        seen = {newest()}
        wanted = len(seen) + rng.randint(1, 4)
        process = _CTX.Process(target=main, args=(argv,))
        process.start()
        deadline = time.monotonic() + 120
        while len(seen) < wanted and process.is_alive() and time.monotonic() < deadline:
            seen.add(newest())
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.03))
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
            killed += 1
        process.join()
    run_to_end(main, argv)
    return killed


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
