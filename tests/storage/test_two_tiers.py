"""Two tiers: commit locally at disk speed, mirror every step to S3 in the background (moto on
127.0.0.1), verified after upload, with its own retention; restore from either tier."""

from __future__ import annotations

import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import s3fs

import crashsafe as cs
import crashsafe.storage.objectstore as objectstore
from crashsafe.storage.layout import step_dir, step_name

from .faultproxy import FaultProxy


def _state(step: int) -> dict[str, Any]:
    return {"w": np.full(2000, float(step)), "n": np.arange(10) * step, "step": step}


def _is(state: dict[str, Any], step: int) -> None:
    assert (
        state["step"] == step
        and np.all(state["w"] == step)
        and np.array_equal(state["n"], np.arange(10) * step)
    )


def test_every_step_reaches_the_mirror_and_each_tier_keeps_its_own(
    tmp_path: Path, bucket: str, options: dict[str, Any]
) -> None:
    mirror = f"s3://{bucket}/run"
    with cs.CheckpointManager(
        tmp_path / "local", keep_last=1, mirror=mirror, storage_options=options, mirror_keep_last=3
    ) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step))
        assert mgr.wait_mirror(timeout=60)
    local = cs.CheckpointManager(tmp_path / "local", read_only=True)
    remote = cs.CheckpointManager(mirror, storage_options=options, read_only=True)
    assert local.steps() == [5] and remote.steps() == [3, 4, 5]
    report = cs.verify(mirror, storage_options=options)
    assert report.ok and report.intact == [3, 4, 5]
    for step in (3, 4, 5):
        _is(remote.load(step), step)


def test_a_second_manager_with_the_same_mirror_uploads_through_a_live_loop(
    tmp_path: Path, bucket: str, options: dict[str, Any]
) -> None:
    """The mirror uploads through a client on an event loop of its own, stopped when it closes.
    fsspec's instance cache keyed that client by the loop's text, the same for every running loop:
    the next manager in the process got the first one's client on its stopped loop, and every
    upload failed ("Loop is not running"). Each mirror now gets a client of its own."""
    shared = {k: v for k, v in options.items() if k != "skip_instance_cache"}  # (as users pass them)
    mirror = f"s3://{bucket}/run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2):
            local = tmp_path / f"local-{step}"
            with cs.CheckpointManager(local, mirror=mirror, storage_options=shared) as mgr:
                mgr.save(step, _state(step))
                assert mgr.wait_mirror(timeout=60)
    assert not [str(w.message) for w in caught if issubclass(w.category, cs.MirrorWarning)]
    assert cs.CheckpointManager(mirror, storage_options=options, read_only=True).steps() == [1, 2]


def test_a_new_machine_with_an_empty_directory_resumes_from_the_mirror(
    tmp_path: Path, bucket: str, options: dict[str, Any]
) -> None:
    mirror = f"s3://{bucket}/run"
    with cs.CheckpointManager(tmp_path / "old-machine", mirror=mirror, storage_options=options) as mgr:
        for step in range(1, 4):
            mgr.save(step, _state(step))
    shutil.rmtree(tmp_path / "old-machine")  # the machine is gone
    live = _state(0)
    with cs.CheckpointManager(tmp_path / "new-machine", mirror=mirror, storage_options=options) as mgr:
        assert mgr.restore(live) == 3
        _is(live, 3)
        mgr.save(4, _state(4))
    assert cs.CheckpointManager(mirror, storage_options=options, read_only=True).steps() == [1, 2, 3, 4]


def test_delta_chains_reach_the_mirror_base_first(
    tmp_path: Path, bucket: str, options: dict[str, Any]
) -> None:
    """Local retention keeps one step, but never a step (or base) not yet mirrored: every mirrored
    delta can be read from the mirror alone."""
    mirror = f"s3://{bucket}/run"
    codec = {"w": cs.codecs.Incremental(full_every=4)}
    with cs.CheckpointManager(
        tmp_path / "local", keep_last=1, codec=codec, mirror=mirror, storage_options=options
    ) as mgr:
        for step in range(1, 7):
            mgr.save(step, _state(step))
    shutil.rmtree(tmp_path / "local")
    remote = cs.CheckpointManager(mirror, storage_options=options, read_only=True)
    assert remote.manifest(6).payloads[0].base == 5
    for step in range(1, 7):
        _is(remote.load(step), step)


def test_a_damaged_local_step_falls_back_to_its_mirror_copy(
    tmp_path: Path, bucket: str, options: dict[str, Any]
) -> None:
    mirror = f"s3://{bucket}/run"
    with cs.CheckpointManager(tmp_path / "local", mirror=mirror, storage_options=options) as mgr:
        for step in range(1, 3):
            mgr.save(step, _state(step), metrics={"loss": step})
    data = step_dir(tmp_path / "local", 2) / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    reader = cs.CheckpointManager(tmp_path / "local", mirror=mirror, storage_options=options, read_only=True)
    live = _state(0)
    with pytest.warns(cs.CorruptCheckpointWarning, match="checksum"):
        assert reader.restore(live) == 2  # step 2 again, from the mirror
    _is(live, 2)
    # so does a step asked for by number or as the best: they failed on the damaged local copy
    for kwargs in ({"step": 2}, {"step": "best", "metric": "loss", "mode": "max"}):
        live = _state(0)
        with pytest.warns(cs.CorruptCheckpointWarning, match="Reading step 2 from the next tier"):
            assert reader.restore(live, **kwargs) == 2
        _is(live, 2)
    with pytest.warns(cs.CorruptCheckpointWarning, match="next tier"):
        _is(reader.load(2), 2)


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    fault_proxy = FaultProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    try:
        yield fault_proxy
    finally:
        fault_proxy.close()


def test_a_mirror_outage_never_stops_training(
    tmp_path: Path, bucket: str, options: dict[str, Any], proxy: FaultProxy
) -> None:
    """With the mirror unreachable, saves go on locally (each warns that its step waits); once the
    mirror is back, every waiting step reaches it."""
    client = {**options["client_kwargs"], "endpoint_url": proxy.endpoint}
    flaky = {**options, "client_kwargs": client, "config_kwargs": {"retries": {"max_attempts": 1}}}
    mirror = f"s3://{bucket}/run"
    with cs.CheckpointManager(tmp_path / "local", keep_last=1, mirror=mirror, storage_options=flaky) as mgr:
        mgr.save(1, _state(1))
        assert mgr.wait_mirror(timeout=60)
        proxy.fault("drop")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2, 4):
                mgr.save(step, _state(step))
                mgr.wait()
            assert not mgr.wait_mirror(timeout=60)  # tried, failed for now
        assert any(issubclass(w.category, cs.MirrorWarning) for w in caught)
        local = cs.CheckpointManager(tmp_path / "local", read_only=True)
        assert local.steps() == [2, 3]  # local retention keeps what the mirror lacks
        proxy.fault("pass", 0)
        mgr.save(4, _state(4))  # the next save retries the waiting steps
        assert mgr.wait_mirror(timeout=60)
    remote = cs.CheckpointManager(mirror, storage_options=options, read_only=True)
    assert remote.steps() == [1, 2, 3, 4] and cs.verify(mirror, storage_options=options).ok


def test_a_step_saved_again_after_a_rewind_replaces_the_mirrors_older_save(tmp_path: Path) -> None:
    """Step 1 is deleted locally (keep_last=1) but kept in the mirror; the run rewinds and saves
    step 1 again with other contents: the mirror must hold the new save, not keep its old one."""
    mirror = f"file://{tmp_path / 'remote'}"
    with cs.CheckpointManager(tmp_path / "local", keep_last=1, mirror=mirror) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        assert mgr.wait_mirror(timeout=60)
        mgr.save(1, _state(100))  # the rewound run's step 1
        assert mgr.wait_mirror(timeout=60)
    remote = cs.CheckpointManager(mirror, read_only=True)
    assert remote.steps() == [1, 2]
    _is(remote.load(1), 100)
    _is(remote.load(2), 2)


def test_a_step_saved_again_while_the_mirror_was_away_reaches_it(tmp_path: Path) -> None:
    """A run rewinds and saves step 3 again while its mirror is not with it (the upload never
    happened: a job killed first, or run without ``mirror=``). The next manager with the mirror
    must upload that save over the mirror's older one before local retention may drop it. It only
    queued steps whose number the mirror lacked, so local retention deleted the new save, the only
    copy, and the mirror served the old one."""
    local, mirror = tmp_path / "local", f"file://{tmp_path / 'remote'}"
    with cs.CheckpointManager(local, keep_last=1, mirror=mirror, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        assert mgr.wait_mirror(timeout=60)
    with cs.CheckpointManager(local, keep_last=None, async_save=False) as mgr:  # no mirror this time
        mgr.delete([3])
        mgr.save(3, _state(33))
    with cs.CheckpointManager(local, keep_last=1, mirror=mirror, async_save=False) as mgr:
        mgr.save(4, _state(4))
        assert mgr.wait_mirror(timeout=60)
        mgr.save(5, _state(5))  # retention: step 3 may go locally only once the mirror has it
        assert mgr.wait_mirror(timeout=60)
    assert cs.CheckpointManager(local, read_only=True).steps() == [5]
    _is(cs.CheckpointManager(mirror, read_only=True).load(3), 33)


def test_a_damaged_mirror_copy_never_counts_as_mirrored(
    tmp_path: Path, bucket: str, options: dict[str, Any]
) -> None:
    """The mirror's copy of step 2 has a flipped byte in its shard. Reopened with keep_last=1, the
    manager took step 2 for mirrored because the manifests matched, and a save deleted the local
    step 2, the only intact copy, without a word. Now the mirror's bytes are read back and
    checksummed: the damage is reported, the local copy replaces it, and only then may the local
    step go; step 2 stays intact in one tier or the other throughout."""
    mirror = f"s3://{bucket}/run"
    local = tmp_path / "local"
    with cs.CheckpointManager(local, keep_last=None, mirror=mirror, storage_options=options) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    fs = s3fs.S3FileSystem(**options)
    (shard,) = [key for key in fs.find(f"{bucket}/run/{step_name(2)}") if "/data-" in key]
    raw = bytearray(fs.cat_file(shard))
    raw[100] ^= 0x01
    fs.pipe_file(shard, bytes(raw))
    with (
        pytest.warns(cs.MirrorWarning, match=r"mirror's copy of step 2 .* is damaged.*checksum"),
        cs.CheckpointManager(local, keep_last=1, mirror=mirror, storage_options=options) as mgr,
    ):
        mgr.save(3, _state(3))
        assert mgr.wait_mirror(timeout=60)  # the mirror thread checked (and repaired) step 2
    report = cs.verify(mirror, storage_options=options)
    assert report.ok and report.intact == [1, 2, 3]  # the local copy went only once this held
    _is(cs.CheckpointManager(mirror, storage_options=options, read_only=True).load(2), 2)
    assert cs.CheckpointManager(local, read_only=True).steps() == [3]


def test_a_mirror_whose_lease_expired_in_an_outage_uploads_again(
    tmp_path: Path, bucket: str, options: dict[str, Any], proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mirror is cut off for longer than its lease. Its lease expired, a MirrorWarning said
    "this writer stopped", and nothing was uploaded again once the mirror was back (a new machine
    restored step 1 of 10). Now the lease, still naming this writer (no other took over), is renewed
    once the mirror answers, and the waiting steps are uploaded."""
    # 3 s: a lease of 1.5 s expired in the full suite before the mirror's first upload was done (making
    # its two S3 clients and moto's answers hold the GIL from the renewing thread for over a second)
    monkeypatch.setattr(objectstore, "LEASE_SECONDS", 3.0)
    client = {**options["client_kwargs"], "endpoint_url": proxy.endpoint}
    flaky = {**options, "client_kwargs": client, "config_kwargs": {"retries": {"total_max_attempts": 2}}}
    mirror = f"s3://{bucket}/run"
    with cs.CheckpointManager(tmp_path / "local", keep_last=1, mirror=mirror, storage_options=flaky) as mgr:
        mgr.save(1, _state(1))
        assert mgr.wait_mirror(timeout=60)
        proxy.fault("drop")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.save(2, _state(2))
            time.sleep(4.0)  # the outage outlasts the lease
            mgr.save(3, _state(3))
            assert not mgr.wait_mirror(timeout=60)
            proxy.fault("pass", 0)  # the mirror is back
            assert mgr._tiers._mirror is not None
            deadline = time.monotonic() + 30
            while True:  # its lease renewed in the background (or the test gives up)
                try:
                    mgr._tiers._mirror._lock.check()
                    break
                except cs.LockedError:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
            mgr.save(4, _state(4))  # the next save retries the waiting steps
            assert mgr.wait_mirror(timeout=60)
        said = [str(w.message) for w in caught if issubclass(w.category, cs.MirrorWarning)]
        assert any("lease" in message and "expired" in message for message in said), said
    remote = cs.CheckpointManager(mirror, storage_options=options, read_only=True)
    assert remote.steps() == [1, 2, 3, 4] and cs.verify(mirror, storage_options=options).ok


def test_a_mirror_unreachable_when_the_manager_opens_never_stops_training(
    tmp_path: Path, bucket: str, options: dict[str, Any], proxy: FaultProxy
) -> None:
    """A mirror that did not answer when the manager opened failed the job with a StorageError
    (after about 100 s of its default bounds) instead of training locally. Now the manager opens
    with a MirrorWarning, saves locally, keeps what the mirror lacks, and connects (creates the
    location, takes the lease) at the first save that finds it answering."""
    client = {**options["client_kwargs"], "endpoint_url": proxy.endpoint}
    flaky = {**options, "client_kwargs": client, "config_kwargs": {"retries": {"total_max_attempts": 2}}}
    mirror = f"s3://{bucket}/run"
    proxy.fault("drop")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = cs.CheckpointManager(tmp_path / "local", keep_last=1, mirror=mirror, storage_options=flaky)
        for step in (1, 2):
            mgr.save(step, _state(step))
        assert not mgr.wait_mirror(timeout=60)  # tried, failed for now
        mgr.save(3, _state(3))  # (reports the failed try)
        mgr.wait()
    said = [str(w.message) for w in caught if issubclass(w.category, cs.MirrorWarning)]
    assert any("cannot be reached" in m and "Training goes on without it" in m for m in said), said
    assert any("connecting to the mirror" in m and "the mirror lacks steps [1, 2]" in m for m in said), said
    assert cs.CheckpointManager(tmp_path / "local", read_only=True).steps() == [1, 2, 3]  # kept
    proxy.fault("pass", 0)
    mgr.save(4, _state(4))  # the next save finds the mirror answering
    assert mgr.wait_mirror(timeout=60)
    mgr.close()
    remote = cs.CheckpointManager(mirror, storage_options=options, read_only=True)
    assert remote.steps() == [1, 2, 3, 4] and cs.verify(mirror, storage_options=options).ok
    assert cs.CheckpointManager(tmp_path / "local", read_only=True).steps() == [4]


def test_a_mirror_another_writer_holds_still_fails_the_open(
    tmp_path: Path, bucket: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a mirror that does not answer is left for later: one that answers that another job is
    writing it (its lease renewed) is a mistake to stop at, as before. (A lease of 3 s: at 1.5 s the
    holder's renewals, on the event loop where the manager made its S3 clients, once came too late.)"""
    monkeypatch.setattr(objectstore, "LEASE_SECONDS", 3.0)
    mirror = f"s3://{bucket}/run"
    holder = objectstore.FsspecStore(mirror, options, lease_seconds=3.0).lock()
    try:
        with pytest.raises(cs.LockedError, match="keeps renewing its lease"):
            cs.CheckpointManager(tmp_path / "local", mirror=mirror, storage_options=options)
    finally:
        holder.release()


def test_a_step_asked_for_whose_every_copy_is_damaged_leaves_the_live_state_as_it_was(tmp_path: Path) -> None:
    """``restore(step=2)`` verifies each copy of step 2 before it writes into the live state (the step
    that ``step=`` names has no other step to fall back to). The fallback loop shared with ``step=None``
    wrote the damaged local copy into the live state because the mirror's copy was left, and when that
    one was damaged too the live state was left half written."""
    mirror = f"file://{tmp_path / 'remote'}"
    with cs.CheckpointManager(tmp_path / "local", mirror=mirror, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
        assert mgr.wait_mirror(timeout=60)
    for root in (tmp_path / "local", tmp_path / "remote"):
        data = next(p for p in step_dir(root, 2).iterdir() if p.name.startswith("data"))
        raw = bytearray(data.read_bytes())
        raw[100] ^= 0xFF
        data.write_bytes(bytes(raw))
    reader = cs.CheckpointManager(tmp_path / "local", mirror=mirror, read_only=True)
    live = _state(0)
    warned = pytest.warns(cs.CorruptCheckpointWarning, match="Reading step 2 from the next tier")
    with warned, pytest.raises(cs.CorruptCheckpointError, match="checksum") as raised:
        reader.restore(live, step=2)
    assert "overwritten" not in str(raised.value)
    _is(live, 0)
