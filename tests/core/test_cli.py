"""The command line, run for real: ls, show, verify, export, gc and the demo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import crashsafe as cs
from crashsafe.cli.app import app

runner = CliRunner()


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    with cs.CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in range(1, 6):
            mgr.save(
                step,
                {
                    "model": {"w": torch.full((4, 3), float(step)), "h": torch.ones(2, dtype=torch.bfloat16)},
                    "np": np.arange(5),
                    "step": step,
                },
                metrics={"loss": 1 / step},
            )
    return tmp_path


def test_ls_lists_steps_with_status(ckpt: Path) -> None:
    result = runner.invoke(app, ["ls", str(ckpt)])
    assert result.exit_code == 0, result.output
    for step in range(1, 6):
        assert f"│    {step} │" in result.output
    assert result.output.count("ok") == 5


def test_show_prints_tensors(ckpt: Path) -> None:
    result = runner.invoke(app, ["show", str(ckpt), "--step", "2"])
    assert result.exit_code == 0, result.output
    assert "model.w" in result.output and "4x3" in result.output and "bfloat16" in result.output
    assert "loss=0.5" in result.output
    missing = runner.invoke(app, ["show", str(ckpt), "--step", "99"])
    assert missing.exit_code == 2 and "not committed" in missing.output


def test_export_writes_a_safetensors_file(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = runner.invoke(app, ["export", str(ckpt), "-o", str(out), "--prefix", "model."])
    assert result.exit_code == 0, result.output
    tensors = load_file(out)
    assert set(tensors) == {"model.w", "model.h"}
    assert torch.equal(tensors["model.w"], torch.full((4, 3), 5.0))
    assert tensors["model.h"].dtype == torch.bfloat16


def test_gc_keeps_the_newest(ckpt: Path) -> None:
    result = runner.invoke(app, ["gc", str(ckpt), "--keep-last", "2"])
    assert result.exit_code == 0, result.output
    assert cs.CheckpointManager(ckpt, read_only=True).steps() == [4, 5]
    with cs.CheckpointManager(ckpt):
        locked = runner.invoke(app, ["gc", str(ckpt), "--keep-last", "1"])
    assert locked.exit_code == 2 and "another CheckpointManager" in locked.output


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    for cmd in ("ls", "verify", "show"):
        result = runner.invoke(app, [cmd, str(tmp_path / "nope")])
        assert result.exit_code != 0
        assert "nope" in result.output


@pytest.mark.timeout(240)
def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "crashsafe.cli",
            "demo",
            "--steps",
            "80",
            "--kills",
            "1",
            "--directory",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bit-identical" in result.stdout
    assert cs.verify(tmp_path / "killed" / "ckpt").ok
