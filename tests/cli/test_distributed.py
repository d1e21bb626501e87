"""The commands on a real distributed checkpoint: two FSDP2 ranks (gloo on 127.0.0.1) save three
steps; ls, show, verify and diff read it through the library's reader, at 80 columns and as JSON."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import crashsafe as cs
from crashsafe.format.manifest import MANIFEST_NAME, dumps
from crashsafe.storage.layout import step_dir

from .conftest import assert_fits, check_json, invoke

SCRIPT = Path(__file__).parent / "scripts" / "fsdp_save.py"
LEAVING = Path(__file__).parents[1] / "distributed" / "scripts"  # leaving.py: the ranks leave together


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the checkpoint, rank 0's .npz of the full model state at step 3)."""
    tmp = tmp_path_factory.mktemp("dist")
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(LEAVING), os.environ.get("PYTHONPATH", "")]),
        }  # fmt: skip
        command = [sys.executable, str(SCRIPT), str(tmp / "ckpt"), str(tmp / "full.npz")]
        procs.append(
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    try:
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    return tmp / "ckpt", tmp / "full.npz"


def test_show_lists_each_ranks_shards(sharded: tuple[Path, Path]) -> None:
    directory, _ = sharded
    doc = check_json(invoke("show", str(directory), "--json").out, "show")
    assert doc["world"] == 2
    shards = [t for t in doc["tensors"] if t["shard"] is not None]
    assert {t["rank"] for t in shards} == {0, 1}
    weight = [t for t in shards if t["path"] == "model.0.weight"]
    assert sorted(t["shard"]["offset"] for t in weight) == [[0, 0], [16, 0]]
    assert all(t["shard"]["global_shape"] == [32, 8] and t["shape"] == [16, 8] for t in weight)
    shown = invoke("show", str(directory))
    assert shown.code == 0, shown.err
    assert_fits(shown.out)
    assert "saved by 2 ranks" in shown.out
    lines = shown.out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("path "))
    rows = [line.split()[:2] for line in lines[top + 1 : top + 1 + len(doc["tensors"])]]
    assert rows == [[t["path"], str(t["rank"])] for t in doc["tensors"]]  # short paths: one line each
    assert "@16,0 of 32x8" in shown.out


def test_ls_and_verify(sharded: tuple[Path, Path]) -> None:
    directory, _ = sharded
    listed = check_json(invoke("ls", str(directory), "--json", "--metric", "loss").out, "ls")
    assert [s["step"] for s in listed["steps"]] == [1, 2, 3] and all(s["ok"] for s in listed["steps"])
    assert listed["metric"]["best_step"] in (1, 2, 3)
    table = invoke("ls", str(directory), "--metric", "loss")
    assert table.code == 0 and "best loss (min)" in table.out
    assert_fits(table.out)
    assert check_json(invoke("verify", str(directory), "--json").out, "verify")["ok"]


def test_diff_compares_whole_tensors(sharded: tuple[Path, Path], tmp_path: Path) -> None:
    """Step 3 of the 2-rank checkpoint against a one-process checkpoint of the full tensors rank 0
    gathered: the same paths, the global shapes, bit-identical."""
    directory, full = sharded
    with np.load(full) as arrays, cs.CheckpointManager(tmp_path / "single") as mgr:
        mgr.save(3, {"model": {name: arrays[name] for name in arrays.files}})
    same = invoke("diff", str(directory), str(tmp_path / "single"), "--prefix", "model.", "--json")
    doc = check_json(same.out, "diff")
    assert same.code == 0 and doc["identical"], doc
    assert {p["path"]: p["shape_a"] for p in doc["paths"]}["model.0.weight"] == [32, 8]
    steps = check_json(invoke("diff", str(directory), "2", "3", "--json").out, "diff")
    assert not steps["identical"] and {p["path"] for p in steps["paths"] if p["status"] == "differs"} >= {
        "model.0.weight", "model.2.bias", "step",
    }  # fmt: skip


def test_export_and_gc(sharded: tuple[Path, Path], tmp_path: Path) -> None:
    """export writes the whole tensors the ranks' shards make up; gc collects the steps of a copy."""
    from safetensors.numpy import load_file

    directory, full = sharded
    out = tmp_path / "model.safetensors"
    exported = invoke("export", str(directory), "-o", str(out), "--prefix", "model.", "--json")
    assert exported.code == 0, exported.err
    assert check_json(exported.out, "export")["step"] == 3
    with np.load(full) as arrays:
        tensors = load_file(out)
        assert sorted(tensors) == sorted(arrays.files)
        for name, array in tensors.items():
            assert np.array_equal(array, arrays[name]), name
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    collected = invoke("gc", str(copy), "--keep-last", "1", "--force", "--json")
    assert collected.code == 0, collected.err
    assert check_json(collected.out, "gc") == {
        "location": str(copy),
        "deleted": [1, 2],
        "leftovers": [],
        "kept": [3],
    }
    assert check_json(invoke("verify", str(copy), "--json").out, "verify")["ok"]


def test_shards_that_disagree_on_their_type_are_refused(sharded: tuple[Path, Path], tmp_path: Path) -> None:
    """A re-signed manifest whose shards of one array declare different element types (same size)
    is damage, not something to cast silently: whole-tensor loads refuse it, naming the array."""
    copy = tmp_path / "ckpt"
    shutil.copytree(sharded[0], copy)
    manifest = cs.CheckpointManager(copy, read_only=True).manifest()
    payloads = list(manifest.payloads)
    i = next(i for i, p in enumerate(payloads) if p.shard is not None and p.dtype == "float32")
    payloads[i] = dataclasses.replace(payloads[i], dtype="int32")
    forged = dataclasses.replace(manifest, payloads=tuple(payloads))
    (step_dir(copy, manifest.step) / MANIFEST_NAME).write_bytes(dumps(forged))  # signed anew
    with pytest.raises(cs.CorruptCheckpointError, match="disagree on its type"):
        cs.CheckpointManager(copy, read_only=True).load(manifest.step)
