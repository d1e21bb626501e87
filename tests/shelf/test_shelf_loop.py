"""``Shelf.loop``: the lean per-iteration commit path. Commits, versions and reopening; what it
refuses; how it lives beside ordinary transactions; real SIGKILLs at every point of its protocol;
flipped bytes in its records and blocks."""

from __future__ import annotations

import signal
import struct
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import xxhash
from typer.testing import CliRunner

from crashsafe.cli.app import app
from crashsafe.shelf import CorruptShelfError, Shelf, ShelfError, ShelfFullError, ShelfRecoveredWarning
from crashsafe.shelf.inspect import inspect_shelf
from crashsafe.shelf.layout import PAGE, Superblock, encode_meta_slot

Run = Callable[..., subprocess.CompletedProcess[str]]
Flip = Callable[[Path, int], None]
NAMES = ("x", "y", "it", "loss", "done")


def loop_state_a(path: Path, durability: str = "auto") -> None:
    """State A: arrays x (float64) and y (int32), scalars it/loss/done, a str outside the loop,
    and a loop over the first five, one iteration in."""
    with Shelf(path, size="2MiB", durability=durability) as shelf:  # type: ignore[arg-type]
        shelf.update({"x": np.zeros(5000), "y": np.arange(6, dtype=np.int32).reshape(2, 3), "it": 0,
                      "loss": float("inf"), "done": False, "note": "outside"})
        loop = shelf.loop(*NAMES)
        with loop.step() as out:
            out["x"][:] = np.arange(5000)
            out["y"][:] = 1
            out.update(it=1, loss=0.5)


def assert_a(shelf: Shelf) -> None:
    assert np.array_equal(shelf["x"], np.arange(5000)) and np.all(shelf["y"] == 1)
    assert (shelf["it"], shelf["loss"], shelf["done"], shelf["note"]) == (1, 0.5, False, "outside")


def assert_b(shelf: Shelf) -> None:
    assert np.all(shelf["x"] == 9.0) and np.all(shelf["y"] == 7)
    assert (shelf["it"], shelf["loss"], shelf["done"], shelf["note"]) == (2, 0.25, True, "outside")


def reopen(path: Path) -> tuple[Shelf, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shelf = Shelf(path)
    return shelf, [w for w in caught if issubclass(w.category, ShelfRecoveredWarning)]


def described(shelf: Shelf) -> tuple[object, ...]:
    """Everything a reader sees of a shelf's committed state."""
    return (shelf.seq, shelf.last_transaction, sorted(shelf),
            [shelf.info(n) for n in sorted(shelf)], [np.asarray(shelf[n]).tolist() for n in sorted(shelf)])


def test_commits_reopen_to_the_same_state(any_dir: Path) -> None:
    path = any_dir / "s"
    loop_state_a(path)
    with Shelf(path) as shelf:
        assert_a(shelf)
        loop = shelf.loop(*NAMES)
        seq = shelf.seq
        for it in range(2, 6):
            out = loop.begin()
            np.multiply(shelf["x"], 2.0, out=out["x"])
            out["y"][:] = it
            loop.commit({"x": out["x"], "y": out["y"], "it": it, "loss": 1.0 / it})
            del out
        assert shelf.seq == seq + 4 and shelf["it"] == 5 and shelf["loss"] == 0.2
        assert np.array_equal(shelf["x"], np.arange(5000) * 16.0) and np.all(shelf["y"] == 5)
        before = described(shelf)
        assert shelf.durability == ("power" if any_dir.parts[1] != "dev" else "process")
    shelf, recovered = reopen(path)
    with shelf:
        assert not recovered and shelf.recovered is None
        assert described(shelf) == before
        shelf.verify()
        # reopened, the same names resume the loop where it was, with no commit of its own
        loop = shelf.loop(list(reversed(NAMES)))
        assert shelf.seq == before[0] and loop.seq == shelf.seq
        with loop.step() as out:
            out["x"][:] = 1.0
            out["it"] = 6
        assert shelf["it"] == 6 and np.all(shelf["x"] == 1.0) and np.all(shelf["y"] == 5)
        used = shelf.used
    report = inspect_shelf(path)
    assert report.loop == NAMES and report.seq == before[0] + 1 and report.used == used
    assert {v.name: v.value for v in report.variables if v.kind == "scalar"}["it"] == 6
    result = CliRunner().invoke(app, ["shelf", "inspect", str(path)])
    assert result.exit_code == 0 and "loop over" in result.output


def test_versions_count_changes_and_the_last_transaction_names_them(shm_dir: Path) -> None:
    loop_state_a(shm_dir / "s")
    with Shelf(shm_dir / "s") as shelf:
        loop = shelf.loop(*NAMES)
        v = {n: shelf.info(n).version for n in NAMES}
        out = loop.begin()
        out["x"][:] = shelf["x"]  # same bytes, in the other block
        out["y"][:] = 3
        loop.commit({"x": out["x"], "y": out["y"], "it": 1, "loss": 0.5, "done": True})
        del out
        assert shelf.last_transaction["changed"] == ["done", "y"]
        after = {n: shelf.info(n).version for n in NAMES}
        assert after == {**v, "y": v["y"] + 1, "done": v["done"] + 1}
        with loop.step() as step:  # only scalars: the arrays keep their blocks and versions
            step["loss"] = float("nan")
        with loop.step() as step:
            step["loss"] = float("nan")  # NaN equals NaN here: no new version
        assert shelf.info("loss").version == after["loss"] + 1 and np.isnan(shelf["loss"])
        assert shelf.last_transaction["changed"] == []


def test_commit_copies_other_arrays_and_keeps_missing_variables(shm_dir: Path) -> None:
    loop_state_a(shm_dir / "s")
    with Shelf(shm_dir / "s") as shelf:
        loop = shelf.loop(*NAMES)
        loop.begin()
        loop.commit({"x": np.full(5000, 4.0), "it": np.int64(3), "loss": 2})  # numpy int, int for float
        assert np.all(shelf["x"] == 4.0) and np.all(shelf["y"] == 1)
        assert shelf["it"] == 3 and type(shelf["it"]) is int and shelf["loss"] == 2.0
        assert type(shelf["loss"]) is float and shelf["done"] is False
        assert loop.state == {n: shelf[n] for n in NAMES if n not in ("x", "y")} | loop.arrays
        assert not loop.state["x"].flags.writeable


@pytest.mark.parametrize(("values", "message"), [
    ({"x": np.zeros(4999)}, "float64\\[5000\\] array"),
    ({"y": np.zeros((2, 3))}, "int32"),
    ({"it": 1.5}, "'it' is a int"),
    ({"done": 1}, "'done' is a bool"),
    ({"it": True}, "'it' is a int"),
    ({"loss": "0.1"}, "'loss' is a float"),
    ({"it": 1 << 70}, "64 bits"),
    ({"note": "x"}, "not variables of this loop"),
])
def test_a_bad_commit_commits_nothing(shm_dir: Path, values: dict[str, object], message: str) -> None:
    loop_state_a(shm_dir / "s")
    with Shelf(shm_dir / "s") as shelf:
        loop = shelf.loop(*NAMES)
        before = described(shelf)
        out = loop.begin()
        with pytest.raises(ShelfError, match=message):
            loop.commit(values)
        assert loop.in_iteration and out["x"].flags.writeable  # still open: fix it, or abort
        loop.abort()
        assert not out["x"].flags.writeable and described(shelf) == before
    shelf, recovered = reopen(shm_dir / "s")
    with shelf:
        assert not recovered and described(shelf) == before  # an abort is not a crash


def test_step_aborts_on_an_exception(shm_dir: Path) -> None:
    loop_state_a(shm_dir / "s")
    with Shelf(shm_dir / "s") as shelf:
        loop = shelf.loop(*NAMES)
        before = described(shelf)
        with pytest.raises(ZeroDivisionError), loop.step() as out:
            out["x"][:] = -1.0
            out["it"] = 1 // 0
        assert described(shelf) == before and not loop.in_iteration
        with pytest.raises(ShelfError, match="without an iteration"):
            loop.commit({"it": 5})


def test_handed_out_arrays_are_read_only_once_committed(shm_dir: Path) -> None:
    loop_state_a(shm_dir / "s")
    with Shelf(shm_dir / "s") as shelf:
        loop = shelf.loop(*NAMES)
        out = loop.begin()
        loop.commit({"x": out["x"]})
        with pytest.raises(ValueError, match="read-only"):
            out["x"][0] = 1.0
        assert shelf["x"] is out["x"]  # the committed value is the array computed into


@pytest.mark.parametrize("keep", ["array", "view", "tensor"])
def test_begin_refuses_a_spare_still_referenced(shm_dir: Path, keep: str) -> None:
    loop_state_a(shm_dir / "s")
    with Shelf(shm_dir / "s") as shelf:
        loop = shelf.loop(*NAMES)
        committed = shelf["x"]
        kept: object = committed
        if keep == "view":
            kept = committed[10:20]
        elif keep == "tensor":
            torch = pytest.importorskip("torch")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # (read-only arrays make read-only tensors)
                kept = torch.from_numpy(committed)
        del committed
        with loop.step() as out:  # the spare: free
            out["x"][:] = 2.0
        del out
        with pytest.raises(ShelfError, match="two iterations ago is still referenced"):
            loop.begin()  # its spare is the block `kept` looks at
        assert not loop.in_iteration
        assert np.asarray(kept).tolist()[:3] == ([10.0, 11.0, 12.0] if keep == "view" else [0.0, 1.0, 2.0])
        del kept
        with loop.step() as out:
            out["x"][:] = 3.0
        assert np.all(shelf["x"] == 3.0)


def test_a_refused_begin_leaves_every_spare_read_only(shm_dir: Path) -> None:
    loop_state_a(shm_dir / "s")
    with Shelf(shm_dir / "s") as shelf:
        loop = shelf.loop(*NAMES)
        kept = shelf["y"]  # the second array's: x's spare is checked (and free) first
        with loop.step():
            pass
        with pytest.raises(ShelfError, match="'y' committed two iterations ago"):
            loop.begin()
        assert loop.writable == ()
        del kept


def test_transactions_beside_a_loop(shm_dir: Path) -> None:
    path = shm_dir / "s"
    loop_state_a(path)
    with Shelf(path) as shelf:
        loop = shelf.loop(*NAMES)
        used = shelf.used
        with pytest.raises(ShelfError, match="transaction is open"), shelf.transaction([]):
            loop.begin()
        out = loop.begin()
        with pytest.raises(ShelfError, match="loop iteration is in progress"):
            shelf["note"] = "no"
        loop.abort()
        del out
        # a transaction that leaves the loop's variables alone, or changes them in place or keeps
        # their types, keeps the loop going, and the loop sees what it committed
        shelf["note"] = "changed"
        shelf["it"] = 40
        with shelf.transaction("x"):
            shelf["x"][:2] = -5.0
        with loop.step() as step:
            assert step["x"] is not shelf["x"]
            step["x"][:] = shelf["x"]
            step["loss"] = 0.125
        assert shelf["it"] == 40 and shelf["x"][1] == -5.0 and shelf["note"] == "changed"
        assert shelf.info("it").version == 3 and shelf.used == used
        before = described(shelf)
    shelf, _ = reopen(path)
    with shelf:
        assert described(shelf) == before
        loop = shelf.loop(*NAMES)
        used = shelf.used
        # replacing a loop array by a new block ends the loop, and frees its spares and records
        shelf["y"] = np.zeros(4)
        with pytest.raises(ShelfError, match="ended"):
            loop.begin()
        assert shelf.used < used
        assert inspect_shelf(path).loop == ()
        before = described(shelf)
    with Shelf(path) as shelf:
        assert described(shelf) == before


def test_end_and_new_loops_free_their_blocks(shm_dir: Path) -> None:
    path = shm_dir / "s"
    with Shelf(path, size="1MiB") as shelf:
        shelf.update({"a": np.ones(1000), "b": np.ones(1000), "n": 0})
        empty = shelf.used
        loop = shelf.loop("a", "n")
        assert shelf.used > empty + 8000
        other = shelf.loop("b", "n")  # another loop replaces it
        assert loop.ended and not other.ended and shelf.loop("n", "b") is other
        with other.step() as out:
            out["b"][:] = 2.0
        other.end()
        assert shelf.used == empty and np.all(shelf["b"] == 2.0)
        with pytest.raises(ShelfError, match="ended"):
            other.begin()
    assert Shelf(path).loop("a").seq > 0


@pytest.mark.parametrize(("setup", "names", "message"), [
    ({"s": "text"}, ["s"], "'s' is a str"),
    ({"c": 1j}, ["c"], "complex scalar"),
    ({"z": None}, ["z"], "none scalar"),
    ({"big": 1 << 64}, ["big"], "int scalar"),
    ({}, ["missing"], "no variable 'missing'"),
])
def test_loop_refuses_what_it_cannot_commit(shm_dir: Path, setup: dict[str, object], names: list[str],
                                            message: str) -> None:
    with Shelf(shm_dir / "s", size="1MiB") as shelf:
        if setup:
            shelf.update(setup)
        seq = shelf.seq
        with pytest.raises(ShelfError, match=message):
            shelf.loop(names)
        assert shelf.seq == seq
        with pytest.raises(ValueError, match="names"):
            shelf.loop()


def test_no_room_for_the_spares(shm_dir: Path) -> None:
    with Shelf(shm_dir / "s", size="1MiB") as shelf:
        shelf["big"] = np.zeros(shelf.size // 8 // 2 - 8192)
        seq, used = shelf.seq, shelf.used
        with pytest.raises(ShelfFullError, match="the loop's spare of 'big'"):
            shelf.loop("big")
        assert (shelf.seq, shelf.used) == (seq, used)
        shelf["big"] = np.zeros(10)  # the shelf still works
    with Shelf(shm_dir / "s") as shelf:
        assert shelf["big"].shape == (10,)


LOOP_POINTS = ["shelf_loop_after_begin", "shelf_loop_before_record", "shelf_loop_mid_record",
               "shelf_loop_after_record"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", LOOP_POINTS)
def test_sigkill_at_each_point_of_a_loop_iteration(shm_dir: Path, run_script: Run, point: str) -> None:
    path = shm_dir / "s"
    loop_state_a(path)
    result = run_script("loop_step.py", path, "process", CRASHSAFE_KILL_AT=point)
    assert result.returncode == -signal.SIGKILL, result.stderr
    shelf, recovered = reopen(path)
    with shelf:
        shelf.verify()
        if point == "shelf_loop_after_record":
            assert_b(shelf)
            assert shelf.recovered is None and not recovered
            return
        assert_a(shelf)
        assert shelf.recovered is not None and shelf.recovered.seq == shelf.seq
        assert len(recovered) == 1 and "rolled back" in str(recovered[0].message)
    # the shelf keeps working: the same iteration now commits, and nothing is reported twice
    result = run_script("loop_step.py", path, "process")
    assert result.returncode == 0 and "committed" in result.stdout, result.stderr
    shelf, recovered = reopen(path)
    with shelf:
        assert_b(shelf)
        assert not recovered


@pytest.mark.timeout(120)
@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_a_transaction_torn_after_loop_commits_keeps_them(shm_dir: Path, run_script: Run,
                                                           iterations: int) -> None:
    """A SIGKILL halfway through the metadata write of a transaction after loop commits: the
    transaction is rolled back and every loop commit stays. After an odd number of them that write
    went into the slot holding the newest metadata (picked as seq % 2, which loop commits advance),
    and the shelf reopened before the loop had even started, silently."""
    path = shm_dir / "s"
    result = run_script("loop_then_assign.py", path, iterations, CRASHSAFE_KILL_AT="shelf_mid_meta:3")
    assert result.returncode == -signal.SIGKILL, result.stderr
    shelf, recovered = reopen(path)
    with shelf:
        shelf.verify()
        assert shelf["it"] == iterations and np.all(shelf["x"] == iterations)
        assert "other" not in shelf and len(recovered) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", ["shelf_loop_before_record", "shelf_loop_mid_record"])
def test_sigkill_with_power_durability_on_disk(tmp_path: Path, run_script: Run, point: str) -> None:
    path = tmp_path / "s"
    loop_state_a(path, "power")
    result = run_script("loop_step.py", path, "power", CRASHSAFE_KILL_AT=point)
    assert result.returncode == -signal.SIGKILL, result.stderr
    shelf, _ = reopen(path)
    with shelf:
        assert shelf.durability == "power" and shelf.recovered is not None
        assert_a(shelf)


def _record_slots(shelf: Shelf) -> tuple[int, int]:
    layout = shelf.metadata.loop
    assert layout is not None
    return layout.slot(shelf.seq), layout.slot(shelf.seq - 1)


def test_a_damaged_newest_record_falls_back_to_the_one_before(shm_dir: Path, flip: Flip) -> None:
    path = shm_dir / "s"
    loop_state_a(path)
    with Shelf(path) as shelf:
        with shelf.loop(*NAMES).step() as out:
            out["x"][:] = 8.0
            out["it"] = 2
        newest, _ = _record_slots(shelf)
    flip(path, newest + 30)  # in the seq or id field: the record no longer checks out
    shelf, recovered = reopen(path)
    with shelf:  # the previous iteration, intact (its blocks were not written since), reported
        assert_a(shelf)
        assert len(recovered) == 1 and shelf.recovered is not None


@pytest.mark.parametrize("then", ["abort", "close mid-iteration", "begin again", "nothing"])
@pytest.mark.parametrize("field", [30, 60])
def test_a_damaged_newest_record_after_an_aborted_iteration_is_reported(
    shm_dir: Path, flip: Flip, then: str, field: int
) -> None:
    """Five iterations committed, then ``loop.begin(); loop.abort()`` and one flipped bit in the
    newest record: the shelf reopened at iteration 4 with no warning (without the abort, the begin
    mark of iteration 5 happened to report it as interrupted). Any lost commit is reported."""
    path = shm_dir / "s"
    loop_state_a(path)
    with Shelf(path) as shelf:
        loop = shelf.loop(*NAMES)
        for it in range(2, 6):
            with loop.step() as out:
                out["x"][:] = it
                out["it"] = it
        fifth, newest, seq = shelf["it"], _record_slots(shelf)[0], shelf.seq
        if then == "abort":
            loop.begin()
            loop.abort()
        elif then == "close mid-iteration":
            loop.begin()
        elif then == "begin again":  # and killed: the open iteration is 6, its mark says so
            with loop.step() as out:
                out["x"][:] = 6
                out["it"] = 6
            newest, seq = _record_slots(shelf)[0], shelf.seq
            loop.begin()
            loop.abort()
    assert fifth == 5
    flip(path, newest + field)  # the seq field, or a checksum of x: the record no longer checks out
    if then != "nothing":
        assert inspect_shelf(path).lost == (seq, seq)
        shown = CliRunner().invoke(app, ["shelf", "inspect", str(path)])
        assert shown.exit_code == 1 and f"committed loop transactions #{seq}..#{seq} are lost" in shown.output
    shelf, recovered = reopen(path)
    with shelf:
        lost = 6 if then == "begin again" else 5
        assert shelf["it"] == lost - 1 and np.all(shelf["x"] == lost - 1)  # the commit before, intact
        assert len(recovered) == 1 and shelf.recovered is not None
        if then != "nothing":  # (nothing: iteration 5's begin mark, reported as interrupted as before)
            said = f"transaction {seq} (loop iterations) committed, but the loop's newest record is damaged"
            assert said in str(recovered[0].message)
            assert shelf.recovered.lost == 1 and shelf.recovered.seq == seq == shelf.seq
        loop = shelf.loop(*NAMES)  # and the loop goes on from there
        with loop.step() as out:
            out["it"] = 99
    shelf, recovered = reopen(path)
    with shelf:
        assert recovered == [] and shelf["it"] == 99  # reported once


def test_damage_to_the_data_of_a_loop_commit_is_named(shm_dir: Path, flip: Flip) -> None:
    path = shm_dir / "s"
    loop_state_a(path)
    with Shelf(path) as shelf:
        offset = shelf.info("x").offset
    flip(path, offset + 100)
    with pytest.raises(CorruptShelfError, match="'x'"):
        Shelf(path)
    # both records damaged: the metadata's own (older) state; its x block was overwritten since
    path2 = shm_dir / "s2"
    loop_state_a(path2)
    with Shelf(path2) as shelf:
        with shelf.loop(*NAMES).step() as out:
            out["x"][:] = 8.0
        slots = _record_slots(shelf)
    for slot in slots:
        flip(path2, slot + 30)
    with pytest.raises(CorruptShelfError, match="'x'"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Shelf(path2)


def test_a_forged_loop_record_is_refused(shm_dir: Path) -> None:
    path = shm_dir / "s"
    loop_state_a(path)
    with Shelf(path) as shelf:
        layout = shelf.metadata.loop
        assert layout is not None
        newest, _ = _record_slots(shelf)
    fields = list(layout.record.unpack_from(path.read_bytes(), newest))
    fields[4] = 2  # x in a third block
    body = layout.record.pack(*fields)
    with open(path, "r+b") as f:
        f.seek(newest)
        f.write(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))
    with pytest.raises(CorruptShelfError, match="forged"):
        Shelf(path)
    with pytest.raises(CorruptShelfError, match="forged"):
        inspect_shelf(path)


def test_forged_loop_layouts_are_refused(shm_dir: Path) -> None:
    path = shm_dir / "s"
    with Shelf(path, size="1MiB") as shelf:
        shelf.update({"a": np.zeros(10), "n": 1})
        seq, offset = shelf.seq, shelf.info("a").offset
    with open(path, "rb") as f:
        sb = Superblock.unpack(f.read(PAGE), path)
    head = (b'{"format":2,"size":1048576,"tx":{},"rollback":null,"vars":{'
            b'"a":["array",1,"float64",[10],' + str(offset).encode() + b',80,"0000000000000000"],'
            b'"n":["scalar",1,"int",1]},"loop":')
    for loop, message in [
        (b'{"id":1,"arrays":[["a",%d,%d]],"scalars":[["n","int"]],"records":%d}'
         % (offset, offset + 64, offset + 4096), "overlaps"),  # a's spare overlaps a
        (b'{"id":1,"arrays":[["a",%d,%d]],"scalars":[["n","float"]],"records":%d}'
         % (offset, offset + 128, offset + 4096), "not a float scalar"),
        (b'{"id":1,"arrays":[["b",%d,%d]],"scalars":[],"records":%d}'
         % (offset, offset + 128, offset + 4096), "'b' is not an array"),
        (b'{"id":1,"arrays":[],"scalars":[],"records":%d}' % (offset + 4096), "loop layout malformed"),
        (b'{"id":-1,"arrays":[["a",%d,%d]],"scalars":[],"records":0}' % (offset, offset + 128),
         "loop layout malformed"),
    ]:
        with open(path, "r+b") as f:
            f.seek(sb.slot((seq + 1) % 2))
            f.write(encode_meta_slot(seq + 1, head + loop + b"}"))
        with pytest.raises(CorruptShelfError, match=message):
            Shelf(path)
    # a loop section under format 1 (a reader that ignored it would reuse the spare blocks)
    with open(path, "r+b") as f:
        f.seek(sb.slot((seq + 1) % 2))
        loop = b'{"id":1,"arrays":[],"scalars":[],"records":0}}'
        forged = head.replace(b'"format":2', b'"format":1') + loop
        f.write(encode_meta_slot(seq + 1, forged))
    with pytest.raises(CorruptShelfError, match="unknown metadata format"):
        Shelf(path)


def test_record_layout_is_what_the_docs_say(shm_dir: Path) -> None:
    loop_state_a(shm_dir / "s")
    with Shelf(shm_dir / "s") as shelf:
        layout = shelf.metadata.loop
        assert layout is not None
        assert layout.record.format == "<8sQQd" + "QQQ" * 2 + "qQ" + "dQ" + "?Q" + "Q"
        newest, _ = _record_slots(shelf)
        raw = shelf.path.read_bytes()
        fields = layout.record.unpack_from(raw, newest)
        assert fields[:3] == (b"CSLOOP01", shelf.seq, layout.id)
        x = shelf.metadata.vars["x"]
        assert fields[4:7] == (int(x.offset == layout.arrays[0][2]), x.digest, x.version)
        (checksum,) = struct.unpack_from("<Q", raw, newest + layout.record.size)
        assert checksum == xxhash.xxh3_64_intdigest(raw[newest : newest + layout.record.size])
