"""Hostile directory contents, made for real: symlinks out of the checkpoint, FIFOs, directories
where files belong, and a checkpoint directory deleted under its writer. crashsafe must never read,
write or delete outside the directory, never hang, and keep falling back to intact steps."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import crashsafe as cs
from crashsafe.cli.app import app
from crashsafe.storage.layout import step_dir
from crashsafe.storage.stores import open_store

from ..hostile import make_victim, untouched, within

runner = CliRunner()


def _state(step: int) -> dict[str, Any]:
    return {"w": np.full(64, float(step)), "step": step}


def _run(directory: Path, steps: range, **kwargs: Any) -> None:
    with cs.CheckpointManager(directory, keep_last=None, async_save=False, **kwargs) as mgr:
        for step in steps:
            mgr.save(step, _state(step))


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """Files outside the checkpoint location that crashsafe must never touch."""
    return make_victim(tmp_path / "outside")


# ----------------------------------------------------------------------------- symlinked steps


def test_retention_deletes_a_symlinked_step_not_its_target(tmp_path: Path, victim: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(ckpt, range(1, 3))
    os.symlink(victim, step_dir(ckpt, 0))  # the oldest "step" is a link to someone else's files
    with cs.CheckpointManager(ckpt, keep_last=2, async_save=False) as mgr:
        mgr.save(3, _state(3))
        assert mgr.steps() == [2, 3]
    untouched(victim)
    assert not any(p.is_symlink() for p in ckpt.iterdir())


def test_gc_deletes_a_symlinked_step_not_its_target(tmp_path: Path, victim: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(ckpt, range(1, 4))
    os.symlink(victim, step_dir(ckpt, 0))
    os.symlink(victim, ckpt / ".trash-step_000000000009-deadbeef")  # a "leftover" link too
    result = runner.invoke(app, ["gc", str(ckpt), "--keep-last", "1", "--force"])
    assert result.exit_code == 0, result.output
    untouched(victim)  # crashsafe never makes a link: the "leftover" is not its own, so it stays
    names = [".lock", ".trash-step_000000000009-deadbeef", "step_000000000003"]
    assert sorted(p.name for p in ckpt.iterdir()) == names


def test_gc_delete_damaged_unlinks_a_symlinked_newest_step(tmp_path: Path, victim: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(ckpt, range(1, 3))
    os.symlink(victim, step_dir(ckpt, 7))
    result = runner.invoke(app, ["gc", str(ckpt), "--keep-last", "5", "--delete-damaged"])
    assert result.exit_code == 0, result.output
    untouched(victim)
    assert cs.CheckpointManager(ckpt, read_only=True).steps() == [1, 2]


def test_a_step_symlinked_to_another_runs_intact_step_is_damage(tmp_path: Path) -> None:
    """Even with matching checksums, a linked step is not read: restore falls back, export refuses."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _run(ours, range(1, 3))
    _run(theirs, range(1, 10))
    os.symlink(step_dir(theirs, 9), step_dir(ours, 9))
    reader = cs.CheckpointManager(ours, read_only=True)
    live = _state(0)
    with pytest.warns(cs.CorruptCheckpointWarning, match="symbolic link"):
        assert reader.restore(live) == 2
    assert live["step"] == 2 and np.all(live["w"] == 2.0)
    with pytest.raises(cs.CorruptCheckpointError, match="symbolic link") as info:
        reader.load(9)
    assert str(step_dir(theirs, 9)) not in str(info.value)  # the target is not revealed
    report = cs.verify(ours)
    assert report.intact == [1, 2] and [d.step for d in report.damaged] == [9]
    out = tmp_path / "out.safetensors"
    result = runner.invoke(app, ["export", str(ours), "--step", "9", "-o", str(out)])
    assert result.exit_code == 2 and "symbolic link" in result.output
    assert not out.exists()


@pytest.mark.parametrize("name", ["data.bin", "manifest.json"])
def test_a_file_symlinked_out_of_its_step_is_damage(tmp_path: Path, name: str) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _run(ours, range(1, 3))
    shutil.copytree(ours, theirs)
    (step_dir(ours, 2) / name).unlink()
    os.symlink(step_dir(theirs, 2) / name, step_dir(ours, 2) / name)  # same bytes, checksums match
    reader = cs.CheckpointManager(ours, read_only=True)
    with pytest.warns(cs.CorruptCheckpointWarning, match=f"{name} is a symbolic link"):
        assert reader.load()["step"] == 1
    assert [d.step for d in cs.verify(ours).damaged] == [2]


def test_a_symlinked_lock_file_is_refused_and_its_targetuntouched(tmp_path: Path, victim: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(ckpt, range(1, 2))  # a store (gc opens no writer where there is nothing to collect)
    (ckpt / ".lock").unlink()
    os.symlink(victim / "precious.txt", ckpt / ".lock")
    with pytest.raises(cs.StorageError, match="symbolic link"):
        cs.CheckpointManager(ckpt)
    untouched(victim)
    result = runner.invoke(app, ["gc", str(ckpt)])
    assert result.exit_code == 2 and "symbolic link" in result.output
    untouched(victim)


# ----------------------------------------------------------------------------- special files


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["manifest.json", "data.bin"])
def test_a_fifo_in_a_step_never_blocks(tmp_path: Path, name: str) -> None:
    ckpt = tmp_path / "ckpt"
    _run(ckpt, range(1, 3))
    (step_dir(ckpt, 2) / name).unlink()
    os.mkfifo(step_dir(ckpt, 2) / name)
    reader = cs.CheckpointManager(ckpt, read_only=True)
    live = _state(0)
    with pytest.warns(cs.CorruptCheckpointWarning, match="FIFO"):
        assert within(10, lambda: reader.restore(live)) == 1
    assert live["step"] == 1
    with pytest.raises(cs.CorruptCheckpointError, match="FIFO"):
        within(10, lambda: reader.load(2))
    report = within(10, lambda: cs.verify(ckpt))
    assert [d.step for d in report.damaged] == [2] and "FIFO" in (report.damaged[0].problem or "")
    result = within(10, lambda: runner.invoke(app, ["verify", str(ckpt)]))
    assert result.exit_code == 1


@pytest.mark.parametrize("name", ["manifest.json", "data.bin"])
def test_a_directory_where_a_file_belongs_is_damage(tmp_path: Path, name: str) -> None:
    ckpt = tmp_path / "ckpt"
    _run(ckpt, range(1, 3))
    (step_dir(ckpt, 2) / name).unlink()
    (step_dir(ckpt, 2) / name).mkdir()
    reader = cs.CheckpointManager(ckpt, read_only=True)
    with pytest.warns(cs.CorruptCheckpointWarning, match="directory"):
        assert reader.load()["step"] == 1


def test_a_file_where_a_step_directory_belongs_is_damage(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(ckpt, range(1, 3))
    step_dir(ckpt, 5).write_bytes(b"{}")
    with pytest.warns(cs.CorruptCheckpointWarning, match="not a directory"):
        assert cs.CheckpointManager(ckpt, read_only=True).load()["step"] == 2


# ----------------------------------------------------------------------------- the directory itself


@pytest.mark.parametrize("async_save", [True, False])
def test_a_directory_deleted_under_its_writer_stops_it(tmp_path: Path, async_save: bool) -> None:
    ckpt = tmp_path / "ckpt"
    mgr = cs.CheckpointManager(ckpt, async_save=async_save)
    mgr.save(1, _state(1))
    mgr.wait()
    shutil.rmtree(ckpt)
    with pytest.raises(cs.StorageError, match="deleted or replaced") as info:
        mgr.save(2, _state(2))
    assert "intact" not in str(info.value)  # the old message claimed the (deleted) steps were intact
    ckpt.mkdir()  # recreated: a second writer gets its own lock ...
    with cs.CheckpointManager(ckpt, keep_last=None, async_save=False) as second:
        second.save(10, _state(10))
        with pytest.raises(cs.StorageError, match="deleted or replaced"):
            mgr.save(3, _state(3))  # ... and the first one never writes into the new directory
        assert second.steps() == [10]
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "step_000000000010"]
    mgr.close()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_writer_opened_by_a_relative_path_survives_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """The writer's check that its directory is still there looked its relative path up again from
    the new working directory: after an ``os.chdir`` (a launcher, a notebook, a library that changes
    directory) every save failed with "the checkpoint directory was deleted or replaced ... the
    steps it held are gone", while the directory and its steps were intact."""
    monkeypatch.chdir(tmp_path)
    mgr = cs.CheckpointManager("ckpt", keep_last=None, async_save=async_save)
    mgr.save(1, _state(1))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    mgr.save(2, _state(2))
    mgr.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == [
        "step_000000000001",
        "step_000000000002",
    ]
    assert not (elsewhere / "ckpt").exists()


def test_a_writer_after_a_chdir_judges_its_own_steps_for_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving a committed step again and ``gc(delete_damaged=True)`` verify the writer's steps, and
    verified them by the relative path it was opened with: after an ``os.chdir`` into a folder with
    another run's ``ckpt`` an intact step 1 was judged by the other run's (missing there), deleted
    as "damaged" and overwritten, and gc deleted the steps damaged in the other run's folder."""
    monkeypatch.chdir(tmp_path)
    mgr = cs.CheckpointManager("ckpt", keep_last=None, async_save=False)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    other = tmp_path / "other"
    _run(other / "ckpt", range(2, 4))
    data = step_dir(other / "ckpt", 2) / "data.bin"
    data.write_bytes(b"\0" * data.stat().st_size)  # the other run's step 2 is damaged
    monkeypatch.chdir(other)
    with pytest.raises(cs.CheckpointExistsError, match="never overwritten"):
        mgr.save(1, _state(100))
    assert mgr.gc(delete_damaged=True) == []
    mgr.close()
    reader = cs.CheckpointManager(tmp_path / "ckpt", read_only=True)
    assert reader.steps() == [1, 2, 3] and reader.load(1)["step"] == 1
    assert cs.verify(tmp_path / "ckpt").ok


def test_a_reader_follows_a_replaced_directory(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(ckpt, range(1, 3))
    reader = cs.CheckpointManager(ckpt, read_only=True)
    assert reader.steps() == [1, 2]
    shutil.rmtree(ckpt)
    _run(ckpt, range(5, 7))
    assert reader.steps() == [5, 6] and reader.load()["step"] == 6


def test_a_save_checks_its_step_by_name_as_the_listing_would(tmp_path: Path, victim: Path) -> None:
    """A save asks the store about its own step only (not a listing, off the training thread):
    the answer agrees with ``steps()`` for committed steps, torn drafts, trash, a symlinked step,
    a file where a step belongs and names that only look like steps."""
    from crashsafe.storage.local import LocalStore
    from crashsafe.storage.writer import StepWriter

    with cs.CheckpointManager(tmp_path, async_save=False, keep_last=None) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"x": np.full(8, step)})
        mgr.delete([2])
    os.symlink(victim, step_dir(tmp_path, 5))
    step_dir(tmp_path, 6).write_bytes(b"not a step")
    (tmp_path / "step_7").mkdir()  # not the canonical name of step 7
    store = LocalStore(tmp_path)
    torn = StepWriter(store, 4)
    torn.write_payload(np.ones(16).data)
    assert store.steps() == [1, 3, 5, 6]
    assert [s for s in range(9) if store.has_step(s)] == store.steps()
    torn.abort()
    with cs.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(cs.CheckpointExistsError, match="never overwritten"):
            mgr.save(3, {"x": np.zeros(8)})
        mgr.save(4, {"x": np.full(8, 4)})  # the torn draft was not a step
        assert mgr.load(4)["x"][0] == 4


# ----------------------------------------------------------------------------- empty locations, leftovers


@pytest.mark.parametrize("location", ["", "file://", "file:///", "/", "//", "s3://", "memory://"])
def test_an_empty_or_root_location_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, location: str
) -> None:
    """``gc ""`` (and ``gc file://``) cleaned the current directory: it deleted a ``.tmp-notes/``
    folder of the user's, and ``verify file://`` called it a store of intact steps."""
    here = tmp_path / "cwd"
    _run(here, range(1, 3))
    (here / ".lock").unlink()
    (here / ".tmp-notes").mkdir()
    (here / ".tmp-notes" / "todo.txt").write_text("buy milk")
    before = sorted(str(p.relative_to(here)) for p in here.rglob("*"))
    monkeypatch.chdir(here)
    for args in (["gc", location, "--keep-last", "1", "--force"], ["verify", location], ["ls", location]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "names no checkpoint directory" in result.output or "root of the file system" in result.output
        assert "error:" in result.output and "Traceback" not in result.output
    with pytest.raises(cs.InvalidArgumentError, match="Give the run's own directory"):
        cs.CheckpointManager(location)
    with pytest.raises(cs.InvalidArgumentError):
        cs.CheckpointManager(location, read_only=True)
    with pytest.raises(cs.InvalidArgumentError):
        cs.CheckpointManager(tmp_path / "ckpt", mirror=location)
    assert sorted(str(p.relative_to(here)) for p in here.rglob("*")) == before
    assert (here / ".tmp-notes" / "todo.txt").read_text() == "buy milk"


def test_only_leftovers_with_crashsafes_marker_are_removed(tmp_path: Path, victim: Path) -> None:
    """What a writer cleans must carry crashsafe's marker: its exact leftover name and nothing inside
    but a step's regular files. Leftovers of earlier versions have that shape, and go; a folder of
    someone else's that merely starts with ``.tmp-`` or ``.trash-`` stays, whatever it holds."""
    ckpt = tmp_path / "ckpt"
    _run(ckpt, range(1, 3))
    ours = {  # as crashsafe (this version and earlier ones) leaves them after a kill
        ".tmp-step_000000000003-4242-0badf00d": {"data.bin": b"half"},
        ".tmp-step_000000000003-0123456789abcdef": {"data-r0.bin": b"x", "data-r1.bin": b"y"},
        ".tmp-step_000000000004-77-deadbeef": {},
        ".trash-step_000000000000-feedf00d": {"manifest.json": b"{}"},
    }
    theirs = {
        ".tmp-notes": {"todo.txt": b"buy milk"},
        ".tmp-step_000000000005-1-abcd0123": {"data.bin": b"x", "notes.txt": b"mine"},
        ".trash-step_000000000006-cafe": {"data.bin": b"x", "keep": None},  # None: a folder
        ".tmp-step_7-1-abcd0123": {"data.bin": b"x"},  # not a step's canonical name
        ".trash-step_000000000008-beef-old": {"data.bin": b"x"},
    }
    for name, files in {**ours, **theirs}.items():
        (ckpt / name).mkdir()
        for file, data in files.items():
            (ckpt / name / file).mkdir() if data is None else (ckpt / name / file).write_bytes(data)
    os.symlink(victim, ckpt / ".tmp-step_000000000009-1-abcd0123")  # a link: never crashsafe's
    (ckpt / ".trash-step_000000000010-abcd").write_bytes(b"a file, not a folder")
    foreign = sorted([*theirs, ".tmp-step_000000000009-1-abcd0123", ".trash-step_000000000010-abcd"])
    with contextlib.closing(open_store(ckpt)) as store:
        assert store.leftovers() == sorted(ours)
    assert cs.verify(ckpt).leftovers == sorted(ours)
    cs.CheckpointManager(ckpt).close()  # a writer opening removes leftovers
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".") and p.name != ".lock") == foreign
    assert (ckpt / ".tmp-notes" / "todo.txt").read_bytes() == b"buy milk"
    assert (ckpt / ".tmp-step_000000000005-1-abcd0123" / "notes.txt").read_bytes() == b"mine"
    untouched(victim)
    result = runner.invoke(app, ["gc", str(ckpt), "--keep-last", "5"])
    assert result.exit_code == 0 and "0 leftovers" in result.output, result.output
    assert cs.CheckpointManager(ckpt, read_only=True).steps() == [1, 2]
