"""The command line, run for real: ls, show, verify, export, gc and the demo."""

from __future__ import annotations

import os
import shutil
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
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == [1, 2, 3, 4, 5]
    assert [row[-1] for row in rows] == ["ok"] * 5
    assert [float(row[1]) for row in rows] == pytest.approx([1 / s for s in range(1, 6)], rel=1e-3)  # loss


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
    assert set(tensors) == {"w", "h"}  # --prefix strips the prefix (docs/integrations.md)
    assert torch.equal(tensors["w"], torch.full((4, 3), 5.0))
    assert tensors["h"].dtype == torch.bfloat16


def test_export_refuses_a_target_it_must_not_replace(ckpt: Path, tmp_path: Path) -> None:
    """safetensors writes a temporary file and renames it over the target, whatever that is: a file
    of a committed step, the lock, a FIFO, /dev/null. Each is refused before anything is read."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "afile").write_text("x")
    step = ckpt / f"step_{3:012d}"
    for target, message in [
        (step / "data.bin", "checkpoint directory's own entries"),
        (ckpt / ".lock", "checkpoint directory's own entries"),
        (step, "not a file"),
        (tmp_path / "fifo", "not a file"),
        (tmp_path, "not a file"),
        (tmp_path / "nowhere" / "m.safetensors", "does not exist"),
    ]:
        result = runner.invoke(app, ["export", str(ckpt), "-o", str(target)])
        assert result.exit_code == 2 and message in result.output, (target, result.output)
    hf = runner.invoke(app, ["export", str(ckpt), "--hf-dir", str(tmp_path / "afile")])
    assert hf.exit_code == 2 and "not a directory" in hf.output, hf.output
    assert cs.verify(ckpt).ok and (tmp_path / "fifo").is_fifo()


@pytest.mark.parametrize("scheme", ["file://", "local://"])
def test_export_of_a_file_url_refuses_its_own_entries(ckpt: Path, scheme: str) -> None:
    """The same directory given as a ``file://`` URL: export skipped the check of the checkpoint's
    own entries for every URL, so ``export file://ckpt -o ckpt/step_.../manifest.json`` replaced a
    committed manifest with safetensors bytes (the step then failed verification)."""
    step = ckpt / f"step_{3:012d}"
    before = (step / "manifest.json").read_bytes()
    for target in (step / "manifest.json", step / "data.bin", ckpt / ".lock"):
        result = runner.invoke(app, ["export", f"{scheme}{ckpt}", "-o", str(target)])
        assert result.exit_code == 2 and "checkpoint directory's own entries" in result.output, result.output
    hf = runner.invoke(app, ["export", f"{scheme}{ckpt}", "--hf-dir", str(step)])
    assert hf.exit_code == 2 and "checkpoint directory's own entries" in hf.output, hf.output
    assert (step / "manifest.json").read_bytes() == before and not (step / "model.safetensors").exists()
    assert cs.verify(ckpt).ok


def test_gc_keeps_the_newest(ckpt: Path) -> None:
    result = runner.invoke(app, ["gc", str(ckpt), "--keep-last", "2"])
    assert result.exit_code == 0, result.output
    assert cs.CheckpointManager(ckpt, read_only=True).steps() == [4, 5]
    with cs.CheckpointManager(ckpt):
        locked = runner.invoke(app, ["gc", str(ckpt), "--keep-last", "1"])
    assert locked.exit_code == 2 and "another CheckpointManager" in locked.output


def test_gc_delete_damaged_counts_intact_steps_only(ckpt: Path) -> None:
    """Steps 3, 4 and 5 damaged: `gc --delete-damaged --keep-last 2`, as `verify` advises, deletes
    the damaged steps and keeps the two newest intact ones. Retention counted the damaged steps among
    the newest it keeps, then deleted them too: nothing was left to restore."""
    for step in (3, 4, 5):
        data = ckpt / f"step_{step:012d}" / "data.bin"
        raw = bytearray(data.read_bytes())
        raw[10] ^= 0xFF
        data.write_bytes(bytes(raw))
    result = runner.invoke(app, ["gc", str(ckpt), "--keep-last", "2", "--delete-damaged"])
    assert result.exit_code == 0, result.output
    assert cs.verify(ckpt).intact == [1, 2] == cs.CheckpointManager(ckpt, read_only=True).steps()


def test_gc_delete_damaged_keeps_a_damaged_step_an_intact_one_needs(tmp_path: Path) -> None:
    """Step 2's raw payload is damaged, but step 3's deltas need only step 2's intact one: step 2
    stays (deleting it would damage step 3), step 3 still loads."""
    codec = {"model.*": cs.codecs.Incremental(full_every=4), "*": "raw"}
    with cs.CheckpointManager(tmp_path, keep_last=None, codec=codec, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": {"w": torch.full((64,), float(step))}, "other": np.full(64, step)})
        entry = next(p for p in mgr.manifest(2).payloads if p.path == "other")
    data = tmp_path / f"step_{2:012d}" / entry.file
    raw = bytearray(data.read_bytes())
    raw[entry.offset] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert cs.verify(tmp_path).intact == [1, 3]
    result = runner.invoke(app, ["gc", str(tmp_path), "--keep-last", "5", "--delete-damaged"])
    assert result.exit_code == 0, result.output
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    assert reader.steps() == [1, 2, 3] and torch.equal(reader.load(3)["model"]["w"], torch.full((64,), 3.0))


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


@pytest.fixture
def chained(tmp_path: Path) -> Path:
    """Steps 1..7 saved with an incremental codec: step 1 and 5 full, the others deltas."""
    directory = tmp_path / "chained"
    codec = {"model.*": cs.codecs.Incremental(full_every=4), "*": "raw"}
    with cs.CheckpointManager(directory, keep_last=None, codec=codec) as mgr:
        for step in range(1, 8):
            mgr.save(
                step, {"model": {"w": torch.full((64,), float(step)) + torch.arange(64.0)}, "step": step}
            )
    return directory


def test_gc_keeps_the_delta_bases_kept_steps_need(chained: Path) -> None:
    result = runner.invoke(app, ["gc", str(chained), "--keep-last", "1"])
    assert result.exit_code == 0, result.output
    reader = cs.CheckpointManager(chained, read_only=True)
    steps = reader.steps()
    assert steps[-1] == 7 and len(steps) > 1  # 7 is a delta: its chain back to a full save stays
    assert torch.equal(reader.load(7)["model"]["w"], torch.full((64,), 7.0) + torch.arange(64.0))
    assert cs.verify(chained).ok


def test_export_reads_delta_steps_through_their_chain(chained: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    result = runner.invoke(app, ["export", str(chained), "-o", str(out), "--step", "7"])
    assert result.exit_code == 0, result.output
    assert torch.equal(load_file(out)["model.w"], torch.full((64,), 7.0) + torch.arange(64.0))


def test_verify_reports_a_delta_whose_base_is_gone(chained: Path) -> None:
    bases = cs.CheckpointManager(chained, read_only=True).manifest(7).payloads[0].base
    assert bases is not None
    shutil.rmtree(chained / f"step_{bases:012d}")  # deleted behind crashsafe's back
    report = cs.verify(chained)
    assert not report.ok
    assert any(f"delta of step {bases}" in (d.problem or "") for d in report.damaged)
    result = runner.invoke(app, ["verify", str(chained)])
    assert result.exit_code == 1 and f"delta of step {bases}" in result.output
