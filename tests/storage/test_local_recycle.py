"""A local store that recycles (the memory tier's, storage/local.py): the step it deleted last is
kept out of view, and the next step is written over its data file, cut to its own size; only one
such spare is kept; a spare that is not crashsafe's file alone (a hard link to a file elsewhere, a
link, a FIFO) is never written, and what it leads to is never touched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests.hostile import make_victim, untouched, within

from crashsafe.storage.layout import TRASH_PREFIX, committed_steps, step_dir
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
