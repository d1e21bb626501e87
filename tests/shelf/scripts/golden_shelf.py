"""Build shelves with a fixed sequence of operations and print the xxh3 of their bytes, region by
region, as JSON: the golden-bytes test compares them with the digests the code of commit b011b25
printed (the shelf's on-disk bytes must never change by accident).

Usage: golden_shelf.py DIR (prints the digests), or golden_shelf.py child PATH STEP (a crash child:
run with CRASHSAFE_KILL_AT set, it dies in STEP). Clock and uuid are fixed, so the bytes are too;
only the public API is used, so the same script runs on any version of the code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

time.time = lambda: 1_700_000_000.5  # every timestamp the shelf writes
uuid.uuid4 = lambda: uuid.UUID(int=0x0123456789ABCDEF0123456789ABCDEF)  # the superblock's

from crashsafe.shelf import Shelf, ShelfError  # noqa: E402 - after the clock is fixed
from crashsafe.shelf.layout import PAGE, Superblock  # noqa: E402

warnings.simplefilter("ignore")
ARRAYS = {
    "f64": np.arange(24.0).reshape(4, 6),
    "i32": np.arange(-5, 5, dtype=np.int32),
    "bool": np.array([True, False, True]),
    "c64": np.array([1 + 2j, -3.5j], dtype=np.complex64),
    "u8": np.arange(200, dtype=np.uint8),
    "empty": np.zeros((0, 3)),
}
SCALARS = {"t": True, "i": -7, "big": 1 << 70, "x": 0.1, "nan": float("nan"), "inf": float("-inf"),
           "z": complex(1.5, -2.0), "none": None}


def regions(path: Path) -> dict[str, str]:
    """xxh3 hex of the file and of each region: superblock, undo records, both metadata slots, data."""
    raw = path.read_bytes()
    sb = Superblock.unpack(raw[:PAGE], path)
    spans = {"file": (0, len(raw)), "superblock": (0, PAGE),
             "records": (sb.record_off, sb.record_off + sb.record_size),
             "slot0": (sb.slot(0), sb.slot(1)), "slot1": (sb.slot(1), sb.slot(2)),
             "data": (sb.data_start, len(raw))}
    return {name: xxhash.xxh3_64_hexdigest(raw[start:end]) for name, (start, end) in spans.items()}


def transactions(path: Path) -> None:
    """Shadow and undo transactions: every kind of value, in-place writes, empty/reserve, aborts."""
    with Shelf(path, size="1MiB", durability="process") as shelf:
        shelf.update({**ARRAYS, **SCALARS, "s": "grüße ✓", "b": b"\x00\x01bytes"})
        shelf["alone"] = np.ones(7)  # a transaction of its own
        with shelf.transaction():
            shelf["f64"][1] = -1.0  # in place through a view: undo-logged
            shelf["i32"] = np.arange(10, dtype=np.int32)  # same shape: a shadow block
            shelf["i"] = -7  # unchanged scalar
            shelf["x"] = 0.2
            del shelf["b"]
            shelf.resize("u8", 50)
            np.multiply(shelf["alone"], 3, out=shelf.empty("tripled", 7))
            shelf["adopted"] = np.add(shelf["c64"], 1, out=shelf.reserve(2, np.complex64))
            shelf.reserve((3, 3))  # never adopted: freed
        try:
            with shelf.transaction():
                shelf["f64"][0] = 99.0
                shelf["gone"] = np.zeros(5)
                del shelf["s"]
                raise KeyError("on purpose")
        except KeyError:
            pass
    with Shelf(path, tx_mode="undo", durability="process") as shelf:
        shelf["f64"] = np.full((4, 6), 2.5)  # same shape: in place, undo-logged
        with shelf.transaction("i32"):
            shelf["i32"][:] += 1
            shelf["tripled"] = np.zeros(3)  # another shape: a fresh block
        try:
            with shelf.transaction():
                shelf["alone"] = np.full(7, 8.0)
                raise ValueError("again on purpose")
        except ValueError:
            pass


def loops(path: Path) -> None:
    """A loop: begin/commit, copied and partial commits, step, abort, resume, end, a new loop."""
    with Shelf(path, size="1MiB", durability="process") as shelf:
        shelf.update({"w": np.zeros(16), "v": np.arange(4, dtype=np.int64), "it": 0, "loss": 1.0,
                      "done": False, "note": "kept"})
        loop = shelf.loop("w", "v", "it", "loss", "done")
        for it in range(1, 4):
            out = loop.begin()
            out["w"][:] = it
            loop.commit({"w": out["w"], "v": np.full(4, it, np.int64), "it": it, "loss": 1 / it})
        loop.begin()
        loop.commit({"it": 3, "loss": 2})  # nothing new but an int given for a float
        loop.begin()
        loop.abort()
        with loop.step() as out:
            out["w"] += 0.5
            out["done"] = True
        loop.begin()
        try:
            loop.commit({"nope": 1})
        except ShelfError:
            loop.abort()
    with Shelf(path, durability="process") as shelf:  # resumed: the records hold the newest state
        loop = shelf.loop(["done", "it", "loss", "v", "w"])
        with loop.step() as out:
            out["it"] += 1
        shelf["note"] = "beside the loop"  # the metadata keeps the loop
        with loop.step() as out:
            out["v"][0] = 100
        shelf["w"] = np.zeros(3)  # retyped: ends the loop and frees its blocks
        other = shelf.loop("v", "it")
        with other.step() as out:
            out["v"][:] = -1
        other.end()
        shelf.loop("w").begin()  # left begun: the shelf closes it


def grown(path: Path) -> None:
    with Shelf(path, size="2MiB", durability="process") as shelf:
        shelf["after"] = np.arange(3.0)


def crash_child(path: Path, step: str) -> None:
    """Die (CRASHSAFE_KILL_AT) in a transaction or in a loop iteration of the shelf ``loops`` made."""
    with Shelf(path, durability="process", tx_mode="undo") as shelf:
        if step == "tx":
            with shelf.transaction():
                shelf["v"] = np.full(4, 5, np.int64)
                shelf["it"] = 77
        else:
            loop = shelf.loop("v", "it")
            out = loop.begin()
            out["v"][:] = 3
            loop.commit({"v": out["v"], "it": 9})


def crashed(path: Path, step: str, point: str) -> None:
    env = {**os.environ, "CRASHSAFE_KILL_AT": point}
    subprocess.run([sys.executable, __file__, "child", str(path), step], env=env, check=False, timeout=60)
    with Shelf(path, durability="process") as shelf:  # recovers
        assert shelf.recovered is not None


def main(directory: Path) -> dict[str, Any]:
    digests: dict[str, Any] = {}
    transactions(directory / "tx")
    digests["transactions"] = regions(directory / "tx")
    loops(directory / "loop")
    digests["loop"] = regions(directory / "loop")
    grown(directory / "loop")
    digests["grown"] = regions(directory / "loop")
    crashed(directory / "loop", "tx", "shelf_after_undo")
    digests["crashed_tx"] = regions(directory / "loop")
    with Shelf(directory / "loop", durability="process") as shelf:
        shelf.loop("v", "it")
    crashed(directory / "loop", "loop", "shelf_loop_mid_record")
    digests["crashed_loop"] = regions(directory / "loop")
    return digests


if __name__ == "__main__":
    if sys.argv[1] == "child":
        crash_child(Path(sys.argv[2]), sys.argv[3])
    else:
        print(json.dumps(main(Path(sys.argv[1])), indent=1, sort_keys=True))
