"""Real Ray actors, really killed: FreeLauncher recovery is lossless and, under BSP, bit-exact."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from crashsafe.manager import CheckpointManager
from crashsafe.ps import DataLossError, DataLossWarning, Failure, PSConfig, PSJob, RunResult

CLOCKS = 16
_baselines: dict[str, RunResult] = {}


def cfg(**kw: Any) -> PSConfig:
    base: dict[str, Any] = {"servers": 2, "workers": 4, "clocks": CLOCKS, "batch_size": 32}
    base.update(kw)
    return PSConfig(**base)


def baseline(job: PSJob, config: PSConfig) -> RunResult:
    """The failure-free run of ``config`` (FreeLauncher bookkeeping does not change the math)."""
    key = cfg(
        **{
            **config.to_dict(),
            "mode": "none",
            "replicas": 1,
            "checkpoint_dir": None,
            "checkpoint_every": None,
        }
    )
    name = json.dumps(key.to_dict(), sort_keys=True)
    if name not in _baselines:
        _baselines[name] = job.run(config=key)
    return _baselines[name]


def assert_identical(a: RunResult, b: RunResult) -> None:
    assert a.params.keys() == b.params.keys()
    for name in a.params:
        assert a.params[name].tobytes() == b.params[name].tobytes(), f"table {name} differs"


def assert_taken_over(job: PSJob, killed: dict[int, Any], standby: Any | None) -> None:
    """Every killed server is dead and its shard served by another actor (the first one's by
    ``standby`` if given); the standby pool is full again."""
    for s, old in killed.items():
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(old.status.remote(), timeout=30)
        assert job.servers[s]._actor_id != old._actor_id
    if standby is not None:
        assert job.servers[min(killed)]._actor_id == standby._actor_id
    assert [ray.get(a.status.remote(), timeout=60)["id"] for a in job.servers] == list(
        range(len(job.servers))
    )
    assert len(job.spares) == job.cfg.spares == 1
    assert ray.get(job.spares[0].status.remote(), timeout=60)["id"] is None  # a fresh standby


def assert_lossless(result: RunResult) -> None:
    assert result.updates_pushed > 0
    assert result.updates_lost == 0
    assert result.recomputed_clocks == 0
    assert result.worker_reruns == 0
    assert all(r.kind == "replica" and r.discarded_updates == 0 for r in result.recoveries)


@pytest.mark.timeout(120)
def test_every_ray_node_is_loopback(job: PSJob, ray_session: dict[str, str]) -> None:
    nodes = ray.nodes()
    assert nodes and all(n["NodeManagerAddress"] == "127.0.0.1" for n in nodes)
    import psutil

    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] in ("raylet", "gcs_server") and ray_session["temp_dir"] in " ".join(
            proc.info["cmdline"] or []
        ):
            listening = [c.laddr.ip for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
            assert listening and all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip in listening), listening


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("workload", "optimizer", "how", "phase"),
    [
        ("sparse_lr", "adagrad", "ray", "after_apply"),
        ("sparse_lr", "adam", "sigkill", "before_apply"),
        ("digits", "adam", "sigkill", "after_apply"),
        ("mf", "sgd", "ray", "before_apply"),
    ],
)
def test_one_server_failure_is_bit_exact(
    job: PSJob, workload: str, optimizer: str, how: str, phase: str
) -> None:
    config = cfg(workload=workload, optimizer=optimizer, replicas=2)
    clean = baseline(job, config)
    killed, standby = {1: job.servers[1]}, job.spares[0]
    failed = job.run([Failure(clock=7, servers=(1,), how=how, phase=phase)], config=config)
    assert_taken_over(job, killed, standby)
    assert [r.servers for r in failed.recoveries] == [[1]]
    assert failed.recoveries[0].replayed_pushes > 0  # the rebuilt shard really replayed retained updates
    assert_lossless(failed)
    assert failed.updates_pushed == clean.updates_pushed
    assert_identical(failed, clean)


@pytest.mark.timeout(180)
def test_k_minus_1_simultaneous_server_failures_are_bit_exact(job: PSJob) -> None:
    config = cfg(workload="sparse_lr", optimizer="adagrad", replicas=3)
    clean = baseline(job, config)
    killed = dict(enumerate(job.servers))
    failed = job.run(
        [
            Failure(clock=5, servers=(0, 1), how="sigkill"),
            Failure(clock=10, servers=(0, 1), phase="before_apply"),
        ],
        config=config,
    )
    assert [r.servers for r in failed.recoveries] == [[0, 1], [0, 1]]
    # One standby: each time one shard went to it, the other to a new actor started on the spot.
    assert_taken_over(job, killed, None)
    assert_lossless(failed)
    assert_identical(failed, clean)
    assert failed.replica_bytes > 0  # k=3 on sparse keys needs real replica pushes


@pytest.mark.timeout(120)
def test_ssp_server_failure_loses_no_update(job: PSJob) -> None:
    config = cfg(workload="mf", optimizer="adagrad", replicas=2, consistency="ssp", staleness=2)
    failed = job.run([Failure(clock=6, servers=(0,), how="sigkill")], config=config)
    assert failed.clocks == CLOCKS and [r.kind for r in failed.recoveries] == ["replica"]
    assert_lossless(failed)
    assert np.isfinite(failed.metrics["rmse"])


@pytest.mark.timeout(180)
def test_k_failures_detect_missing_data_and_fall_back_to_checkpoint(job: PSJob, tmp_path: Path) -> None:
    # k=1 keeps no worker copy beyond what pulls leave behind: one server failure is k failures.
    lossy = cfg(workload="sparse_lr", replicas=1)
    with pytest.raises(DataLossError, match=r"replicas=1 tolerates 0 .*checkpoint_every"):
        job.run([Failure(clock=8, servers=(1,))], config=lossy)

    config = cfg(workload="sparse_lr", replicas=1, checkpoint_dir=str(tmp_path), checkpoint_every=5)
    clean = baseline(job, config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        failed = job.run([Failure(clock=8, servers=(1,))], config=config)
    messages = [str(w.message) for w in caught if issubclass(w.category, DataLossWarning)]
    assert len(messages) == 1 and "rolling back every server and worker to checkpoint step 4" in messages[0]
    (event,) = failed.recoveries
    assert event.kind == "checkpoint" and event.recomputed_clocks == 4  # clocks 5..8 ran again
    assert failed.updates_lost == 0 and failed.worker_reruns > 0
    assert_identical(failed, clean)  # deterministic BSP replays the rolled-back clocks exactly


@pytest.mark.timeout(180)
def test_server_and_copy_holding_worker_together_exceed_k2(job: PSJob, tmp_path: Path) -> None:
    # k=2: a server plus a worker is k failures; the worker's unacknowledged updates are gone.
    config = cfg(workload="sparse_lr", replicas=2, checkpoint_dir=str(tmp_path), checkpoint_every=4)
    clean = baseline(job, config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        failed = job.run([Failure(clock=9, servers=(0,), workers=(2,), how="sigkill")], config=config)
    assert any(issubclass(w.category, DataLossWarning) for w in caught)
    assert [r.kind for r in failed.recoveries] == ["checkpoint"]
    assert failed.updates_lost == 0
    assert_identical(failed, clean)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["ray", "sigkill"])
def test_dead_worker_is_relaunched_and_rejoins(job: PSJob, how: str) -> None:
    config = cfg(workload="digits", optimizer="sgd", replicas=2)
    clean = baseline(job, config)
    pid_before = ray.get(job.workers[3].pid.remote())
    failed = job.run([Failure(clock=4, workers=(3,), how=how)], config=config)
    assert ray.get(job.workers[3].pid.remote()) != pid_before
    assert [(r.kind, r.workers) for r in failed.recoveries] == [("worker", [3])]
    assert failed.clocks == CLOCKS and len(failed.losses) == CLOCKS
    assert failed.updates_lost == 0
    assert_identical(failed, clean)


@pytest.mark.timeout(180)
def test_baselines_roll_back_and_recompute(job: PSJob, tmp_path: Path) -> None:
    config = cfg(
        workload="mf", optimizer="sgd", mode="checkpoint", checkpoint_dir=str(tmp_path), checkpoint_every=4
    )
    clean = baseline(job, config)
    killed, standby = {0: job.servers[0]}, job.spares[0]
    ckpt = job.run([Failure(clock=10, servers=(0,), how="sigkill")], config=config)
    assert_taken_over(job, killed, standby)  # the same standby path as FreeLauncher's
    (event,) = ckpt.recoveries
    assert (event.kind, event.recomputed_clocks) == ("checkpoint", 3)  # checkpoint after clock 7
    assert event.discarded_updates > 0 and ckpt.worker_reruns == 3 * 4
    assert_identical(ckpt, clean)
    assert CheckpointManager(tmp_path / "server0", read_only=True).steps()  # shards really hit the disk

    scratch = job.run(
        [Failure(clock=6, servers=(1,))], config=cfg(workload="mf", optimizer="sgd", mode="none")
    )
    (event,) = scratch.recoveries
    assert (event.kind, event.recomputed_clocks) == ("restart", 7)
    assert_identical(scratch, clean)


@pytest.mark.timeout(120)
def test_a_driver_joins_an_existing_cluster_by_address(job: PSJob) -> None:
    """The multi-machine path: another process attaches with ``address=`` and leaves the cluster up."""
    address = ray.get_runtime_context().gcs_address
    code = (
        "import sys; from crashsafe.ps import Failure, PSConfig, PSJob\n"
        "with PSJob(PSConfig(workload='mf', clocks=6, replicas=2), address=sys.argv[1]) as job:\n"
        "    r = job.run([Failure(clock=2, servers=(1,), how='sigkill')])\n"
        "print(r.updates_lost, r.recomputed_clocks, [e.kind for e in r.recoveries])\n"
    )
    out = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "0 0 ['replica']"
    assert ray.nodes() and all(n["Alive"] for n in ray.nodes())  # our cluster outlived that driver
