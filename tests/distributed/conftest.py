"""Launch the ranks of a real torch.distributed job (gloo on 127.0.0.1) as separate processes
(forked from processes that imported torch once: tests/forks.py)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..forks import Forked, Zygotes

SCRIPTS = Path(__file__).parent / "scripts"
SRC = Path(__file__).resolve().parents[2] / "src"
PATH = f"{SRC}:{SCRIPTS}:{SRC.parent}"  # the job scripts count reads with bench/readcount.py
if os.environ.get("PYTHONPATH"):  # (after ours: a dependency installed aside, as tests/gpu/run.sh's)
    PATH += f":{os.environ['PYTHONPATH']}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Ranks:
    """The processes of one launch of a job: one per rank."""

    def __init__(
        self,
        script: str,
        world: int,
        args: list[Any],
        tmp: Path,
        env_of: dict[int, dict[str, str]],
        zygotes: Zygotes,
    ) -> None:
        port = free_port()
        self.procs = []
        for rank in range(world):
            env = {
                **os.environ, "PYTHONPATH": PATH, "PYTHONUNBUFFERED": "1", "RANK": str(rank),
                "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **env_of.get(rank, {}),
            }  # fmt: skip
            log = open(tmp / f"rank{rank}-{port}.log", "w")  # noqa: SIM115 - closed in wait()
            proc = Forked(zygotes, rank, [str(SCRIPTS / script), *map(str, args)], env, log.fileno())
            self.procs.append((proc, log))

    def wait(self, timeout: float = 120) -> list[int]:
        """Every rank's exit code; the stderr tail of each rank that failed is printed, so that a
        failing test shows why (pytest shows a failed test's captured output)."""
        codes = []
        for rank, (proc, log) in enumerate(self.procs):
            try:
                codes.append(proc.wait(timeout))
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if proc.stdout:
                    proc.stdout.close()
                log.close()
            if proc.returncode != 0:
                tail = Path(log.name).read_text(errors="replace")[-3000:]
                print(f"--- rank {rank} exited {proc.returncode}; the end of its stderr:\n{tail}")
        return codes

    def kill(self, ranks: list[int] | None = None) -> None:
        for rank, (proc, _) in enumerate(self.procs):
            if ranks is None or rank in ranks:
                proc.kill()


@pytest.fixture
def launch(tmp_path: Path, zygotes: Zygotes) -> Iterator[Any]:
    """``launch(script, world, *args, env_of={rank: env})`` starts the ranks (one process each, with
    extra environment for some); every launch is killed at teardown."""
    started: list[Ranks] = []

    def start(script: str, world: int, *args: Any, env_of: dict[int, dict[str, str]] | None = None) -> Ranks:
        ranks = Ranks(script, world, list(args), tmp_path, env_of or {}, zygotes)
        started.append(ranks)
        return ranks

    yield start
    for ranks in started:
        ranks.kill()
        ranks.wait(10)
