"""The shelf's mapping API: values of every supported type survive reopening, transactions are
all-or-nothing in-process, views are guarded, space is reused, and bad input is refused clearly."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crashsafe as cs
from crashsafe.errors import UnsupportedStateError
from crashsafe.shelf import Shelf, ShelfError, ShelfFullError
from crashsafe.shelf.errors import NotAShelfError
from crashsafe.shelf.inspect import inspect_shelf
from crashsafe.shelf.meta import NUMERIC_DTYPES

from ..hostile import within

MODES = ["undo", "shadow"]


@pytest.mark.parametrize("mode", MODES)
def test_every_value_type_round_trips_through_reopen(any_dir: Path, mode: str) -> None:
    path = any_dir / "s.shelf"
    rng = np.random.default_rng(0)
    arrays = {f"a_{name}": (rng.standard_normal((3, 5)) * 100).astype(dt)
              for name, dt in NUMERIC_DTYPES.items()}
    scalars = {"t": True, "f": False, "i": -(1 << 70), "x": 0.1, "nan": math.nan, "inf": -math.inf,
               "c": complex(1.5, -2.0), "none": None}
    others = {"s": "héllo ✓", "empty_s": "", "b": b"\x00\xff" * 100, "empty_b": b"",
              "zero_d": np.float32(3.5), "empty_a": np.zeros((0, 4), np.int16),
              "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
              "strided": np.arange(20.0)[::3]}
    with Shelf(path, size="4MiB", tx_mode=mode) as shelf, shelf.transaction():
        for name, value in {**arrays, **scalars, **others}.items():
            shelf[name] = value
    with Shelf(path) as shelf:
        assert shelf.recovered is None
        for name, value in arrays.items():
            got = shelf[name]
            assert got.dtype == value.dtype and got.shape == value.shape
            assert got.tobytes() == value.tobytes()
        for name, value in scalars.items():
            got = shelf[name]
            assert type(got) is type(value)
            assert got == value or (got != got and value != value)
        assert shelf["s"] == "héllo ✓" and shelf["empty_s"] == ""
        assert shelf["b"] == b"\x00\xff" * 100 and shelf["empty_b"] == b""
        assert shelf["zero_d"].shape == () and shelf["zero_d"].dtype == np.float32 and shelf["zero_d"] == 3.5
        assert shelf["empty_a"].shape == (0, 4)
        assert shelf["big_endian"].dtype == np.dtype("<i4")
        assert np.array_equal(shelf["big_endian"], np.arange(6).reshape(2, 3))
        assert np.array_equal(shelf["strided"], np.arange(20.0)[::3])
        assert sorted(shelf) == sorted({**arrays, **scalars, **others})
        assert len(shelf) == len(arrays) + len(scalars) + len(others)


def test_views_are_arena_backed_and_read_only_outside_transactions(shm_dir: Path) -> None:
    with Shelf(shm_dir / "s", size="1MiB") as shelf:
        shelf["centers"] = np.zeros((4, 3))
        centers = shelf["centers"]
        assert shelf["centers"] is centers  # one live view per variable
        with pytest.raises(ValueError, match="read-only"):
            centers[0, 0] = 1.0
        with shelf.transaction():  # the example: a view taken before the transaction
            centers[:] = 7.0
            shelf["iteration"] = 3
        assert not centers.flags.writeable
    with Shelf(shm_dir / "s") as shelf:
        assert np.all(shelf["centers"] == 7.0) and shelf["iteration"] == 3
        assert shelf.info("centers").version == 2  # created, then changed in place


@pytest.mark.parametrize("mode", MODES)
def test_exception_rolls_back_every_kind_of_change(shm_dir: Path, mode: str) -> None:
    path = shm_dir / "s"
    with Shelf(path, size="1MiB", tx_mode=mode) as shelf:
        shelf.update({"a": np.arange(10.0), "b": np.ones((2, 2), np.int32), "n": 1, "s": "old"})
        a = shelf["a"]
        before = {name: shelf.info(name) for name in shelf}
        used = shelf.used
        with pytest.raises(RuntimeError, match="boom"), shelf.transaction():
            a *= 2  # in place through a view
            shelf["b"] = np.full((2, 2), 9, np.int32)  # same shape: undo log or shadow copy
            shelf["n"] = 2
            shelf["s"] = "new"
            shelf["new"] = np.zeros(1000)
            del shelf["n"]
            shelf.resize("a", 20)
            raise RuntimeError("boom")
        assert np.array_equal(shelf["a"], np.arange(10.0))
        assert np.array_equal(a, np.arange(10.0))
        assert np.array_equal(shelf["b"], np.ones((2, 2)))
        assert shelf["n"] == 1 and shelf["s"] == "old" and "new" not in shelf
        assert {name: shelf.info(name) for name in shelf} == before
        assert shelf.used == used  # blocks of the aborted transaction are free again
    with Shelf(path) as shelf:
        assert shelf.recovered is None  # rolled back in-process, nothing left to recover
        assert np.array_equal(shelf["a"], np.arange(10.0)) and shelf["n"] == 1


def test_commit_bumps_versions_only_of_changed_content(shm_dir: Path) -> None:
    with Shelf(shm_dir / "s", size="1MiB") as shelf:
        shelf.update({"x": np.zeros(3), "y": np.zeros(3), "k": 5})
        with shelf.transaction():
            shelf["x"] = np.ones(3)
            shelf["y"] = np.zeros(3)  # same content
            shelf["k"] = 5
            del shelf["k"]
            shelf["k2"] = "v"
        assert shelf.info("x").version == 2 and shelf.info("y").version == 1
        last = shelf.last_transaction
        assert last["changed"] == ["k2", "x"] and last["deleted"] == ["k"]
        assert last["seq"] == shelf.seq


def test_scoped_transaction_keeps_other_views_read_only(shm_dir: Path) -> None:
    with Shelf(shm_dir / "s", size="1MiB") as shelf:
        shelf.update({"data": np.arange(100.0), "centers": np.zeros(4)})
        data, centers = shelf["data"], shelf["centers"]
        with shelf.transaction("centers"):
            centers[:] = data[:4]
            with pytest.raises(ValueError, match="read-only"):
                data[0] = -1
            assert not shelf["data"].flags.writeable  # fetched inside: still not covered
        assert np.array_equal(centers, np.arange(4.0))
        used = shelf.used
        with shelf.transaction([]):  # no in-place writes: nothing is copied to the undo log
            assert shelf.used == used and not centers.flags.writeable
            shelf["centers"] = np.ones(4)
        assert np.array_equal(shelf["centers"], np.ones(4))
        with pytest.raises(ShelfError, match="no array named 'nope'"), shelf.transaction("nope"):
            pass
        with pytest.raises(ShelfError, match="do not nest"), shelf.transaction(), shelf.transaction():
            pass


def test_in_place_write_through_a_view_fetched_inside_an_unscoped_transaction(shm_dir: Path) -> None:
    path = shm_dir / "s"
    with Shelf(path, size="1MiB") as shelf:
        shelf["w"] = np.zeros(8)
        with pytest.raises(KeyError), shelf.transaction():
            shelf["w"][:] = 5  # fetched inside: saved to the undo log first
            shelf["missing"]
        assert np.all(shelf["w"] == 0)
        with shelf.transaction():
            shelf["w"][2:] = 1
        assert shelf["w"].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("mode", MODES)
def test_empty_computes_state_in_place_without_a_copy(shm_dir: Path, mode: str) -> None:
    path = shm_dir / "s"
    a = np.arange(12.0).reshape(3, 4)
    with Shelf(path, size="1MiB", tx_mode=mode) as shelf:
        shelf["c"] = np.zeros((3, 3))
        old = shelf["c"]
        with pytest.raises(ShelfError, match="inside a transaction"):
            shelf.empty("c", (3, 3))
        with shelf.transaction():
            out = shelf.empty("c", (3, 3))
            np.dot(a[:, :3], a[:, :3].T, out=out)
            assert np.all(old == 0)  # the committed value stays readable until the commit
            used = shelf.used
            shelf.update({"c": out, "n": 1})  # already in place: nothing is copied
            assert shelf.used == used and shelf["c"] is out
        assert np.array_equal(shelf["c"], a[:, :3] @ a[:, :3].T) and not out.flags.writeable
        with pytest.raises(RuntimeError), shelf.transaction():
            shelf.empty("c", (2, 2))[:] = 5
            shelf.empty("new", 4, np.int32)[:] = 1
            raise RuntimeError
        assert shelf["c"].shape == (3, 3) and "new" not in shelf
    with Shelf(path) as shelf:
        assert np.array_equal(shelf["c"], a[:, :3] @ a[:, :3].T) and shelf["n"] == 1


def test_resize_replace_delete_and_space_reuse(shm_dir: Path) -> None:
    with Shelf(shm_dir / "s", size="1MiB", tx_mode="shadow") as shelf:
        shelf["v"] = np.arange(6, dtype=np.int64)
        shelf.resize("v", (3, 3))
        assert shelf["v"].tolist() == [[0, 1, 2], [3, 4, 5], [0, 0, 0]]
        shelf.resize("v", 2)
        assert shelf["v"].tolist() == [0, 1]
        shelf["v"] = "now a string"
        assert shelf["v"] == "now a string"
        with pytest.raises(ShelfError, match="resize works on arrays"):
            shelf.resize("v", 3)
        del shelf["v"]
        assert "v" not in shelf and shelf.used == 0
        with pytest.raises(KeyError):
            del shelf["v"]
        for i in range(200):  # replacing 100 KiB over and over must reuse freed blocks
            shelf["big"] = np.full(100_000 // 8, i, np.float64)
        assert shelf.used < 2 * 100_096


def test_old_view_keeps_its_block_until_dropped(shm_dir: Path) -> None:
    with Shelf(shm_dir / "s", size="1MiB", tx_mode="shadow") as shelf:
        shelf["x"] = np.full(1000, 1.0)
        old = shelf["x"]
        shelf["x"] = np.full(1000, 2.0)  # a shadow copy: `old` still shows the old value
        for i in range(20):
            shelf[f"filler{i}"] = np.full(1000, -1.0)  # must not land on `old`'s block
        assert np.all(old == 1.0) and np.all(shelf["x"] == 2.0)
        used = shelf.used
        del old
        shelf["more"] = np.zeros(1000)  # the pinned block is reused now
        assert shelf.used == used


@pytest.mark.parametrize("mode", MODES)
def test_full_arena_is_a_clear_error_and_data_stays_intact(shm_dir: Path, mode: str) -> None:
    path = shm_dir / "s"
    with Shelf(path, size="1MiB", tx_mode=mode) as shelf:
        free = shelf.data_bytes
        shelf["keep"] = np.arange(1000.0)
        with pytest.raises(ShelfFullError, match="is full") as info:
            shelf["huge"] = np.zeros(free // 8)
        assert isinstance(info.value, cs.errors.CrashsafeError) and "larger size=" in str(info.value)
        big = np.zeros((free // 3) // 8)
        with pytest.raises(ShelfFullError), shelf.transaction():
            shelf["keep"] = np.full(1000, -1.0)
            shelf["b1"] = big
            shelf["b2"] = big
            shelf["b3"] = big
        assert np.array_equal(shelf["keep"], np.arange(1000.0)) and list(shelf) == ["keep"]
    with Shelf(path, size="4MiB") as shelf:  # growing on reopen
        assert shelf.size == 4 * 2**20
        shelf["huge"] = np.zeros(free // 8)
        assert np.array_equal(shelf["keep"], np.arange(1000.0))


def test_too_many_variables_for_the_metadata_slot(shm_dir: Path) -> None:
    shelf = Shelf(shm_dir / "s", size="1MiB")
    with shelf, pytest.raises(ShelfFullError, match="metadata"), shelf.transaction():
        for i in range(5000):
            shelf[f"variable_with_a_long_name_{i:05d}"] = i
    with Shelf(shm_dir / "s") as shelf:
        assert len(shelf) == 0


def test_a_slot_filled_one_variable_at_a_time_stays_usable(shm_dir: Path) -> None:
    """Each assignment its own transaction, until the metadata no longer fits: that one is refused
    and rolled back, and the shelf keeps every variable before it, open and reopened. The rollback's
    note made the metadata larger still, so the rollback failed: the shelf was unusable, and every
    later open failed the same way."""
    shelf = Shelf(shm_dir / "s", size="1MiB")
    count = 0
    with shelf, pytest.raises(ShelfFullError, match="metadata"):
        while True:
            shelf[f"v{count}"] = count
            count += 1
    assert count > 1000
    with Shelf(shm_dir / "s") as again:
        assert len(again) == count and again[f"v{count - 1}"] == count - 1
        again[f"v{count - 1}"] = -1  # and it takes a change that fits
    with Shelf(shm_dir / "s") as again:
        assert again[f"v{count - 1}"] == -1


def test_bad_values_and_names_are_refused(shm_dir: Path) -> None:
    with Shelf(shm_dir / "s", size="1MiB") as shelf:
        with pytest.raises(UnsupportedStateError, match="cannot store a list"):
            shelf["x"] = [1, 2]
        with pytest.raises(UnsupportedStateError, match="not numeric"):
            shelf["x"] = np.array(["a", "b"])
        with pytest.raises(UnsupportedStateError, match="not numeric"):
            shelf["x"] = np.array([object()])
        with pytest.raises(UnsupportedStateError, match="non-empty strings"):
            shelf[""] = 1
        with pytest.raises(UnsupportedStateError, match="not valid Unicode"):  # a UnicodeEncodeError
            shelf["x"] = "a lone surrogate: \ud800"
        assert len(shelf) == 0 and shelf.seq == 1  # refused before any transaction began


def test_torch_tensors_in_and_zero_copy_out(shm_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    with Shelf(shm_dir / "s", size="1MiB") as shelf:
        shelf["t"] = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        with shelf.transaction("t"):
            tensor = torch.from_numpy(shelf["t"])  # shares the arena's memory
            tensor.mul_(10)
        assert shelf["t"].tolist() == [[0, 10, 20], [30, 40, 50]]


def test_lifecycle_errors(shm_dir: Path) -> None:
    path = shm_dir / "s"
    with pytest.raises(ShelfError, match="pass size="):
        Shelf(path)
    with pytest.raises(ValueError, match="not a size"):
        Shelf(path, size="lots")
    with pytest.raises(ValueError, match="too small"):
        Shelf(path, size=4096)
    shelf = Shelf(path, size="1MiB")
    with pytest.raises(cs.LockedError, match="open in another process"):
        Shelf(path)
    shelf["x"] = np.ones(3)
    view = shelf["x"]
    with pytest.raises(ShelfError, match="closed inside this transaction"), shelf.transaction():
        shelf["x"] = np.zeros(3)
        shelf.close()  # closing inside a transaction rolls it back
    with pytest.raises(ShelfError, match="is closed"):
        shelf["x"]
    assert np.all(view == 1)  # the mapping lives on while a view does
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Shelf(path) as again:
            assert np.all(again["x"] == 1)


@pytest.mark.timeout(60)
def test_hostile_paths_never_hang_or_write_through_a_link(shm_dir: Path) -> None:
    """A FIFO where the shelf should be is refused at once (inspecting it waited forever for a
    writer). A link planted at the name a creation writes first (in /dev/shm, which anyone can
    write) is replaced, never written through: its target was truncated and became the shelf."""
    fifo = shm_dir / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotAShelfError, match="not a regular file"):
        Shelf(fifo)
    with pytest.raises(NotAShelfError, match="not a regular file"):
        within(10, lambda: inspect_shelf(fifo))
    victim = shm_dir / "victim"
    victim.write_bytes(b"not yours")
    planted = shm_dir / f".s.creating-{os.getpid()}"
    os.symlink(victim, planted)
    with Shelf(shm_dir / "s", size="1MiB") as shelf:
        shelf["x"] = 1
    assert victim.read_bytes() == b"not yours"
    assert not (shm_dir / "s").is_symlink() and not os.path.lexists(planted)
    with Shelf(shm_dir / "s") as shelf:
        assert shelf["x"] == 1


def test_an_unclosed_shelf_unlocks_when_collected(shm_dir: Path) -> None:
    Shelf(shm_dir / "s", size="1MiB")["x"] = 1  # never closed
    with Shelf(shm_dir / "s") as shelf:
        assert shelf["x"] == 1


def test_power_durability_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Shelf(path, size="2MiB", durability="auto") as shelf:
        assert shelf.durability == "power"
        shelf["x"] = np.arange(1000.0)
        with shelf.transaction("x"):
            shelf["x"][:] += 1
    with Shelf(path) as shelf:
        assert np.array_equal(shelf["x"], np.arange(1000.0) + 1)


def test_auto_durability_on_tmpfs(shm_dir: Path) -> None:
    with Shelf(shm_dir / "s", size="1MiB") as shelf:
        assert shelf.durability == "process" and not shelf.map_sync


def test_a_dax_mount_asks_for_map_sync_and_falls_back_when_refused(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """No DAX device here: the mount table is the one thing faked (a real ext4 file claims ``dax``),
    so the kernel really refuses MAP_SYNC and the shelf must map the file the ordinary way."""
    from crashsafe.shelf import arena

    monkeypatch.setattr(arena, "mount_of", lambda path: ("ext4", "rw,relatime,dax"))
    with Shelf(tmp_path / "s", size="1MiB") as shelf:
        assert shelf.durability == "power" and not shelf.map_sync
        shelf["x"] = np.arange(10.0)
        with shelf.loop("x").step() as out:
            out["x"] += 1
    with Shelf(tmp_path / "s") as shelf:
        assert np.array_equal(shelf["x"], np.arange(10.0) + 1)


@pytest.mark.parametrize("mode", MODES)
def test_reserved_arrays_become_variables_without_a_copy_or_are_freed(shm_dir: Path, mode: str) -> None:
    path = shm_dir / "s"
    with Shelf(path, size="1MiB", tx_mode=mode) as shelf:
        shelf["c"] = np.zeros((3, 3))
        old, used = shelf["c"], shelf.used
        with pytest.raises(ShelfError, match="inside a transaction"):
            shelf.reserve((3, 3))
        with shelf.transaction([]):
            a = shelf.reserve((3, 3))
            b = shelf.reserve(4, np.int32)
            a[:] = 5
            assert shelf.used == used + 128 + 64 and np.all(shelf["c"] == 0)  # nothing assigned yet
            shelf.update({"c": a, "n": 1})  # adopted: no copy
            assert shelf["c"] is a and shelf.used == used + 128 + 64
        assert np.all(shelf["c"] == 5) and np.all(old == 0) and not a.flags.writeable
        del b  # never assigned: freed at the commit (pinned until now, as it was alive)
        shelf["x"] = 1
        assert shelf.used == used + 128  # "c"'s old block stays pinned by `old`
        del old
        with shelf.transaction([]):
            shelf.reserve((100,))  # dropped at once: freed at the commit
            c = shelf.reserve((3, 3))
            c[:] = 6
            shelf["d"] = c[:2]  # a slice is not the reserved array: copied
        assert np.all(shelf["d"] == 6) and shelf.used == used + 64 + 128  # `c` pins its block
        del c
        shelf["x"] = 2
        assert shelf.used == used + 64
        with pytest.raises(RuntimeError), shelf.transaction([]):
            e = shelf.reserve((3, 3))
            e[:] = 7
            shelf["c"] = e
            raise RuntimeError
        assert np.all(shelf["c"] == 5) and not e.flags.writeable and shelf.used == used + 64 + 128
        del e
        shelf["x"] = 3
        assert shelf.used == used + 64
    with Shelf(path) as shelf:
        assert np.all(shelf["c"] == 5) and shelf.info("c").version == 2 and np.all(shelf["d"] == 6)


def test_metadata_json_is_exactly_json_dumps(shm_dir: Path) -> None:
    import json

    from crashsafe.shelf.meta import MetaEncoder

    values = {"t": True, "f": False, "i": -(1 << 70), "x": 0.1, "nan": math.nan, "inf": -math.inf,
              "c": complex(1.5, math.inf), "none": None, "é\"\\ ✓": np.arange(3.0), "s": "x"}
    with Shelf(shm_dir / "s", size="1MiB") as shelf:
        encoders = MetaEncoder(), MetaEncoder()
        for step in range(4):  # the encoder reuses the JSON of unchanged variables
            if step == 3:
                del shelf["é\"\\ ✓"]  # a commit record naming a deleted variable
            else:
                shelf.update({**values, "x": step / 3})
            meta = shelf.metadata
            doc = {"format": 1, "size": meta.size, "tx": meta.tx, "rollback": meta.rollback,
                   "vars": {name: _entry_doc(e) for name, e in meta.vars.items()}}
            want = json.dumps(doc, separators=(",", ":")).encode()
            assert encoders[0].encode(meta) == want
            assert encoders[1].encode(meta, committed=True) == want  # as commits write it


def _entry_doc(e: Any) -> list[Any]:
    if e.kind != "scalar":
        return [e.kind, e.version, e.dtype, list(e.shape), e.offset, e.nbytes, f"{e.digest:016x}"]
    kind = "none" if e.value is None else type(e.value).__name__
    return ["scalar", e.version, kind, [e.value.real, e.value.imag] if kind == "complex" else e.value]


def test_scalar_subclasses_are_stored_as_their_base_type(shm_dir: Path) -> None:
    import enum

    class Colour(enum.IntEnum):
        RED = 3

    with Shelf(shm_dir / "s", size="1MiB") as shelf:
        shelf["colour"] = Colour.RED
    with Shelf(shm_dir / "s") as shelf:
        assert shelf["colour"] == 3 and type(shelf["colour"]) is int
