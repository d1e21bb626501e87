"""Damaged and foreign files, made by really flipping bytes: the shelf refuses them with a clear
error, never "repairs" them into garbage, and falls back only to a state it can prove intact."""

from __future__ import annotations

import dataclasses
import os
import signal
import struct
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crashsafe as cs
from crashsafe.shelf import CorruptShelfError, NotAShelfError, Shelf, ShelfRecoveredWarning
from crashsafe.shelf.layout import PAGE, RECORD_BYTES, Record, Superblock, encode_meta_slot

Run = Callable[..., subprocess.CompletedProcess[str]]
Flip = Callable[[Path, int], None]


def superblock(path: Path) -> Superblock:
    with open(path, "rb") as f:
        return Superblock.unpack(f.read(PAGE), path)


def slot_seq(path: Path, index: int) -> int:
    sb = superblock(path)
    with open(path, "rb") as f:
        f.seek(sb.slot(index) + 8)
        return int(struct.unpack("<Q", f.read(8))[0])


def newest_slot(path: Path) -> int:
    return 0 if slot_seq(path, 0) > slot_seq(path, 1) else 1


@pytest.mark.parametrize("content", [b"", b"x" * 10, os.urandom(PAGE * 4), b"\x00" * (PAGE * 4)])
def test_foreign_files_are_refused_and_left_untouched(shm_dir: Path, content: bytes) -> None:
    path = shm_dir / "foreign"
    path.write_bytes(content)
    with pytest.raises(NotAShelfError, match="not a crashsafe shelf") as info:
        Shelf(path, size="1MiB")
    assert isinstance(info.value, cs.errors.CrashsafeError)
    assert path.read_bytes() == content


def test_damaged_superblock_and_newer_format(shm_dir: Path, flip: Flip) -> None:
    path = shm_dir / "s"
    Shelf(path, size="1MiB").close()
    flip(path, 40)
    with pytest.raises(CorruptShelfError, match="superblock fails its checksum"):
        Shelf(path)
    flip(path, 40)
    with open(path, "r+b") as f:  # a correctly checksummed superblock of format 99
        f.write(dataclasses.replace(superblock(path), version=99).pack())
    with pytest.raises(NotAShelfError, match="newer than this crashsafe"):
        Shelf(path)


def test_flipped_data_byte_names_the_variable(any_dir: Path, flip: Flip) -> None:
    path = any_dir / "s"
    with Shelf(path, size="1MiB") as shelf:
        shelf["good"] = np.arange(100.0)
        shelf["bad"] = np.arange(100.0)
        offset = shelf.info("bad").offset
    flip(path, offset + 17)
    with pytest.raises(CorruptShelfError, match="'bad'") as info:
        Shelf(path)
    assert "'good'" not in str(info.value)
    with Shelf(path, verify=False) as shelf:  # opt-out opens it, for salvage
        assert np.array_equal(shelf["good"], np.arange(100.0))
        with pytest.raises(CorruptShelfError):
            shelf.verify()


def test_damaged_spare_metadata_slot_is_harmless(shm_dir: Path, flip: Flip) -> None:
    path = shm_dir / "s"
    with Shelf(path, size="1MiB") as shelf:
        shelf["x"] = np.ones(3)
        shelf["x"] = np.full(3, 2.0)
    spare = 1 - newest_slot(path)
    flip(path, superblock(path).slot(spare) + 40)
    with Shelf(path) as shelf:
        assert np.all(shelf["x"] == 2.0)
        shelf["x"] = np.full(3, 3.0)  # the next commit rewrites the damaged copy
    with Shelf(path) as shelf:
        assert np.all(shelf["x"] == 3.0)


def test_damaged_newest_slot_falls_back_only_to_a_provably_intact_state(shm_dir: Path, flip: Flip) -> None:
    # a metadata-only change: the previous commit's data is all there
    path = shm_dir / "s"
    with Shelf(path, size="1MiB") as shelf:
        shelf["x"] = np.ones(3)
        shelf["n"] = 1
        shelf["n"] = 2
    flip(path, superblock(path).slot(newest_slot(path)) + 40)
    with pytest.warns(ShelfRecoveredWarning, match="did not commit"), Shelf(path) as shelf:
        assert shelf["n"] == 1 and np.all(shelf["x"] == 1.0)

    # an in-place change: its undo copies bring the previous commit's bytes back
    path2 = shm_dir / "s2"
    with Shelf(path2, size="1MiB", tx_mode="undo") as shelf:
        shelf["x"] = np.ones(3)
        with shelf.transaction("x"):
            shelf["x"][:] = 5.0
    flip(path2, superblock(path2).slot(newest_slot(path2)) + 40)
    with pytest.warns(ShelfRecoveredWarning), Shelf(path2) as shelf:
        assert np.all(shelf["x"] == 1.0)
        assert shelf.recovered is not None and shelf.recovered.restored == ("x",)

    # the same, with the undo records gone too: the older metadata's data cannot be proven
    path3 = shm_dir / "s3"
    with Shelf(path3, size="1MiB", tx_mode="undo") as shelf:
        shelf["x"] = np.ones(3)
        with shelf.transaction("x"):
            shelf["x"][:] = 5.0
    sb = superblock(path3)
    flip(path3, sb.slot(newest_slot(path3)) + 40)
    flip(path3, sb.record_off + 20)
    with pytest.raises(CorruptShelfError, match="'x'"):
        Shelf(path3)


def test_both_metadata_slots_damaged(shm_dir: Path, flip: Flip) -> None:
    path = shm_dir / "s"
    with Shelf(path, size="1MiB") as shelf:
        shelf["x"] = 1
    sb = superblock(path)
    flip(path, sb.slot(0) + 40)
    flip(path, sb.slot(1) + 40)
    with pytest.raises(CorruptShelfError, match="both copies"):
        Shelf(path)


def test_forged_metadata_with_a_valid_checksum_is_refused(shm_dir: Path) -> None:
    path = shm_dir / "s"
    with Shelf(path, size="1MiB") as shelf:
        shelf["a"] = np.zeros(10)
        seq, offset = shelf.seq, shelf.info("a").offset
    sb = superblock(path)
    forged = (b'{"format":1,"size":1048576,"tx":{},"rollback":null,"vars":{'
              b'"a":["array",1,"float64",[10],' + str(offset).encode() + b',80,"0000000000000000"],'
              b'"b":["array",1,"float64",[10],' + str(offset + 8).encode() + b',80,"0000000000000000"]}}')
    with open(path, "r+b") as f:
        f.seek(sb.slot((seq + 1) % 2))
        f.write(encode_meta_slot(seq + 1, forged))
    with pytest.raises(CorruptShelfError, match="overlaps"):
        Shelf(path)


def test_truncated_file(shm_dir: Path) -> None:
    path = shm_dir / "s"
    Shelf(path, size="1MiB").close()
    os.truncate(path, 512 * 1024)
    with pytest.raises(CorruptShelfError, match="truncated"):
        Shelf(path)


@pytest.mark.timeout(120)
def test_damaged_undo_copy_is_refused_not_half_restored(shm_dir: Path, run_script: Run,
                                                        states: Any, flip: Flip) -> None:
    path = shm_dir / "s"
    states.make_a(path, "undo")
    result = run_script("shelf_change.py", path, "undo", "process", CRASHSAFE_KILL_AT="shelf_before_meta")
    assert result.returncode == -signal.SIGKILL, result.stderr
    sb = superblock(path)
    with open(path, "rb") as f:
        f.seek(sb.record_off + RECORD_BYTES)
        record = Record.unpack(f.read(RECORD_BYTES))
    assert record is not None and record.kind == Record.UNDO
    flip(path, record.saved + 5)  # the saved copy of the torn variable
    before = path.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShelfRecoveredWarning)
        with pytest.raises(CorruptShelfError, match="undo copy is damaged"):
            Shelf(path)
    assert path.read_bytes() == before  # nothing was "repaired"
