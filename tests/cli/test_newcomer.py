"""What a newcomer met on the command line (issue 26): ``ls`` of a Lightning folder found nothing,
``show`` could not filter paths, ``diff`` split numbers at 80 columns, ``verify`` promised a fallback
that did not exist, ``gc --keep-last 0`` printed a box, and ``gc`` deleted down to one step without
a word. Through the console script at 80 columns, piped, on real checkpoints."""

from __future__ import annotations

import argparse
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import crashsafe as cs
from crashsafe.storage.layout import step_dir

from .conftest import BOX, assert_fits, invoke, invoke_here


def _lightning_folder(directory: Path) -> None:
    """A Lightning checkpoint folder written by CrashsafeCheckpointIO under the stock ModelCheckpoint:
    pointer files, and the steps in ``.crashsafe/``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from crashsafe.integrations import lightning as cs_lightning
    from crashsafe.workloads import lightning_digits as job

    checkpoint = ModelCheckpoint(dirpath=directory, save_top_k=-1, every_n_train_steps=2)
    module = job.DigitsModule(data_dir=directory, extra=argparse.Namespace(note="digits"))
    trainer = job.make_trainer(6, [cs_lightning.CrashsafeCheckpointIO()], [checkpoint], directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)


def test_ls_verify_and_show_of_a_lightning_folder_read_its_store(tmp_path: Path) -> None:
    """`crashsafe ls ckpt` said "no committed checkpoints" (exit 0): the store is ckpt/.crashsafe."""
    folder = tmp_path / "ckpt"
    _lightning_folder(folder)
    store = folder / ".crashsafe"
    steps = cs.CheckpointManager(store, read_only=True).steps()
    assert len(steps) == 3 and any(p.suffix == ".ckpt" for p in folder.iterdir())
    listed = invoke("ls", str(folder))
    assert listed.code == 0, listed.err
    assert f"reading {store}" in " ".join(listed.err.split())
    assert [int(w[0]) for w in map(str.split, listed.out.splitlines()) if w and w[0].isdigit()] == steps
    verified = invoke("verify", str(folder), "--json")
    assert verified.code == 0 and json.loads(verified.out)["location"] == str(store), verified.err
    assert invoke_here("show", str(folder)).code == 0
    collected = invoke_here("gc", str(folder), "--keep-last", "1")  # deleting: never redirected
    assert collected.code == 2 and f"crashsafe gc {store}" in " ".join(collected.err.split())
    assert cs.CheckpointManager(store, read_only=True).steps() == steps
    assert not (folder / ".lock").exists()


def test_show_path_filters_tensors_by_glob(run: tuple[Path, list[str]]) -> None:
    directory, paths = run
    shown = invoke("show", str(directory), "--path", "model.*", "--json")
    assert shown.code == 0, shown.err
    model = [p for p in paths if p.startswith("model.")]
    assert [t["path"] for t in json.loads(shown.out)["tensors"]] == model
    both = invoke_here("show", str(directory), "-p", "*.bias", "-p", "step")
    assert both.code == 0 and f"of {len(paths)} tensors match *.bias or step" in both.out
    none = invoke_here("show", str(directory), "--path", "modle.*")
    assert none.code == 2 and "no tensor path matches 'modle.*'" in none.err and paths[0] in none.err


def test_diff_never_splits_a_number_at_80_columns(tmp_path: Path) -> None:
    """`what changed` wrapped long numbers mid-digit (0.30000000000000 / 004)."""
    a = {"optimizer.param_groups.0.learning_rate": 0.30000000000000004, "big": 2**62 + 12345}
    b = {"optimizer.param_groups.0.learning_rate": 0.12345678901234568, "big": 2**62 + 54321}
    a["tiny"], b["tiny"] = -1.2345678901234567e-308, -9.876543210987655e-300
    a["model.encoder.layers.0.self_attention.in_proj_weight"] = np.zeros(3)
    b["model.encoder.layers.0.self_attention.in_proj_weight"] = np.ones(3)
    with cs.CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(1, a)
        mgr.save(2, b)
    for tty in (False, True):
        shown = invoke("diff", str(tmp_path), "1", "2", tty=tty)
        assert shown.code == 1, shown.err
        assert_fits(shown.out)
        words = set(re.sub("[" + "".join(BOX) + "]", " ", shown.out).split())
        for value in [*a.values(), *b.values()]:
            if not isinstance(value, np.ndarray):
                assert repr(value) in words, (value, shown.out)


def _damage(directory: Path, step: int) -> None:
    data = step_dir(directory, step) / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))


def _three_steps(directory: Path) -> None:
    with cs.CheckpointManager(directory, keep_last=None, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.arange(8.0) * step}, {"loss": 1.0 / step})


def test_verify_with_no_intact_step_promises_no_fallback(tmp_path: Path) -> None:
    _three_steps(tmp_path)
    for step in (1, 2, 3):
        _damage(tmp_path, step)
    run = invoke_here("verify", str(tmp_path))
    text = " ".join(run.err.split())
    assert run.code == 1 and "3 of 3 steps damaged" in text
    assert "falls back" not in text and "no step is intact" in text and "another copy" in text
    _three_steps(tmp_path / "fine")
    _damage(tmp_path / "fine", 3)
    partly = " ".join(invoke_here("verify", str(tmp_path / "fine")).err.split())
    assert "newest intact step: 2" in partly and "falls back to the newest intact step" in partly


@pytest.mark.parametrize("option", ["--keep-last", "--keep-every", "--keep-best"])
def test_gc_refuses_a_count_below_1_on_one_line(tmp_path: Path, option: str) -> None:
    """Typer's own check printed a boxed usage error, unlike every other refusal."""
    _three_steps(tmp_path)
    extra = ["--metric", "loss"] if option == "--keep-best" else []
    run = invoke("gc", str(tmp_path), option, "0", *extra)
    assert run.code == 2 and not run.out, run.err
    assert run.err.startswith(f"error: {option} 0: give a whole number of at least 1")
    assert not set(run.err) & BOX
    assert cs.CheckpointManager(tmp_path, read_only=True).steps() == [1, 2, 3]


def test_gc_that_would_leave_a_single_step_needs_force(tmp_path: Path) -> None:
    """`gc --keep-best 1 --metric loss` kept only the newest step, silently: nothing to fall back to."""
    _three_steps(tmp_path)
    refused = invoke_here("gc", str(tmp_path), "--keep-best", "1", "--metric", "loss")
    text = " ".join(refused.err.split())
    assert refused.code == 2 and "delete steps [1, 2] and leave only step 3" in text and "--force" in text
    assert cs.CheckpointManager(tmp_path, read_only=True).steps() == [1, 2, 3]
    assert invoke_here("gc", str(tmp_path), "--keep-last", "2").code == 0  # two stay: no question asked
    forced = invoke_here("gc", str(tmp_path), "--keep-best", "1", "--metric", "loss", "--force", "--json")
    assert forced.code == 0 and json.loads(forced.out)["kept"] == [3], forced.err
    _three_steps(tmp_path / "damaged")
    for step in (1, 2):
        _damage(tmp_path / "damaged", step)
    cleaned = invoke_here("gc", str(tmp_path / "damaged"), "--delete-damaged")
    assert cleaned.code == 2 and "leave only step 3" in " ".join(cleaned.err.split())
    assert cs.CheckpointManager(tmp_path / "damaged", read_only=True).steps() == [1, 2, 3]


def test_gc_of_a_folder_with_nothing_to_collect_leaves_it_as_it_was(tmp_path: Path) -> None:
    """gc opened a writer anywhere: a folder that is no store got a `.lock` file."""
    (tmp_path / "notes.txt").write_text("mine")
    run = invoke_here("gc", str(tmp_path))
    assert run.code == 0 and "nothing to collect" in run.out, run.err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
