"""The memory tier's field test, short (the full one: ``python -m bench memory_field``): a 4-rank
FSDP2 job on 2 pretended hosts, a random rank SIGKILLed twice and the group restarted as torchrun
does, one host's memory wiped. The end is bit-identical to a run never stopped, every restart
restored the newest step the memory tier held (a wiped host's ranks from their peers' copies), and
the persistent tier, failing every read while the job restores (a fault injected in the job), was
never read. The supervisor runs as its own process, as torchrun does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import PATH, SRC

HOSTS = ["a", "a", "b", "b"]


@pytest.mark.slow
def test_kills_and_a_wiped_host_restore_from_memory_bit_identical(tmp_path: Path) -> None:
    record_file = tmp_path / "field.json"
    command = [
        sys.executable, "-m", "bench", "memory_field", "--kills", "2", "--wipes", "1", "--steps", "30",
        "--life", "2", "3", "--seed", "1", "--width", "32", "--work", str(tmp_path),
        "--report", str(tmp_path / "field.md"), "--json", str(record_file),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=SRC.parent, env={**os.environ, "PYTHONPATH": PATH},
                          capture_output=True, text=True, timeout=280)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(record_file.read_text())
    assert record["identical"] and not record["problems"]
    assert record["faults"] == []  # the persistent tier was never read while restoring
    restarts = record["restarts"]
    assert len(restarts) == 2 and sum(r["wiped"] for r in restarts) == 1
    assert any(r["persistent"] for r in restarts)  # the fault was armed: there was a step to read
    for restart in restarts:
        assert restart["resumed"] == [restart["expected"]] * 4, restart  # the newest step memory held
        killed_host = HOSTS[restart["killed"]]
        for host, source in zip(HOSTS, restart["sources"], strict=True):
            if restart["wiped"] and host == killed_host:
                assert source.startswith("peer "), restart
            else:
                assert source == "memory", restart
