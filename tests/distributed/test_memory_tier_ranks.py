"""The memory tier of a distributed job (docs/memory.md): real DDP ranks on gloo, hosts pretended by
name; a restart resumes from the ranks' own memory copies, a wiped host's ranks pull their parts from
peers (a rank SIGKILLed while it commits its pull included), and the end is bit-identical to an
uninterrupted run."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from crashsafe.storage.layout import committed_steps


def _launch(
    launch: Any,
    kind: str,
    hosts: list[str],
    tmp: Path,
    name: str,
    steps: int,
    kill_last_at: str = "",
    device: str = "cpu",
) -> list[str]:
    """Run the job with a memory tier (one save per step, every 5th persistent) to ``steps`` on
    ``device``; the sources each rank's restore named. ``kill_last_at``: the last rank SIGKILLs itself
    at that commit point (the others then fail within a short coordination timeout)."""
    env = {"JOB_MEMORY": str(tmp / "mem"), "JOB_HOSTS": ",".join(hosts), "JOB_PERSIST_EVERY": "5",
           "JOB_DEVICE": device, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # fmt: skip
    env_of = {r: env for r in range(len(hosts))}
    if kill_last_at:
        env_of[len(hosts) - 1] = {**env, "CRASHSAFE_KILL_AT": kill_last_at}
        ranks = launch("job.py", len(hosts), kind, tmp / f"{name}-disk", steps, 1, tmp / f"{name}.npz", 5,
                       env_of=env_of)  # fmt: skip
        codes = ranks.wait()
        assert codes[-1] == -9 and all(code != 0 for code in codes), codes
        return []
    ranks = launch("job.py", len(hosts), kind, tmp / f"{name}-disk", steps, 1, tmp / f"{name}.npz", 60,
                   env_of=env_of)  # fmt: skip
    sources = []
    for proc, _ in ranks.procs:  # (read to the end first: the ranks exit on their own)
        lines = proc.stdout.read().splitlines() if proc.stdout else []
        sources += [line.removeprefix("source ") for line in lines if line.startswith("source ")]
    codes = ranks.wait()
    assert codes == [0] * len(hosts), codes
    return sources


def _same(a: Path, b: Path) -> None:
    with np.load(a) as left, np.load(b) as right:
        assert sorted(left.files) == sorted(right.files)
        for name in left.files:
            assert np.array_equal(left[name], right[name]), name


CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CI has none): run `bash tests/gpu/run.sh`"
)


# (FSDP2 on 2 hosts of 2 ranks, killed and wiped: tests/distributed/test_memory_field.py)
@pytest.mark.parametrize(
    ("kind", "hosts", "device"),
    [("ddp", ["a", "b"], "cpu"), pytest.param("ddp", ["a", "b"], "cuda", marks=[pytest.mark.cuda, CUDA])],
    ids=["ddp", "ddp-cuda"],
)
def test_a_restart_resumes_from_memory_and_a_wiped_host_from_peers(
    tmp_path: Path, launch: Any, kind: str, hosts: list[str], device: str
) -> None:
    def run_to(where: Path, steps: int, kill: str = "") -> list[str]:
        return _launch(launch, kind, hosts, where, "run", steps, kill, device)

    straight = tmp_path / "straight"
    straight.mkdir()
    run_to(straight, 10)
    run = tmp_path / "run"
    run.mkdir()
    assert run_to(run, 7) == ["none"] * len(hosts)
    assert committed_steps(run / "run-disk") == [5]  # every 5th save is persistent
    assert committed_steps(run / "mem" / "a" / "rank_0") == [6, 7]
    assert run_to(run, 8) == ["memory"] * len(hosts)  # own copies
    shutil.rmtree(run / "mem" / "b")  # host b lost its memory: its ranks pull their parts
    run_to(run, 10, "after_fsync_tmp_dir")  # killed committing its pull
    sources = run_to(run, 10)
    assert [s for h, s in zip(hosts, sources, strict=True) if h == "a"] == ["memory"] * hosts.count("a")
    assert all(s.startswith("peer ") for h, s in zip(hosts, sources, strict=True) if h == "b"), sources
    _same(straight / "run.npz", run / "run.npz")
