"""ls, show, verify, gc and simulate for people, through the console script at 80 columns, piped
and on a terminal: no path cut, dtype and shape whole, metrics shown, the best step marked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import crashsafe as cs

from .conftest import BOX, assert_fits, first_column, invoke


@pytest.mark.parametrize("tty", [False, True], ids=["piped", "terminal"])
def test_show_at_80_columns_folds_paths_and_keeps_dtype_and_shape_whole(
    run: tuple[Path, list[str]], tty: bool
) -> None:
    directory, paths = run
    assert max(map(len, paths)) > 60  # longer than any column 80 columns can give a path
    shown = invoke("show", str(directory), tty=tty)
    assert shown.code == 0, shown.err
    assert_fits(shown.out)
    assert bool(set(shown.out) & BOX) == tty
    manifest = cs.CheckpointManager(directory, read_only=True).manifest()
    rows = first_column(shown.out, "path")
    assert [path for path, _ in rows] == paths  # every path whole, in order
    for (_, rest), p in zip(rows, manifest.payloads, strict=True):
        assert rest[:2] == [p.dtype, "x".join(map(str, p.shape)) or "()"]
    for line in ("step 3 of", "metrics: accuracy=", "loss=", "info: crashsafe="):
        assert line in shown.out
    assert "left out at 80 columns" in shown.out
    if tty:
        return
    wide = invoke("show", str(directory), columns=200)
    assert "left out" not in wide.out and "zstd(level=1,shuffle=True)" in wide.out


def test_ls_shows_the_metrics_steps_share_and_marks_the_best(run: tuple[Path, list[str]]) -> None:
    directory, _ = run
    reports = cs.verify(directory).steps
    losses = {r.step: r.metrics["loss"] for r in reports}
    listed = invoke("ls", str(directory), "--metric", "loss")
    assert listed.code == 0, listed.err
    assert_fits(listed.out)
    assert not set(listed.out) & BOX
    rows = {
        int(words[0]): words for words in map(str.split, listed.out.splitlines()) if words[:1][0].isdigit()
    }
    assert sorted(rows) == [1, 2, 3]
    best = min(losses, key=lambda s: losses[s])
    for step, words in rows.items():
        assert words[-1] == "ok"
        assert (step == best) == ("(best)" in words)
        assert f"{losses[step]:.4g}" in words
    assert f"best loss (min): step {best}" in listed.out
    accuracy = invoke("ls", str(directory), "--metric", "accuracy", "--mode", "max")
    highest = max(reports, key=lambda r: (r.metrics["accuracy"], r.step)).step
    assert f"best accuracy (max): step {highest}" in accuracy.out


def test_ls_names_what_is_wrong(run: tuple[Path, list[str]], tmp_path: Path) -> None:
    directory, _ = run
    unknown = invoke("ls", str(directory), "--metric", "val_loss")
    assert unknown.code == 2 and not unknown.out
    assert "val_loss" in unknown.err and "accuracy, loss" in unknown.err
    mode = invoke("ls", str(directory), "--metric", "loss", "--mode", "lowest")
    assert mode.code == 2 and "--mode" in mode.err
    missing = invoke("ls", str(tmp_path / "nope"))
    assert missing.code == 2 and "nope" in missing.err and not missing.out


def test_a_damaged_step_at_80_columns(run: tuple[Path, list[str]], tmp_path: Path) -> None:
    directory = tmp_path / "bad"
    shutil.copytree(run[0], directory)
    data = next(p for p in (directory / "step_000000000002").iterdir() if p.name != "manifest.json")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    listed = invoke("ls", str(directory))
    assert listed.code == 0
    assert_fits(listed.out)
    assert "damaged: checkpoint step 2" in " ".join(listed.out.split())  # the status folds at spaces
    verified = invoke("verify", str(directory))
    assert verified.code == 1
    assert_fits(verified.out)
    assert "DAMAGED step 2" in verified.out and "1 of 3 steps damaged; newest intact step: 3" in verified.err


def test_simulate_fits_80_columns(tmp_path: Path) -> None:
    ran = invoke(
        "simulate", "--mtbf", "4h", "--ckpt-cost", "30s", "--trials", "50", "--steps", "1000",
        "--plot", str(tmp_path / "s.png"),
    )  # fmt: skip
    assert ran.code == 0, ran.err
    assert_fits(ran.out)
    for name in ("young", "daly", "coci", "convergence"):
        assert name in ran.out


def test_python_dash_m_is_the_same_command(run: tuple[Path, list[str]]) -> None:
    """`python -m crashsafe` (no console script on PATH) prints what the console script prints."""
    directory, _ = run
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run(
        [sys.executable, "-m", "crashsafe", "ls", str(directory), "--json"], env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and not done.stderr, done.stderr
    assert json.loads(done.stdout) == json.loads(invoke("ls", str(directory), "--json").out)
