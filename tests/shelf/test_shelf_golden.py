"""Golden bytes: a fixed sequence of shelf operations (scripts/golden_shelf.py: transactions of both
modes, aborts, a loop, growth, two crashes) leaves exactly the bytes the code of commit b011b25 left,
region by region, but for two fixes since: a metadata write after loop commits goes to the slot that
does not hold the newest copy (it went to slot seq % 2, which loop commits advance, and could be
that one); and a loop's begin line carries a checksum, and ``abort`` marks the iteration aborted
instead of zeroing the line, so a reopen can prove a commit whose record was damaged (issue 26 F:
the data region of the shelves with a loop). A refactoring must not change the arena, the metadata
or the loop records."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

# printed by `PYTHONPATH=src python tests/shelf/scripts/golden_shelf.py DIR` (b011b25, then the two fixes)
EXPECTED = json.loads("""
{
 "crashed_loop": {
  "data": "b172a148a03fb724",
  "file": "bcec1da737a8a4f2",
  "records": "0675097b3faf63ef",
  "slot0": "7e30d3e6dabfa3fe",
  "slot1": "a3069225d935f2d4",
  "superblock": "e22f67851e97925e"
 },
 "crashed_tx": {
  "data": "384eac852449e697",
  "file": "c61f51e5ce14384f",
  "records": "0675097b3faf63ef",
  "slot0": "3ec3dd3002cd17af",
  "slot1": "55cc75c460d6a1df",
  "superblock": "e22f67851e97925e"
 },
 "grown": {
  "data": "6bd6fa469fbeed4e",
  "file": "10b749d8111e919b",
  "records": "5f0e8cb38fe09260",
  "slot0": "3ec3dd3002cd17af",
  "slot1": "1c65edac3751e6c5",
  "superblock": "e22f67851e97925e"
 },
 "loop": {
  "data": "3dc990027e302caf",
  "file": "d6352ad5aa66c8ed",
  "records": "cb252556f11ab4f5",
  "slot0": "00f4a5510e249fd0",
  "slot1": "5ecc4cdf385cc79a",
  "superblock": "e22f67851e97925e"
 },
 "transactions": {
  "data": "9205ba4771a96850",
  "file": "2980575376cb38ff",
  "records": "7d7fc34bcfced7b0",
  "slot0": "e3c254601a4800c6",
  "slot1": "4919b8132ff0dd09",
  "superblock": "e22f67851e97925e"
 }
}
""")


def test_the_shelf_writes_the_bytes_it_always_wrote(
    shm_dir: Path, run_script: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    result = run_script("golden_shelf.py", shm_dir, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == EXPECTED
