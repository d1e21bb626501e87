"""Helpers of the hostile-input tests: files outside a checkpoint location that crashsafe must
never touch, and a call that must not block."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_NOT_YOURS = b"not yours " * 100


def make_victim(where: Path) -> Path:
    """A directory of files (``data.bin``, ``manifest.json``, ``precious.txt``) to point links at."""
    where.mkdir()
    for name in ("data.bin", "manifest.json", "precious.txt"):
        (where / name).write_bytes(_NOT_YOURS)
    return where


def untouched(victim: Path) -> None:
    """Assert that the files of ``make_victim`` are all there, unchanged, and nothing was added."""
    assert sorted(p.name for p in victim.iterdir()) == ["data.bin", "manifest.json", "precious.txt"]
    assert all(p.read_bytes() == _NOT_YOURS for p in victim.iterdir())


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it blocks."""
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for more than {seconds} s"
    if error:
        raise error[0]
    return result[0]


def stop(process: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    """Kill a helper process a test started and close its pipes."""
    process.kill()
    process.wait()
    for pipe in (process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()
