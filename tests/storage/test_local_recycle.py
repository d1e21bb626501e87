"""A local store that recycles (the memory tier's, storage/local.py): the step it deleted last is
kept out of view, and the next step is written over its data file, cut to its own size; only one
such spare is kept; a spare that is not crashsafe's file alone (a hard link to a file elsewhere, a
link, a FIFO) is never written, and what it leads to is never touched."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.hostile import make_victim, stop, untouched, within

from crashsafe.storage.layout import TRASH_PREFIX, committed_steps, step_dir, step_name
from crashsafe.storage.local import DATA_NAME, LocalStore


def _commit(store: LocalStore, step: int, data: bytes) -> None:
    draft = store.begin(step)
    draft.write(data)
    draft.commit(b'{"a": "manifest"}')


def _spares(where: Path) -> list[Path]:
    return [p for p in where.iterdir() if p.name.startswith(TRASH_PREFIX)]


def test_the_next_step_is_written_over_the_step_deleted_last_and_cut_to_its_size(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, create=True, recycle=True)
    first, second, third = os.urandom(3 << 20), os.urandom(2 << 20), os.urandom(1 << 20)
    _commit(store, 1, first)
    _commit(store, 2, second)
    store.delete(1)
    assert committed_steps(tmp_path) == [2]
    (spare,) = _spares(tmp_path)
    inode = (spare / DATA_NAME).stat().st_ino
    _commit(store, 3, third)
    data = step_dir(tmp_path, 3) / DATA_NAME
    assert data.stat().st_ino == inode  # the spare's file, written over
    assert data.read_bytes() == third  # and cut to this step's bytes
    assert _spares(tmp_path) == []  # taken: the spare's rest is gone
    assert (step_dir(tmp_path, 2) / DATA_NAME).read_bytes() == second
    store.delete(2)
    store.delete(3)  # one spare at most: the second deletion removes its step
    assert len(_spares(tmp_path)) == 1
    bigger = os.urandom(5 << 20)
    _commit(store, 4, bigger)  # longer than the spare
    assert (step_dir(tmp_path, 4) / DATA_NAME).read_bytes() == bigger
    store.close()


def test_a_store_that_does_not_recycle_keeps_no_spare(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, create=True)
    _commit(store, 1, b"x" * 100)
    store.delete(1)
    assert _spares(tmp_path) == []
    store.close()


@pytest.mark.parametrize("kind", ["hard link", "symlink", "fifo"])
def test_a_spare_that_is_not_crashsafes_alone_is_never_written(tmp_path: Path, kind: str) -> None:
    victim = make_victim(tmp_path / "victim")
    where = tmp_path / "store"
    store = LocalStore(where, create=True, recycle=True)
    _commit(store, 1, b"one" * 1000)
    store.delete(1)
    (spare,) = _spares(where)
    (spare / DATA_NAME).unlink()
    if kind == "hard link":
        os.link(victim / "data.bin", spare / DATA_NAME)
    elif kind == "symlink":
        (spare / DATA_NAME).symlink_to(victim / "data.bin")
    else:
        os.mkfifo(spare / DATA_NAME)
    within(10, lambda: _commit(store, 2, b"two" * 1000))
    assert (step_dir(where, 2) / DATA_NAME).read_bytes() == b"two" * 1000
    assert (step_dir(where, 2) / DATA_NAME).stat().st_nlink == 1
    untouched(victim)
    store.remove_leftovers(store.leftovers())  # the refused spare goes as any leftover
    untouched(victim)
    store.close()


def _inode(where: Path, step: int) -> int:
    return (step_dir(where, step) / DATA_NAME).stat().st_ino


def test_a_deleted_step_a_mapping_still_holds_is_never_written_over(tmp_path: Path) -> None:
    """A mapping of a step's data file (``load(mmap=True)``'s views) made before retention deleted
    the step keeps the bytes committed: the next step gets a new file, and the refused spare goes at
    once, so the step deleted next is kept and written over again."""
    store = LocalStore(tmp_path, create=True, recycle=True)
    first = os.urandom(1 << 20)
    _commit(store, 1, first)
    _commit(store, 2, os.urandom(1 << 20))
    with open(step_dir(tmp_path, 1) / DATA_NAME, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # (outlives the descriptor)
    held = _inode(tmp_path, 1)
    store.delete(1)
    _commit(store, 3, os.urandom(1 << 20))  # as large: a file written over would not fail, only change
    assert region[:] == first
    assert _inode(tmp_path, 3) != held and _spares(tmp_path) == []
    region.close()
    taken = _inode(tmp_path, 2)
    store.delete(2)
    _commit(store, 4, b"four" * 1000)
    assert _inode(tmp_path, 4) == taken  # recycling goes on once nothing holds the spare
    store.close()


def test_a_deleted_step_another_process_holds_open_is_never_written_over(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, create=True, recycle=True)
    first = os.urandom(1 << 20)
    _commit(store, 1, first)
    _commit(store, 2, b"two" * 1000)
    reader = subprocess.Popen(  # opens the step's data file, says so, then reads it when told to
        [sys.executable, "-c", "import sys; f = open(sys.argv[1], 'rb'); print('open', flush=True); "
         "sys.stdin.readline(); sys.stdout.buffer.write(f.read())", str(step_dir(tmp_path, 1) / DATA_NAME)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert reader.stdout is not None and reader.stdout.readline() == b"open\n"
        store.delete(1)
        _commit(store, 3, os.urandom(1 << 20))
        out, _ = reader.communicate(b"read\n", timeout=30)
        assert out == first
    finally:
        stop(reader)
    store.close()


@pytest.mark.parametrize("kind", ["link", "foreign file"])
def test_a_deleted_step_that_is_not_crashsafes_alone_is_removed_never_kept(tmp_path: Path, kind: str) -> None:
    """A ``step_*`` that is a link, or a step holding a file crashsafe never writes, is removed by
    its deletion as in a store that does not recycle (never left out of view: it would never be
    cleaned, nor taken as the spare); the link's target is never touched."""
    victim = make_victim(tmp_path / "victim")
    where = tmp_path / "store"
    store = LocalStore(where, create=True, recycle=True)
    if kind == "link":
        (where / step_name(5)).symlink_to(victim, target_is_directory=True)
    else:
        _commit(store, 5, b"five" * 1000)
        (step_dir(where, 5) / "notes.txt").write_bytes(b"someone's")
    store.delete(5)
    assert sorted(p.name for p in where.iterdir()) == []
    untouched(victim)
    _commit(store, 6, b"six" * 1000)
    store.delete(6)  # the next step deleted is the spare
    assert len(_spares(where)) == 1
    store.close()


def test_a_refused_spare_is_removed_at_once_and_the_next_deleted_step_is_kept(tmp_path: Path) -> None:
    victim = make_victim(tmp_path / "victim")
    store = LocalStore(tmp_path / "store", create=True, recycle=True)
    where = tmp_path / "store"
    _commit(store, 1, b"one" * 1000)
    _commit(store, 2, b"two" * 1000)
    store.delete(1)
    (spare,) = _spares(where)
    (spare / DATA_NAME).unlink()
    os.link(victim / "data.bin", spare / DATA_NAME)  # a hard link to a file elsewhere: refused
    _commit(store, 3, b"three" * 1000)
    assert _spares(where) == []  # its name removed, never its file
    untouched(victim)
    taken = _inode(where, 2)
    store.delete(2)
    _commit(store, 4, b"four" * 1000)
    assert _inode(where, 4) == taken
    untouched(victim)
    store.close()


@pytest.mark.parametrize("kind", ["a link", "a directory as its data file", "someone's file in it"])
def test_a_spare_that_is_not_crashsafes_is_never_taken_nor_removed(tmp_path: Path, kind: str) -> None:
    """A ``.trash-`` entry that is not crashsafe's (layout.py: a link, a folder holding anything but
    a step's regular files) is neither written over nor removed, and what it leads to is untouched."""
    victim = make_victim(tmp_path / "victim")
    where = tmp_path / "store"
    store = LocalStore(where, create=True, recycle=True)
    _commit(store, 1, b"one" * 1000)
    store.delete(1)
    (spare,) = _spares(where)
    if kind == "a link":
        shutil.rmtree(spare)
        spare.symlink_to(victim, target_is_directory=True)
    elif kind == "a directory as its data file":
        (spare / DATA_NAME).unlink()
        (spare / DATA_NAME).mkdir()
    else:
        (spare / "precious.txt").write_bytes(b"someone's")
    within(10, lambda: _commit(store, 2, b"two" * 1000))
    assert (step_dir(where, 2) / DATA_NAME).read_bytes() == b"two" * 1000
    store.remove_leftovers(store.leftovers())
    assert _spares(where) == [spare]
    untouched(victim)
    store.close()


def test_a_store_that_does_not_recycle_never_writes_a_spare_and_its_writer_removes_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, create=True, recycle=True)
    one = os.urandom(1 << 16)
    _commit(store, 1, one)
    _commit(store, 2, b"two" * 1000)
    store.delete(1)
    store.close()
    (spare,) = _spares(tmp_path)
    plain = LocalStore(tmp_path)
    _commit(plain, 3, b"three" * 1000)
    assert (spare / DATA_NAME).read_bytes() == one
    plain.remove_leftovers(plain.leftovers())  # as a writer does when it opens the store
    assert _spares(tmp_path) == []
    assert committed_steps(tmp_path) == [2, 3]
    plain.close()
