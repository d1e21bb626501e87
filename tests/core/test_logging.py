"""What training says through the ``logging`` module (logger ``crashsafe``): one line per resume,
one per fallback past a damaged step, one per failure that is retried; nothing otherwise."""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import crashsafe as cs
import crashsafe._faults as faults
from crashsafe._log import through


def _state(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(1000, float(step), dtype=np.float32)}


def _lines(caplog: pytest.LogCaptureFixture, name: str = "crashsafe") -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == name]


def test_saves_say_nothing_and_a_resume_says_where_from_and_what_it_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="crashsafe")
    with cs.CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    assert _lines(caplog) == []  # quiet while all goes well
    data = tmp_path / "step_000000000003" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x10
    data.write_bytes(bytes(raw))
    live = _state(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cs.CorruptCheckpointWarning)
        assert cs.CheckpointManager(tmp_path, read_only=True).restore(live) == 2
    (fell, fell_text), (resumed, resumed_text) = _lines(caplog)
    assert fell == logging.WARNING and fell_text.startswith("fell back from step 3 because checkpoint step 3")
    assert "checksum" in fell_text
    assert resumed == logging.INFO
    assert re.fullmatch(rf"resumed from step 2 \({re.escape(str(tmp_path))}, \d+\.\d\d s\)", resumed_text)
    caplog.clear()
    assert cs.CheckpointManager(tmp_path, read_only=True).load(1)["w"][0] == 1.0
    assert [text.split(" (")[0] for _, text in _lines(caplog)] == ["loaded step 1"]


def test_a_failed_deletion_that_is_retried_is_noted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="crashsafe")
    with cs.CheckpointManager(tmp_path, keep_last=1, async_save=False) as mgr:
        mgr.save(1, _state(1))
        faults.arm("mid_delete", fail=True)
        try:
            with pytest.warns(cs.RetentionWarning):
                mgr.save(2, _state(2))
        finally:
            faults.arm(None, fail=True)
    ((level, text),) = _lines(caplog)
    assert level == logging.WARNING
    assert text.startswith("step 2 is committed, but deleting old steps failed")
    assert text.endswith("Retention tries again after the next save")


def test_an_integration_sends_the_lines_through_its_frameworks_logger(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(7, _state(7))
    with through(logging.getLogger("framework.checkpointing")):
        cs.CheckpointManager(tmp_path, read_only=True).load()
    assert _lines(caplog) == []
    ((level, text),) = _lines(caplog, "framework.checkpointing")
    assert level == logging.INFO and text.startswith("crashsafe: resumed from step 7 (")
