"""Fixtures for the shelf tests: shelf paths on /dev/shm and on disk, and child processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from crashsafe.shelf import Shelf

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


@pytest.fixture(autouse=True, scope="session")
def _one_blas_thread() -> Iterator[None]:
    """Small matrices on a busy 2-core machine: threaded BLAS only spins; one thread is faster."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        yield


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on /dev/shm (tmpfs), removed afterwards."""
    path = SHM / f"crashsafe-shelf-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    shutil.rmtree(path)


@pytest.fixture(params=["shm", "disk"])
def any_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A directory on tmpfs or on the disk (the tests' tmp_path)."""
    if request.param == "disk":
        yield tmp_path
        return
    path = SHM / f"crashsafe-shelf-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    shutil.rmtree(path)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.fixture
def flip() -> Callable[[Path, int], None]:
    """``flip(path, offset)``: really flip a bit of the byte at ``offset`` in the file."""
    return _flip


@pytest.fixture
def run_script() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run tests/shelf/scripts/<script> with arguments and extra environment; wait for it."""

    def run(script: str, *args: Any, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(HERE / "scripts" / script), *map(str, args)],
            env=child_env(**env), capture_output=True, text=True, timeout=timeout,
        )

    return run


@pytest.fixture
def workload() -> Callable[..., subprocess.Popen[str]]:
    """Start ``python -m crashsafe.workloads.checkpoint_modes ARGS`` with piped text output."""

    def start(*args: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "crashsafe.workloads.checkpoint_modes", *map(str, args)],
            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    return start


class _States:
    """State A of a test shelf, and state B that ``scripts/shelf_change.py`` turns it into."""

    @staticmethod
    def make_a(path: Path, tx_mode: str) -> None:
        with Shelf(path, size="2MiB", tx_mode=tx_mode) as shelf, shelf.transaction():  # type: ignore[arg-type]
            shelf["a"] = np.arange(20_000, dtype=np.float64)
            shelf["b"] = np.arange(12, dtype=np.int32).reshape(3, 4)
            shelf["c"] = b"doomed"
            shelf["n"] = 1
            shelf["s"] = "A"
            shelf["e"] = np.ones(4, np.float32)

    @staticmethod
    def assert_a(shelf: Shelf) -> None:
        assert sorted(shelf) == ["a", "b", "c", "e", "n", "s"]
        assert np.array_equal(shelf["a"], np.arange(20_000, dtype=np.float64))
        assert np.array_equal(shelf["b"], np.arange(12).reshape(3, 4))
        assert shelf["c"] == b"doomed" and shelf["n"] == 1 and shelf["s"] == "A"
        assert np.array_equal(shelf["e"], np.ones(4))

    @staticmethod
    def assert_b(shelf: Shelf) -> None:
        assert sorted(shelf) == ["a", "b", "d", "e", "n", "s"]
        assert np.all(shelf["a"] == 9.0) and np.all(shelf["b"] == 7)
        assert np.array_equal(shelf["d"], np.arange(5)) and shelf["n"] == 2 and shelf["s"] == "B"
        assert shelf["e"].tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]


@pytest.fixture
def states() -> type[_States]:
    return _States
