"""Benchmarks stay alive: each one listed here runs its ``--quick`` mode (a tiny state, seconds) end to
end, report and picture included, warn-free. Speed is measured in bench/, never here (docs/design.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_quick(name: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "bench", name, "--quick", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_finetune_quick_runs_every_saver_and_writes_its_report(tmp_path: Path) -> None:
    out, work = tmp_path / "finetune.md", tmp_path / "work"
    done = run_quick("finetune", tmp_path, "--work", str(work), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""  # no warning or log line from DCP, torch or crashsafe
    text = out.read_text()
    for row in ("crashsafe default (whole state)", 'crashsafe codec="incremental"', "dcp.async_save",
                "torch.save + fsync (whole state)", "crashsafe, adapter alone (ideal)",
                "crashsafe unchanged=False"):  # fmt: skip
        assert f"| {row}" in text, row
    assert "the read limit** (target <= 1.3x)" in text
    assert out.with_suffix(".png").stat().st_size > 0
    assert not any(work.iterdir()) if work.exists() else True  # the checkpoints are cleaned up


def test_memory_tier_quick_measures_steps_recovery_and_kills(tmp_path: Path) -> None:
    out, work = tmp_path / "memory_tier.md", tmp_path / "work"
    before = set(Path("/dev/shm").glob("crashsafe-bench-*"))
    done = run_quick("memory_tier", tmp_path, "--kinds", "ddp", "--work", str(work), "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr == ""  # no warning or log line from torch or crashsafe
    text = out.read_text()
    for row in ("| DDP | no checkpoint (baseline) |", "| DDP | memory save every step (steady state) |",
                "| DDP | floor: copy the rank's state into kept buffers |", "| DDP | peer |", "| DDP | s3 |",
                "| DDP | memory every step, `async_save=False` | 1 |"):  # fmt: skip
        assert row in text, row
    assert "**Per-step overhead of a memory save every step <= 10% of a step**" in text
    assert "**no**" not in text  # every restore bit-identical
    assert out.with_suffix(".png").stat().st_size > 0
    assert not work.exists()  # the checkpoints and logs are cleaned up
    assert set(Path("/dev/shm").glob("crashsafe-bench-*")) <= before  # and the memory directories
