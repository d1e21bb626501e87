"""A frozen layer in a DDP or FSDP2 job: once committed, every later step refers to its bytes (each
rank to its own shard), and a resumed run still ends bit-identical to an uninterrupted one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crashsafe as cs

FROZEN = {"JOB_FROZEN": "1"}


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_frozen_layer_is_referred_to_by_every_rank(tmp_path: Path, launch: Any, kind: str) -> None:
    env = {0: FROZEN, 1: FROZEN}
    for name, more in (("straight", ()), ("resumed", (6,))):
        codes = launch("job.py", 2, kind, tmp_path / name, 12, 3, tmp_path / f"{name}.npz", 60, *more,
                       env_of=env).wait()  # fmt: skip
        assert codes == [0, 0], codes
    with np.load(tmp_path / "straight.npz") as left, np.load(tmp_path / "resumed.npz") as right:
        assert sorted(left.files) == sorted(right.files)
        for name in left.files:
            assert np.array_equal(left[name], right[name]), name
    reader = cs.CheckpointManager(tmp_path / "resumed", read_only=True)
    newest = reader.manifest()
    refs = [p for p in newest.payloads if p.ref is not None]
    assert refs and all(p.path.endswith(".2.weight") for p in refs)  # the frozen weight (its bias is small)
    assert len(refs) == (2 if kind == "fsdp" else 1)  # FSDP2: each rank's shard
    assert all(p.ref is not None and p.ref < newest.step for p in refs)
    owned = [p.path for p in newest.payloads if p.ref is None]
    assert not any(path.endswith(".2.weight") for path in owned)
    assert any(path.endswith(".0.weight") for path in owned)
    full = reader.load()
    with np.load(tmp_path / "resumed.npz") as final:
        for name, tensor in full["model"].items():
            assert np.array_equal(tensor.numpy(), final[f"model.{name}"]), name
    assert cs.verify(tmp_path / "resumed").ok
