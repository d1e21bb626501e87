"""Damage is detected by really damaging files: flipped bytes, truncation, missing files, garbage."""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import crashsafe as cs
from crashsafe.cli.app import app


def _three_steps(directory: Path) -> None:
    with cs.CheckpointManager(directory, keep_last=None) as mgr:
        for step in (1, 2, 3):
            rng = np.random.default_rng(step)
            mgr.save(
                step,
                {
                    "w": rng.standard_normal(50_000).astype(np.float32),
                    "b": rng.integers(0, 9, 100),
                    "step": step,
                },
            )


def _flip_data_byte(step_dir: Path) -> None:
    data = step_dir / "data.bin"
    raw = bytearray(data.read_bytes())
    pos = random.Random(0).randrange(len(raw))
    raw[pos] ^= 0x10
    data.write_bytes(bytes(raw))


def _truncate(step_dir: Path) -> None:
    data = step_dir / "data.bin"
    data.write_bytes(data.read_bytes()[:-100])


def _delete_data(step_dir: Path) -> None:
    (step_dir / "data.bin").unlink()


def _garbage_manifest(step_dir: Path) -> None:
    (step_dir / "manifest.json").write_bytes(b"\x00garbage{{")


def _flip_manifest_byte(step_dir: Path) -> None:
    path = step_dir / "manifest.json"
    text = path.read_text()
    path.write_text(text.replace('"step":3', '"step":4', 1).replace('"offset":0', '"offset":8', 1))


def _delete_manifest(step_dir: Path) -> None:
    (step_dir / "manifest.json").unlink()


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "flipped data byte": (_flip_data_byte, "fails its checksum"),
    "truncated data": (_truncate, "truncated"),
    "missing data file": (_delete_data, "missing"),
    "garbage manifest": (_garbage_manifest, "not valid JSON"),
    "edited manifest": (_flip_manifest_byte, "checksum mismatch"),
    "missing manifest": (_delete_manifest, "manifest.json is missing"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_newest_step_falls_back_with_warning(tmp_path: Path, kind: str) -> None:
    _three_steps(tmp_path)
    damage, message = DAMAGE[kind]
    damage(tmp_path / "step_000000000003")
    mgr = cs.CheckpointManager(tmp_path)
    with pytest.warns(cs.CorruptCheckpointWarning, match=message):
        state = mgr.load()
    assert state["step"] == 2
    with pytest.raises(cs.CorruptCheckpointError, match=message):
        mgr.load(3)  # an explicit step never silently falls back
    target = {"w": np.zeros(50_000, np.float32), "b": np.zeros(100, np.int64), "step": 0}
    with pytest.warns(cs.CorruptCheckpointWarning):
        assert mgr.restore(target) == 2
    assert target["step"] == 2
    assert np.array_equal(target["w"], np.random.default_rng(2).standard_normal(50_000).astype(np.float32))
    report = cs.verify(tmp_path)
    assert not report.ok and [d.step for d in report.damaged] == [3]
    assert message in (report.damaged[0].problem or "")
    mgr.close()


def test_every_step_damaged_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    _three_steps(tmp_path)
    for step in (1, 2, 3):
        _flip_data_byte(tmp_path / f"step_{step:012d}")
    mgr = cs.CheckpointManager(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cs.CorruptCheckpointWarning)
        with pytest.raises(cs.CorruptCheckpointError, match="every checkpoint"):
            mgr.restore({"w": np.zeros(3)})
    mgr.close()


def test_cli_verify_exits_nonzero_and_names_the_damage(tmp_path: Path) -> None:
    _three_steps(tmp_path)
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(tmp_path)])
    assert ok.exit_code == 0 and "all 3 steps intact" in ok.output
    _truncate(tmp_path / "step_000000000002")
    bad = runner.invoke(app, ["verify", str(tmp_path)])
    assert bad.exit_code == 1
    assert "step 2" in bad.output and "truncated" in bad.output


@pytest.mark.parametrize("trial", range(20))
def test_random_single_byte_flips_are_always_caught(tmp_path: Path, trial: int) -> None:
    """A flip anywhere in any file of a step is detected (data by xxh3, manifest by its checksum)."""
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": np.arange(2000, dtype=np.float64), "meta": {"lr": 0.1, "name": "x"}})
    rng = random.Random(trial)
    victim = tmp_path / "step_000000000001" / rng.choice(["data.bin", "manifest.json"])
    raw = bytearray(victim.read_bytes())
    pos = rng.randrange(len(raw))
    raw[pos] ^= 1 << rng.randrange(8)
    victim.write_bytes(bytes(raw))
    report = cs.verify(tmp_path)
    assert not report.ok, f"flip of byte {pos} in {victim.name} went unnoticed"
