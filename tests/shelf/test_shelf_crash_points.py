"""A real SIGKILL at every point of the shelf's transaction protocol: reopening always yields the
state before the transaction (rolled back, and reported) or after it (committed), never a mix."""

from __future__ import annotations

import signal
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from crashsafe.shelf import Shelf, ShelfRecoveredWarning

POINTS = ["shelf_after_begin", "shelf_after_undo", "shelf_mid_write", "shelf_before_meta",
          "shelf_mid_meta", "shelf_after_meta"]
Run = Callable[..., subprocess.CompletedProcess[str]]


def reopen(path: Path) -> tuple[Shelf, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shelf = Shelf(path)
    return shelf, [w for w in caught if issubclass(w.category, ShelfRecoveredWarning)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("tx_mode", ["undo", "shadow"])
def test_sigkill_at_each_point_of_a_transaction(shm_dir: Path, run_script: Run, states: Any,
                                                point: str, tx_mode: str) -> None:
    path = shm_dir / "s"
    states.make_a(path, tx_mode)
    result = run_script("shelf_change.py", path, tx_mode, "process", CRASHSAFE_KILL_AT=point)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "committed" not in result.stdout
    shelf, recovered_warnings = reopen(path)
    with shelf:
        if point == "shelf_after_meta":
            states.assert_b(shelf)
            assert shelf.recovered is None and not recovered_warnings
        else:
            states.assert_a(shelf)
            assert shelf.recovered is not None and shelf.recovered.seq == shelf.seq
            assert len(recovered_warnings) == 1 and "rolled back" in str(recovered_warnings[0].message)
            rollback = shelf.metadata.rollback
            assert rollback is not None and rollback["reason"] == "crash"
        shelf.verify()
    if point == "shelf_after_meta":
        return
    # the shelf keeps working after recovery: the same change now commits
    result = run_script("shelf_change.py", path, tx_mode, "process")
    assert result.returncode == 0 and "committed" in result.stdout, result.stderr
    with Shelf(path) as shelf:
        states.assert_b(shelf)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", ["shelf_after_undo", "shelf_mid_meta"])
def test_sigkill_with_power_durability_on_disk(tmp_path: Path, run_script: Run, states: Any,
                                              point: str) -> None:
    path = tmp_path / "s"
    states.make_a(path, "undo")
    result = run_script("shelf_change.py", path, "undo", "power", CRASHSAFE_KILL_AT=point)
    assert result.returncode == -signal.SIGKILL, result.stderr
    shelf, _ = reopen(path)
    with shelf:
        assert shelf.durability == "power"
        states.assert_a(shelf)
        assert shelf.recovered is not None


@pytest.mark.timeout(120)
def test_sigkill_during_recovery_is_recovered_by_the_next_open(shm_dir: Path, run_script: Run,
                                                               states: Any) -> None:
    path = shm_dir / "s"
    states.make_a(path, "undo")
    first = run_script("shelf_change.py", path, "undo", "process", CRASHSAFE_KILL_AT="shelf_before_meta")
    assert first.returncode == -signal.SIGKILL, first.stderr
    # the next process dies while copying the first saved block back
    second = run_script("shelf_change.py", path, "undo", "process", CRASHSAFE_KILL_AT="shelf_mid_recovery")
    assert second.returncode == -signal.SIGKILL, second.stderr
    assert "recovered" not in second.stdout  # it died inside Shelf(...)
    shelf, recovered_warnings = reopen(path)
    with shelf:
        states.assert_a(shelf)
        assert shelf.recovered is not None and recovered_warnings
