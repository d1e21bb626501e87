"""Fixtures for the shelf tests: shelf paths on /dev/shm and on disk, and child processes."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
SRC = HERE.parent.parent / "src"
SHM = Path("/dev/shm")


def child_env(**extra: str) -> dict[str, str]:
    """Environment of a child: our sources, unbuffered output, one BLAS thread (determinism)."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("CRASHSAFE_KILL_AT", None)
    env.update(extra)
    return env


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on /dev/shm (tmpfs), removed afterwards."""
    path = SHM / f"crashsafe-shelf-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


@pytest.fixture(params=["shm", "disk"])
def any_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A directory on tmpfs or on the disk (the tests' tmp_path)."""
    if request.param == "disk":
        yield tmp_path
        return
    path = SHM / f"crashsafe-shelf-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


@pytest.fixture
def run_script() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run tests/shelf/scripts/<script> with arguments and extra environment; wait for it."""

    def run(script: str, *args: Any, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(HERE / "scripts" / script), *map(str, args)],
            env=child_env(**env), capture_output=True, text=True, timeout=timeout,
        )

    return run
