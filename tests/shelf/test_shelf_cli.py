"""``crashsafe shelf inspect``: variables, versions, last transaction, a pending rollback, damage."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from typer.testing import CliRunner

from crashsafe.cli.app import app
from crashsafe.shelf import Shelf

runner = CliRunner()


def test_inspect_lists_variables_versions_and_last_transaction(shm_dir: Path) -> None:
    path = shm_dir / "s"
    with Shelf(path, size="2MiB") as shelf:
        shelf["centers"] = np.zeros((10, 64))
        shelf["name"] = "kmeans"
        with shelf.transaction():
            shelf["centers"] = np.ones((10, 64))
            shelf["iteration"] = 4
        seq = shelf.last_transaction["seq"]
    result = runner.invoke(app, ["shelf", "inspect", str(path)])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())  # rich wraps long lines
    for text in ("centers", "float64", "10x64", "5.0 KiB", "'kmeans'", "iteration", f"#{seq}",
                 "['centers', 'iteration']"):
        assert text in out
    row = next(line for line in result.output.splitlines() if "centers" in line and "float64" in line)
    assert "│       2 │" in row and "ok" in row  # version 2, checksum verified


def test_inspect_shows_a_transaction_left_by_a_crash(
    shm_dir: Path, run_script: Callable[..., subprocess.CompletedProcess[str]], states: Any
) -> None:
    path = shm_dir / "s"
    states.make_a(path, "undo")
    result = run_script("shelf_change.py", path, "undo", "process", CRASHSAFE_KILL_AT="shelf_before_meta")
    assert result.returncode == -signal.SIGKILL, result.stderr
    before = path.read_bytes()
    result = runner.invoke(app, ["shelf", "inspect", str(path)])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "incomplete transaction" in out and "rolls it back" in out
    assert path.read_bytes() == before  # inspect changes nothing


def test_inspect_reports_damage_and_refuses_foreign_files(shm_dir: Path) -> None:
    path = shm_dir / "s"
    with Shelf(path, size="1MiB") as shelf:
        shelf["x"] = np.arange(100.0)
        offset = shelf.info("x").offset
    with open(path, "r+b") as f:
        f.seek(offset + 3)
        f.write(b"\xff")
    result = runner.invoke(app, ["shelf", "inspect", str(path)])
    assert result.exit_code == 1 and "DAMAGED" in result.output
    assert runner.invoke(app, ["shelf", "inspect", "--no-verify", str(path)]).exit_code == 0
    foreign = shm_dir / "foreign"
    foreign.write_bytes(b"hello" * 2000)
    result = runner.invoke(app, ["shelf", "inspect", str(foreign)])
    assert result.exit_code == 2 and "not a crashsafe shelf" in " ".join(result.output.split())


def test_inspect_of_a_truncated_shelf_is_a_clear_error(shm_dir: Path) -> None:
    """The metadata check failed while slices of the mapping were alive in the error's traceback, so
    closing the mapping raised BufferError ('cannot close exported pointers exist') over it: exit 1
    and a traceback (found by an audit)."""
    path = shm_dir / "s"
    with Shelf(path, size="1MiB") as shelf:
        shelf["a"] = np.arange(1000.0)
        shelf["it"] = 5
    with open(path, "r+b") as f:
        f.truncate(6000)
    result = runner.invoke(app, ["shelf", "inspect", str(path)], catch_exceptions=False)
    out = " ".join(result.output.split())
    assert result.exit_code == 2, out
    assert out.startswith("error:") and "damaged" in out and "Restore it from a copy" in out
