"""Checkpoints in a real S3 API (moto's server on 127.0.0.1) through fsspec: the manifest-last
commit, leftovers, racing writers, leases, SIGKILLed uploads, memory:// and file:// URLs."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import s3fs

import crashsafe as cs
import crashsafe._faults as faults
from crashsafe.codecs.registry import get_codec
from crashsafe.format.manifest import Manifest, PayloadEntry
from crashsafe.state.tree import flatten
from crashsafe.storage.base import Lock
from crashsafe.storage.layout import step_name
from crashsafe.storage.objectstore import FsspecStore
from crashsafe.storage.stores import open_store
from crashsafe.storage.writer import StepWriter

from .faultproxy import FaultProxy

SCRIPTS = Path(__file__).parent / "scripts"
SRC = Path(__file__).resolve().parents[2] / "src"


def _state(step: int, n: int = 1000) -> dict[str, Any]:
    return {"w": np.full(n, float(step)), "b": {"ints": np.arange(10) * step}, "step": step}


def _entry(writer: StepWriter, path: str, array: np.ndarray[Any, Any]) -> PayloadEntry:
    """``array`` written raw by ``writer``, as the payload ``path`` of a one-array state (``_tree``)."""
    put = writer.write_payload(array.data)
    where = (put.file, put.offset, put.nbytes, put.xxh3)
    return PayloadEntry(path, "numpy", str(array.dtype), array.shape, *where, get_codec("raw").get_config())


def _tree() -> dict[str, Any]:
    return {"t": "dict", "keys": ["w"], "vals": [{"t": "array", "id": 0}]}


def _is(state: dict[str, Any], step: int) -> None:
    assert state["step"] == step and np.all(state["w"] == float(step))
    assert np.array_equal(state["b"]["ints"], np.arange(10) * step)


def test_save_restore_verify_and_retention(bucket: str, options: dict[str, Any]) -> None:
    url = f"s3://{bucket}/run"
    with cs.CheckpointManager(url, storage_options=options, keep_last=2) as mgr:
        for step in range(1, 5):
            mgr.save(step, _state(step), metrics={"loss": 1 / step})
        mgr.wait()
        assert mgr.steps() == [3, 4]
    reader = cs.CheckpointManager(url, storage_options=options, read_only=True)
    live = _state(0)
    assert reader.restore(live) == 4
    _is(live, 4)
    _is(reader.load(3), 3)
    assert reader.manifest(4).metrics == {"loss": 0.25}
    report = cs.verify(url, storage_options=options)
    assert report.ok and report.intact == [3, 4] and report.leftovers == []


def test_delta_chains_and_a_large_multipart_payload(bucket: str, options: dict[str, Any]) -> None:
    """A 40 MiB tensor goes up in parts (no copy of the whole); Incremental chains read back."""
    url = f"s3://{bucket}/run"
    big = np.random.default_rng(0).standard_normal(5 << 20)  # 40 MiB of float64
    with cs.CheckpointManager(
        url, storage_options=options, keep_last=None, codec={"w": "incremental"}
    ) as mgr:
        for step in range(3):
            mgr.save(step, {"big": big + step, "w": np.full(100, float(step))})
    reader = cs.CheckpointManager(url, storage_options=options, read_only=True)
    assert reader.manifest(2).payloads[1].base == 1
    for step in range(3):
        loaded = reader.load(step)
        assert np.array_equal(loaded["big"], big + step) and np.all(loaded["w"] == step)
    assert cs.verify(url, storage_options=options).ok


def test_readers_see_only_committed_steps_and_leftovers_are_cleaned(
    bucket: str, options: dict[str, Any]
) -> None:
    url = f"s3://{bucket}/run"
    with cs.CheckpointManager(url, storage_options=options) as mgr:
        mgr.save(1, _state(1))
    store = FsspecStore(url, options)
    torn = StepWriter(store, 2)  # a writer that uploads and then dies before its manifest
    torn.write_payload(np.ones(1000).data)
    torn._draft._flush()  # type: ignore[attr-defined]  # push the shard up as a dying writer would have
    torn._draft._uploads[-1].result()  # type: ignore[attr-defined]
    fs = s3fs.S3FileSystem(**options)
    assert any("step_000000000002/data-" in key for key in fs.find(f"{bucket}/run"))
    assert store.steps() == [1]
    assert [s for s in range(4) if store.has_step(s)] == [1]  # a save's own question: one request
    reader = cs.CheckpointManager(url, storage_options=options, read_only=True)
    assert reader.steps() == [1] and reader.load()["step"] == 1
    assert cs.verify(url, storage_options=options).leftovers == [store.leftovers()[0]]
    writer = cs.CheckpointManager(url, storage_options=options)  # the next writer cleans up
    with writer, pytest.raises(cs.CheckpointExistsError, match="never overwritten"):
        writer.save(1, _state(9))
    fs.invalidate_cache()
    assert not any("step_000000000002" in key for key in fs.find(f"{bucket}/run"))


@pytest.mark.parametrize("where", ["dir", "s3"])
def test_a_writer_aborted_after_its_commit_leaves_the_step_whole(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """What a distributed leader does when an error follows its commit (a rank lost while the
    outcome goes out): abort. The committed step stays whole; an object store once deleted its data."""
    url, options = str(tmp_path / "run"), {}
    if where == "s3":
        url, options = f"s3://{request.getfixturevalue('bucket')}/run", request.getfixturevalue("options")
    store = open_store(url, storage_options=options or None, create=True)
    array = np.arange(1000, dtype=np.float64)
    tree, _ = flatten({"w": array})
    writer = StepWriter(store, 1)
    put = writer.write_payload(array.data)
    config = get_codec("raw").get_config()
    entry = PayloadEntry("w", "numpy", "float64", (1000,), put.file, put.offset, put.nbytes, put.xxh3, config)
    writer.commit(Manifest(1, time.time(), tree, (entry,), writer.files(), {}, {}))
    writer.abort()
    store.close()
    assert cs.verify(url, storage_options=options).ok
    reader = cs.CheckpointManager(url, storage_options=options, read_only=True)
    assert np.array_equal(reader.load(1)["w"], array)


def test_two_writers_racing_on_one_step_commit_exactly_once(bucket: str, options: dict[str, Any]) -> None:
    """S3's If-None-Match makes the manifest's creation the commit: the second commit is refused."""
    url = f"s3://{bucket}/run"
    first, second = StepWriter(FsspecStore(url, options), 7), StepWriter(FsspecStore(url, options), 7)
    entries = []
    for writer, value in ((first, 1.0), (second, 2.0)):
        entries.append(writer.write_payload(np.full(100, value).data))
    from crashsafe.format.manifest import Manifest, PayloadEntry
    from crashsafe.storage.writer import Written

    def manifest(writer: StepWriter, put: Written) -> Manifest:
        where = (put.file, put.offset, put.nbytes, put.xxh3)
        payload = PayloadEntry("w", "numpy", "float64", (100,), *where, {"id": "raw"})
        tree = {"t": "dict", "keys": ["w"], "vals": [{"t": "array", "id": 0}]}
        return Manifest(7, time.time(), tree, (payload,), writer.files())

    first.commit(manifest(first, entries[0]))
    with pytest.raises(cs.CheckpointExistsError, match="another writer"):
        second.commit(manifest(second, entries[1]))
    reader = cs.CheckpointManager(url, storage_options=options, read_only=True)
    assert np.all(reader.load(7)["w"] == 1.0)
    assert FsspecStore(url, options).leftovers() == []  # the loser removed its own shards


@pytest.mark.parametrize("scheme", ["s3", "file"])
def test_deleting_a_step_whose_manifest_is_gone_removes_its_shards(
    bucket: str, options: dict[str, Any], tmp_path: Path, scheme: str
) -> None:
    """A deletion cut short after the manifest (or whose answer to it was lost) leaves the shards;
    deleting the step again removes them. Where removing a missing object is an error (file://,
    memory://; S3 answers it with success), it stopped at the missing manifest and left them."""
    url, opts = (f"s3://{bucket}/run", options) if scheme == "s3" else (f"file://{tmp_path}/run", {})
    with cs.CheckpointManager(url, storage_options=opts, async_save=False) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    store = FsspecStore(url, opts)
    store.fs.rm_file(store.path(step_name(1), "manifest.json"))
    assert any(key.startswith(step_name(1)) for key in store._objects())  # the shards are there
    store.delete(1)
    assert not any(key.startswith(step_name(1)) for key in store._objects())
    assert cs.CheckpointManager(url, storage_options=opts, read_only=True).load()["step"] == 2


def test_a_second_writer_is_refused_while_the_lease_is_renewed(bucket: str, options: dict[str, Any]) -> None:
    url = f"s3://{bucket}/run"
    holder = FsspecStore(url, options, lease_seconds=3.0).lock()
    try:
        started = time.monotonic()
        with pytest.raises(cs.LockedError, match="keeps renewing its lease"):
            FsspecStore(url, options, lease_seconds=3.0).lock()
        assert time.monotonic() - started < 8
    finally:
        holder.release()
    FsspecStore(url, options).lock().release()  # released: free at once


def test_a_lease_renewal_whose_answer_was_lost_keeps_the_lease(
    bucket: str, options: dict[str, Any], proxy: FaultProxy
) -> None:
    """A renewal goes through but its answer is lost; the retry's compare-and-swap then fails
    against the very lease it wrote. The writer checks whose lease it is: still its own, so it
    writes on (it once took it for another writer's and stopped)."""
    url = f"s3://{bucket}/run"
    lease = FsspecStore(url, _through(proxy, options), lease_seconds=1.5).lock()
    try:
        proxy.fault("lose", seconds=30)  # the next answer is the first renewal's (after 0.5 s)
        time.sleep(2.0)  # that renewal, and the next ones
        assert proxy.counts["lose"] == 1
        lease.check()  # not lost
        with pytest.raises(cs.LockedError, match="keeps renewing its lease"):
            FsspecStore(url, options, lease_seconds=1.5).lock()
    finally:
        lease.release()


def test_a_lease_taken_whose_answer_was_lost_is_taken_at_once(
    bucket: str, options: dict[str, Any], proxy: FaultProxy
) -> None:
    """Creating the lease goes through but its answer is lost: the retry finds a lease, its own,
    and takes it at once instead of watching it for a lease's length as another writer's."""
    url = f"s3://{bucket}/run"
    proxy.fault("lose", seconds=30)
    started = time.monotonic()
    lease = FsspecStore(url, _through(proxy, options), lease_seconds=6.0).lock()
    try:
        assert proxy.counts["lose"] == 1 and time.monotonic() - started < 3
        lease.check()
    finally:
        lease.release()


def test_a_huge_lock_object_is_read_no_further_than_a_lease(
    bucket: str, options: dict[str, Any], proxy: FaultProxy
) -> None:
    """A 32 MiB ``.lock`` is no lease of ours (unreadable, so free to take): the writer takes it
    after reading a few KiB of it over the wire, never the whole object into memory."""
    url = f"s3://{bucket}/run"
    s3fs.S3FileSystem(**options).pipe_file(f"{bucket}/run/.lock", b"x" * (32 << 20))
    lease = FsspecStore(url, _through(proxy, options), lease_seconds=3.0).lock()
    try:
        lease.check()
        assert proxy.answered < 64 << 10
    finally:
        lease.release()
    assert not s3fs.S3FileSystem(**options).exists(f"{bucket}/run/.lock")  # released: gone


def test_an_expired_lease_of_another_host_is_taken_over(bucket: str, options: dict[str, Any]) -> None:
    url = f"s3://{bucket}/run"
    fs = s3fs.S3FileSystem(**options)
    expires = time.time() + 1.5
    fs.pipe_file(f"{bucket}/run/.lock", b'{"holder": "gone-host:1:x", "expires": %f}' % expires)
    with cs.CheckpointManager(url, storage_options=options) as mgr:  # waits out the lease, then takes it
        taken = time.time()  # (measured from the lease's end: a slow upload above shortens the wait)
        mgr.save(1, _state(1))
    assert expires <= taken < expires + 10


def test_a_writer_that_lost_its_lease_stops(bucket: str, options: dict[str, Any]) -> None:
    url = f"s3://{bucket}/run"
    mgr = cs.CheckpointManager(url, storage_options=options, async_save=False)
    mgr.save(1, _state(1))
    fs = s3fs.S3FileSystem(**options)  # another writer takes the lease over (as after a long pause)
    fs.pipe_file(f"{bucket}/run/.lock", b'{"holder": "other:1:y", "expires": %f}' % (time.time() + 60))
    time.sleep(0.1)
    mgr._tiers._lock._expires = 0.0  # type: ignore[union-attr]  # as if this writer had been paused past its lease
    with pytest.raises(cs.LockedError, match="expired before it could be renewed"):
        mgr.save(2, _state(2))
    assert mgr._tiers._lock._renew() is False  # type: ignore[union-attr]  # (what its renewer finds next)
    mgr.close()
    assert cs.CheckpointManager(url, storage_options=options, read_only=True).steps() == [1]


def _until_checked(lease: Lock, match: str | None = None, seconds: float = 30.0) -> None:
    """Wait until ``lease.check()`` passes (``match`` None) or raises LockedError matching ``match``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            lease.check()
            if match is None:
                return
        except cs.LockedError as exc:
            if match is not None and match in str(exc):
                return
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def test_a_writer_cut_off_past_its_lease_commits_and_deletes_nothing_once_taken_over(
    bucket: str, options: dict[str, Any], proxy: FaultProxy
) -> None:
    """A writer's link to the store is down for longer than its lease, and another writer takes
    over meanwhile. Its failed renewals pushed its own expiry forward, so it went on saving beside
    that writer, and its retention deleted that writer's steps. Now its lease expires on time, and
    a commit or a deletion checks the lease right before it happens (not only when a save starts):
    a writer paused there past its lease committed a step whose shards the new writer had removed.
    Once its link is back it finds the other holder and stops for good."""
    url = f"s3://{bucket}/run"
    store = FsspecStore(url, _through(proxy, options), lease_seconds=2.0)
    lease = store.lock()
    writer = StepWriter(store, 1)
    entry = _entry(writer, "w", np.ones(1000))
    proxy.fault("drop")
    time.sleep(3.0)  # past the lease, every renewal failing
    with pytest.raises(cs.LockedError, match="expired before it could be renewed"):
        lease.check()
    other = FsspecStore(url, options, lease_seconds=2.0).lock()  # takes over the expired lease
    proxy.fault("pass", 0)  # the link is back: only the lease stops this writer now
    with pytest.raises(cs.LockedError):
        writer.commit(Manifest(1, time.time(), _tree(), (entry,), writer.files()))
    with pytest.raises(cs.LockedError):
        store.delete(1)
    _until_checked(lease, "another writer took over")  # for good: its next renewal found the other
    lease.release()
    other.release()
    assert FsspecStore(url, options).steps() == []


def test_a_writer_cut_off_past_its_lease_resumes_when_no_one_took_over(
    bucket: str, options: dict[str, Any], proxy: FaultProxy
) -> None:
    """An outage longer than the lease, and no other writer: the lease still names this writer,
    so its next renewal takes it again and the writer commits again (it stopped for good)."""
    url = f"s3://{bucket}/run"
    store = FsspecStore(url, _through(proxy, options), lease_seconds=2.0)
    lease = store.lock()
    proxy.fault("drop")
    time.sleep(3.0)
    with pytest.raises(cs.LockedError, match="commits and deletes nothing until a renewal goes through"):
        lease.check()
    proxy.fault("pass", 0)
    _until_checked(lease)  # renewed
    writer = StepWriter(store, 1)
    writer.commit(Manifest(1, time.time(), _tree(), (_entry(writer, "w", np.ones(10)),), writer.files()))
    assert FsspecStore(url, options).steps() == [1]
    lease.release()


def test_a_mirror_whose_lease_was_taken_over_writes_and_deletes_nothing(
    tmp_path: Path, bucket: str, options: dict[str, Any]
) -> None:
    """The mirror thread never checked its lease: after another writer took the mirror over, it
    went on uploading there, and its retention deleted that writer's steps."""
    url = f"s3://{bucket}/run"
    mgr = cs.CheckpointManager(tmp_path / "local", mirror=url, storage_options=options, mirror_keep_last=1)
    mgr.save(1, _state(1))
    assert mgr.wait_mirror(60)
    assert mgr._tiers._mirror is not None
    mgr._tiers._mirror._lock._lost = "another writer took over the lease"  # type: ignore[attr-defined]
    other = FsspecStore(url, options)  # that writer's step (its lease is not what this test is about)
    writer = StepWriter(other, 5)
    writer.commit(Manifest(5, time.time(), _tree(), (_entry(writer, "w", np.ones(10)),), writer.files()))
    with pytest.warns(cs.MirrorWarning, match="another writer took over"):
        mgr.save(2, _state(2))
        mgr.wait_mirror(60)
        mgr.save(3, _state(3))
    assert FsspecStore(url, options).steps() == [1, 5]  # nothing uploaded, nothing deleted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.close()  # it said so at each save, and says it once more as the job ends
    said = [str(w.message) for w in caught if issubclass(w.category, cs.MirrorWarning)]
    assert any("closing with steps [2, 3] not in the mirror" in m and "stale" in m for m in said), said


def test_a_step_deleted_while_it_is_read_has_vanished_not_failed(
    bucket: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's retention deletes a step between a reader's manifest and its shards: verify
    leaves it out and load goes on to the step before, no damage reported. verify raised a bare
    FileNotFoundError, and load took the step for damage."""
    import crashsafe.storage.objectstore as objectstore

    url = f"s3://{bucket}/run"
    writer = cs.CheckpointManager(url, storage_options=options, keep_last=None, async_save=False)
    fetch, doomed = objectstore._ObjectFile._fetch, []

    def deleting(self: Any, starts: list[int], ends: list[int]) -> list[bytes]:
        if doomed and f"/{step_name(doomed[0])}/" in self._path:
            writer.delete([doomed.pop()])  # as the writer's retention does, mid-read
        return fetch(self, starts, ends)  # type: ignore[no-any-return]

    monkeypatch.setattr(objectstore._ObjectFile, "_fetch", deleting)
    for step in (1, 2, 3):
        writer.save(step, _state(step))
    with warnings.catch_warnings():
        warnings.simplefilter("error", cs.CorruptCheckpointWarning)
        doomed.append(3)
        assert cs.verify(url, storage_options=options).intact == [1, 2]
        doomed.append(2)
        _is(cs.CheckpointManager(url, storage_options=options, read_only=True).load(), 1)
    writer.close()


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_other_fsspec_urls(tmp_path: Path, scheme: str) -> None:
    url = f"memory://crashsafe-test-{time.time_ns()}/run" if scheme == "memory" else f"file://{tmp_path}/run"
    with cs.CheckpointManager(url, keep_last=2, codec="zstd") as mgr:
        for step in range(1, 4):
            mgr.save(step, _state(step))
    reader = cs.CheckpointManager(url, read_only=True)
    assert reader.steps() == [2, 3]
    _is(reader.load(), 3)
    assert cs.verify(url).ok


# every named point of the object store's save (data, uploads, lease check, manifest) and of its
# retention's deletions (manifest first, then the data)
AIMED = ("mid_data", *faults.OBJECT_COMMIT_POINTS, "mid_delete")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkilled_uploads_never_damage_committed_steps(
    s3_endpoint: str, bucket: str, options: dict[str, Any]
) -> None:
    """14 real SIGKILLs of a writer: 7 at random moments of its uploads, and 7 aimed, one at each
    named point of an object store's commit and deletion protocol (the writer kills itself the
    4th time it gets there: crashsafe._faults), so every point is reached for sure, which the 20
    random kills this test once made did not promise. After each, every committed step verifies
    (verify decodes every payload, as load does) and the newest loads exactly; leftovers are
    invisible; the restarted writer (same host, dead holder) takes the lease at once."""
    url = f"s3://{bucket}/run"
    rng = random.Random(42)
    env = {"PYTHONPATH": str(SRC), "PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin"}
    seen: set[int] = set()
    for trial, aim in enumerate(x for point in AIMED for x in (None, point)):
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "s3_writer.py"), s3_endpoint, url, str(trial)],
            env={**env, "CRASHSAFE_KILL_AT": f"{aim}:4"} if aim else env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        if aim is None:
            line = proc.stdout.readline().strip()
            assert line == "ready", proc.stderr.read()
            time.sleep(rng.uniform(0.0, 0.3))
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
        assert proc.returncode == -signal.SIGKILL, (aim, proc.stderr.read())
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
        report = cs.verify(url, storage_options=options)
        assert report.ok, (aim, [d.problem for d in report.damaged])
        seen.update(report.intact)
    reader = cs.CheckpointManager(url, storage_options=options, read_only=True)
    for step in reader.steps():
        state = reader.load(step)
        assert state["step"] == step and np.all(state["big"] == step)
        assert all(np.all(v == step) for v in state["small"].values())
    assert len(seen) > 20


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    """A misbehaving proxy on 127.0.0.1 in front of the S3 test server."""
    fault_proxy = FaultProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    try:
        yield fault_proxy
    finally:
        fault_proxy.close()


def _through(proxy: FaultProxy, options: dict[str, Any], attempts: int | None = None) -> dict[str, Any]:
    """Options reaching S3 through the proxy (crashsafe's five attempts unless ``attempts`` is given,
    botocore's own retries off)."""
    client = {**options["client_kwargs"], "endpoint_url": proxy.endpoint}
    if attempts is None:
        return {**options, "client_kwargs": client}
    retries = {"retries": {"total_max_attempts": attempts}}
    return {**options, "client_kwargs": client, "config_kwargs": retries}


@pytest.mark.parametrize("mode", ["503", "drop", "delay"])
def test_saves_ride_out_a_flaky_network(
    bucket: str, options: dict[str, Any], proxy: FaultProxy, mode: str
) -> None:
    """503 answers, reset connections or a slow link for a while: the save retries and commits."""
    url = f"s3://{bucket}/run"
    with cs.CheckpointManager(url, storage_options=_through(proxy, options), async_save=False) as mgr:
        mgr.save(1, _state(1))
        proxy.fault(mode, seconds=1.0)
        mgr.save(2, _state(2))
        assert proxy.counts[mode] > 0  # the fault really hit requests
    _is(cs.CheckpointManager(url, storage_options=options, read_only=True).load(), 2)


def test_a_lasting_outage_fails_clearly_and_commits_nothing(
    bucket: str, options: dict[str, Any], proxy: FaultProxy
) -> None:
    """A store that answers 503 to every request fails the save after its attempts (two here: the
    default five only wait longer for the same error), naming them, and commits nothing."""
    url = f"s3://{bucket}/run"
    mgr = cs.CheckpointManager(url, storage_options=_through(proxy, options, attempts=2), async_save=False)
    mgr.save(1, _state(1))
    proxy.fault("503")
    started = time.monotonic()
    with pytest.raises(cs.StorageError, match="failed 2 times.*does not answer"):
        mgr.save(2, _state(2))
    assert time.monotonic() - started < 30
    proxy.fault("pass", 0)
    mgr.close()
    reader = cs.CheckpointManager(url, storage_options=options, read_only=True)
    assert reader.steps() == [1] and cs.verify(url, storage_options=options).ok


def test_a_commit_whose_answer_was_lost_stands_whole(
    bucket: str, options: dict[str, Any], proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest's upload reaches the store but its answer is lost (a reset connection): the
    retry finds the manifest already there. It is this writer's own, so the step is committed and
    its data stay (the writer once took it for another writer's and deleted its own data files)."""
    url = f"s3://{bucket}/run"
    reached = faults.reached

    def lose_the_manifests_answer(point: str) -> None:
        if point == "after_lease_check":  # the data are up; the manifest's upload comes next
            proxy.fault("lose", seconds=30)
        reached(point)

    with cs.CheckpointManager(url, storage_options=_through(proxy, options), async_save=False) as mgr:
        mgr.save(1, _state(1))
        monkeypatch.setattr(faults, "reached", lose_the_manifests_answer)
        mgr.save(2, _state(2))
        monkeypatch.setattr(faults, "reached", reached)
        assert proxy.counts["lose"] == 1  # the fault really hit the manifest's answer
        mgr.save(3, _state(3))
    assert cs.verify(url, storage_options=options).ok
    reader = cs.CheckpointManager(url, storage_options=options, read_only=True)
    assert reader.steps() == [1, 2, 3]
    _is(reader.load(2), 2)


def test_a_commit_the_store_cannot_confirm_keeps_its_data_and_says_so(
    bucket: str, options: dict[str, Any], proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store goes down just as the manifest is uploaded: the writer cannot learn whether its
    commit arrived, so it deletes nothing (the shards would be that commit's data) and says so;
    the next writer removes the shards once it sees no manifest names them. (Two attempts per call:
    the default five only waited longer for the same outcome.)"""
    url = f"s3://{bucket}/run"
    reached = faults.reached

    def outage_before_the_manifest(point: str) -> None:
        if point == "after_lease_check":
            proxy.fault("503")
        reached(point)

    through = _through(proxy, options, attempts=2)
    with cs.CheckpointManager(url, storage_options=through, async_save=False) as mgr:
        mgr.save(1, _state(1))
        monkeypatch.setattr(faults, "reached", outage_before_the_manifest)
        with pytest.raises(cs.StorageError, match="cannot say now whether the manifest arrived"):
            mgr.save(2, _state(2))
        monkeypatch.setattr(faults, "reached", reached)
        proxy.fault("pass", 0)
    store = FsspecStore(url, options)
    assert store.steps() == [1] and any(name.startswith("step_000000000002/") for name in store.leftovers())
    cs.CheckpointManager(url, storage_options=options).close()  # the next writer cleans up
    assert FsspecStore(url, options).leftovers() == []
    _is(cs.CheckpointManager(url, storage_options=options, read_only=True).load(), 1)


def test_a_restore_whose_steps_are_all_deleted_mid_read_says_so(
    bucket: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object store's step goes with its objects: the writer deletes every step while a restore
    reads step 2 into the live state. The restore returned None, as if there had been no step at
    all, over a live state it had begun to overwrite; it says what happened."""
    import crashsafe.storage.objectstore as objectstore

    url = f"s3://{bucket}/run"
    writer = cs.CheckpointManager(url, storage_options=options, keep_last=None, async_save=False)
    for step in (1, 2):
        writer.save(step, _state(step))
    fetch, doomed = objectstore._ObjectFile._fetch, [2, 1]

    def deleting(self: Any, starts: list[int], ends: list[int]) -> list[bytes]:
        if doomed and f"/{step_name(2)}/" in self._path:
            writer.delete(doomed)  # as the writer's retention does, mid-read
            doomed.clear()
        return fetch(self, starts, ends)  # type: ignore[no-any-return]

    monkeypatch.setattr(objectstore._ObjectFile, "_fetch", deleting)
    live = {"w": np.zeros(1000), "b": {"ints": np.zeros(10, dtype=np.int64)}, "step": 0}
    reader = cs.CheckpointManager(url, storage_options=options, read_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", cs.CorruptCheckpointWarning)  # deleted is not damaged
        with pytest.raises(cs.NoCheckpointError) as caught:
            reader.restore(live)
    assert not doomed and writer.steps() == []
    message = str(caught.value)
    assert "deleted while it was read" in message and "damage" not in message
    assert "partly overwritten by step 2, which was deleted while it was read" in message
    writer.close()
