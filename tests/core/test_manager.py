"""Manager behaviour: retention, no overwrite, one writer, errors that name the next step."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crashsafe as cs
import crashsafe._faults as faults
from crashsafe.storage.layout import committed_steps, step_dir


def _state(step: int, n: int = 1000) -> dict[str, Any]:
    return {"w": np.full(n, float(step)), "step": step}


def test_keep_last_and_keep_every(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path, keep_last=2, keep_every=5) as mgr:
        for step in range(1, 13):
            mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.steps() == [5, 10, 11, 12]
        assert mgr.latest_step() == 12
        assert mgr.load(10)["step"] == 10


def test_keep_last_none_keeps_everything(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in range(6):
            mgr.save(step, _state(step))
    assert committed_steps(tmp_path) == list(range(6))


def test_committed_step_is_never_overwritten(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(7, _state(7))
        mgr.wait()
        with pytest.raises(cs.CheckpointExistsError, match="never overwritten"):
            mgr.save(7, _state(99))
        assert mgr.load(7)["w"][0] == 7.0


def test_a_step_made_behind_the_writers_back_is_never_overwritten(tmp_path: Path) -> None:
    """A save asks the store only about the steps its last background save listed (the writer holds
    the lock, so any other step is new): a step copied in by hand after that listing is found by the
    commit, which refuses it, leaving the copy as it was; a listed step deleted by hand is saved again."""
    other = tmp_path / "other"
    with cs.CheckpointManager(other, async_save=False) as mgr:
        mgr.save(5, _state(55))
    ckpt = tmp_path / "ckpt"
    with cs.CheckpointManager(ckpt, keep_last=None) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        mgr.wait()
        shutil.copytree(step_dir(other, 5), step_dir(ckpt, 5))
        mgr.save(5, _state(5))  # returns after the copy: the commit finds the step
        with pytest.raises(cs.CheckpointExistsError, match="never overwritten"):
            mgr.wait()
        shutil.rmtree(step_dir(ckpt, 1))
        mgr.save(1, _state(11))
        with pytest.raises(cs.CheckpointExistsError, match="never overwritten"):
            mgr.save(2, _state(22))
    reader = cs.CheckpointManager(ckpt, read_only=True)
    assert reader.steps() == [1, 2, 5] and cs.verify(ckpt).ok
    assert [reader.load(step)["w"][0] for step in (1, 2, 5)] == [11.0, 2.0, 55.0]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_deletion_failing_after_a_save_warns_and_the_save_stands(tmp_path: Path, async_save: bool) -> None:
    """Retention after a commit meets an I/O error (injected where deleting a file would fail): the
    save is not failed, for its step is committed; a RetentionWarning says so, and the next
    retention deletes what is left to delete."""
    with cs.CheckpointManager(tmp_path, keep_last=1, async_save=async_save) as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
        faults.arm("mid_delete", fail=True)
        try:
            with pytest.warns(cs.RetentionWarning, match="step 2 is committed, but deleting old steps"):
                mgr.save(2, _state(2))
                mgr.wait()
        finally:
            faults.arm(None, fail=True)
        assert mgr.steps() == [2] and mgr.load()["w"][0] == 2.0
        mgr.save(3, _state(3))
        mgr.wait()
        assert mgr.steps() == [3]
    cs.CheckpointManager(tmp_path).close()  # the next writer removes what the failed deletion left
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "step_000000000003"]
    assert cs.verify(tmp_path).ok


@pytest.mark.parametrize("async_save", [True, False])
def test_a_rename_that_cannot_be_made_durable_says_the_step_was_committed(
    tmp_path: Path, async_save: bool
) -> None:
    """An I/O error right after the rename (where fsyncing the directory fails) is reported as what
    it is: the step was committed and is intact, only its durability is in doubt. It was reported
    as a commit that failed, with the step in place."""
    with cs.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
        faults.arm("after_rename", fail=True)
        try:
            with pytest.raises(cs.CrashsafeError, match="step 2 was committed to .* rename durable"):
                mgr.save(2, _state(2))
                mgr.wait()
        finally:
            faults.arm(None, fail=True)
        assert mgr.steps() == [1, 2] and mgr.load(2)["w"][0] == 2.0
        mgr.save(3, _state(3))
        mgr.wait()
    assert cs.CheckpointManager(tmp_path, read_only=True).steps() == [1, 2, 3] and cs.verify(tmp_path).ok


def test_a_log_line_naming_the_manager_never_takes_a_failed_saves_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``repr(mgr)`` lists the steps as they are now. It called ``steps()``, which waits for the save
    in flight and raises its error: a log line ``%r`` of the manager (logging swallows a failing
    repr) took a failed background save's error, and the next save went on as if it had committed."""
    mgr = cs.CheckpointManager(tmp_path, keep_last=None)
    mgr.save(1, _state(1))
    mgr.wait()
    faults.arm("after_fsync_data", fail=True)
    try:
        mgr.save(2, _state(2))
        while not mgr._pending.done:  # the save failed in the background
            time.sleep(0.01)
    finally:
        faults.arm(None, fail=True)
    logging.getLogger("train").warning("checkpoints: %r", mgr)
    assert "steps=[1]" in caplog.text
    with pytest.raises(cs.StorageError, match="injected at after_fsync_data"):
        mgr.save(3, _state(3))
    mgr.close()


def test_saving_a_damaged_committed_step_again_replaces_it(tmp_path: Path) -> None:
    """A run that fell back from a damaged step 8 and trained on saves step 8 again: the damaged
    copy is deleted (with a warning) and the new one committed; an intact step is still refused."""
    with cs.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(7, _state(7))
        mgr.save(8, _state(8))
    data = step_dir(tmp_path, 8) / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with cs.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.warns(cs.CorruptCheckpointWarning, match="fell back|damaged"):
            assert mgr.load()["step"] == 7
        with pytest.warns(cs.CorruptCheckpointWarning, match="deleted and is saved again"):
            mgr.save(8, _state(88))
        assert mgr.load(8)["w"][0] == 88.0
        with pytest.raises(cs.CheckpointExistsError, match="never overwritten"):
            mgr.save(7, _state(77))
        assert mgr.load(7)["w"][0] == 7.0


@pytest.mark.parametrize("closed_writer", [False, True])
def test_a_reader_opened_by_a_relative_path_stays_there_after_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, closed_writer: bool
) -> None:
    """A reader opens its directory afresh at each read, and did so by the relative path it was given:
    after an ``os.chdir`` it listed and loaded another run's ``ckpt`` (or found none). So did a
    writer's manager once closed."""
    monkeypatch.chdir(tmp_path)
    with cs.CheckpointManager("ckpt", async_save=False) as mgr:
        mgr.save(1, _state(1))
    other = tmp_path / "other"
    with cs.CheckpointManager(other / "ckpt", async_save=False) as decoy:
        decoy.save(7, _state(7))
    if closed_writer:
        reader = cs.CheckpointManager("ckpt", async_save=False)
        reader.close()
    else:
        reader = cs.CheckpointManager("ckpt", read_only=True)
    monkeypatch.chdir(other)
    assert reader.steps() == [1]
    np.testing.assert_array_equal(reader.load()["w"], _state(1)["w"])
    monkeypatch.chdir(tmp_path / "ckpt")
    assert reader.latest_step() == 1


def test_second_writer_gets_locked_error_but_readers_work(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path) as writer:
        writer.save(1, _state(1))
        writer.wait()
        with pytest.raises(cs.LockedError, match="another CheckpointManager"):
            cs.CheckpointManager(tmp_path)
        reader = cs.CheckpointManager(tmp_path, read_only=True)
        assert reader.load()["step"] == 1
        with pytest.raises(cs.CrashsafeError, match="open it without read_only=True to save"):
            reader.save(2, _state(2))
        assert cs.verify(tmp_path).ok
    cs.CheckpointManager(tmp_path).close()  # released on close


def test_a_manager_that_fails_to_open_releases_what_it_took(tmp_path: Path) -> None:
    """``save_on_sigterm=True`` is refused off the main thread. That check came after the directory
    was locked, and the half-made manager was never closed: the directory stayed locked by this
    process until it exited."""
    refused: list[BaseException] = []

    def open_in_a_thread() -> None:
        try:
            cs.CheckpointManager(tmp_path, save_on_sigterm=True)
        except cs.CrashsafeError as exc:
            refused.append(exc)

    thread = threading.Thread(target=open_in_a_thread)
    thread.start()
    thread.join()
    assert len(refused) == 1 and "main thread" in str(refused[0])
    with cs.CheckpointManager(tmp_path) as mgr:  # not LockedError naming this very process
        mgr.save(1, _state(1))


def test_lock_held_by_another_process_is_reported(tmp_path: Path) -> None:
    code = (
        "import sys, time, crashsafe as cs; m = cs.CheckpointManager(sys.argv[1]); "
        "print('locked', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([os.sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        with pytest.raises(cs.LockedError, match=f"pid {proc.pid}"):
            cs.CheckpointManager(tmp_path)
    finally:
        proc.kill()
        proc.wait()
    cs.CheckpointManager(tmp_path).close()  # a killed holder releases the lock


def test_unwritable_directory_gives_clear_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        target = Path("/proc/crashsafe-not-writable")  # even root cannot create this
    else:
        tmp_path.chmod(0o500)
        target = tmp_path / "ckpt"
    with pytest.raises(cs.StorageError) as info:
        cs.CheckpointManager(target)
    assert "checkpoint directory" in str(info.value) or "writable" in str(info.value)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Any:
    mount = tmp_path / "tiny"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip("a real full disk needs a tiny tmpfs, and mounting one needs root")
    try:
        yield mount
    finally:  # lazily: a failed test's open files must not leave the mount behind (it outlived runs)
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


@pytest.mark.parametrize("async_save", [True, False])
def test_full_disk_gives_clear_error_and_keeps_older_steps(tiny_disk: Path, async_save: bool) -> None:
    mgr = cs.CheckpointManager(tiny_disk / "ckpt", keep_last=None, async_save=async_save)
    mgr.save(1, {"w": np.ones(100_000)})  # 800 kB fits
    mgr.wait()
    with pytest.raises(cs.DiskFullError, match="no space left"):
        mgr.save(2, {"w": np.ones(400_000)})  # 3.2 MB does not
        mgr.wait()
    assert mgr.steps() == [1]
    assert cs.verify(tiny_disk / "ckpt").ok
    assert not [p for p in (tiny_disk / "ckpt").iterdir() if p.name.startswith(".tmp-")]
    mgr.save(3, {"w": np.ones(1000)})  # training goes on once space is back
    mgr.close()
    assert committed_steps(tiny_disk / "ckpt") == [1, 3]


@cs.codecs.register_codec
@dataclass(frozen=True)
class _ExplodingCodec(cs.codecs.Codec):
    """Fails while encoding in the background persist thread."""

    codec_id = "test-exploding"

    def encode(self, array: Any) -> bytes:
        raise RuntimeError("encoder exploded")

    def decode(self, data: Any, dtype: Any, shape: Any) -> Any:
        raise AssertionError("never written")


def test_background_error_surfaces_on_next_call(tmp_path: Path) -> None:
    mgr = cs.CheckpointManager(tmp_path, codec={"bad": "test-exploding", "*": "raw"})
    mgr.save(1, {"good": np.ones(3)})
    mgr.save(2, {"good": np.ones(3), "bad": np.ones(3)})  # snapshot succeeds; encoding fails later
    with pytest.raises(cs.SaveFailedError, match="step 2.*encoder exploded.*intact"):
        mgr.wait()
    assert mgr.steps() == [1]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    mgr.save(3, {"good": np.ones(3)})
    mgr.save(4, {"good": np.ones(3), "bad": np.ones(3)})
    with pytest.raises(cs.SaveFailedError, match="step 4"):
        mgr.save(5, {"good": np.ones(3)})  # the next save raises the previous save's error
    mgr.close()
    assert committed_steps(tmp_path) == [1, 3]


def test_wrong_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        cs.CheckpointManager(tmp_path, keep_last=0)
    with cs.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(cs.InvalidArgumentError, match="whole number"):
            mgr.save(-1, _state(1))
        with pytest.raises(cs.UnsupportedStateError, match="dict"):
            mgr.save(1, [1, 2])  # type: ignore[arg-type]
        with pytest.raises(cs.UnsupportedStateError, match="metric 'loss'"):
            mgr.save(1, _state(1), metrics={"loss": "low"})


@pytest.mark.parametrize("value", ["0.1", True, np.True_, b"0.1"], ids=["str", "bool", "np.bool", "bytes"])
def test_a_metric_that_is_text_or_a_truth_value_is_refused(tmp_path: Path, value: Any) -> None:
    """``float()`` reads "0.1" and True, so they were stored as 0.1 and 1.0 and ranked as numbers by
    KeepBest and ``best_step`` (True beat every loss above 1); metrics hold numbers only."""
    with cs.CheckpointManager(tmp_path, async_save=False, keep_last=None) as mgr:
        mgr.save(1, _state(1), metrics={"loss": 0.5})
        with pytest.raises(cs.UnsupportedStateError, match="'loss' = .* is not a number"):
            mgr.save(2, _state(2), metrics={"loss": value})
        assert mgr.steps() == [1] and mgr.best_step("loss", mode="max") == 1


def test_a_metric_past_a_floats_range_is_refused_clearly(tmp_path: Path) -> None:
    """An int metric too large for a float (``10**400``) was an OverflowError traceback from save."""
    with cs.CheckpointManager(tmp_path, async_save=False, keep_last=None) as mgr:
        with pytest.raises(cs.UnsupportedStateError, match="'loss' = .* is too large for a float"):
            mgr.save(1, _state(1), metrics={"loss": 10**400})
        assert mgr.steps() == []


def test_metrics_whose_names_collide_as_text_are_refused(tmp_path: Path) -> None:
    """Metric names are stored as text: ``{1: 0.5, "1": 0.7}`` was saved as ``{"1": 0.7}``, one of
    the two values silently lost."""
    with cs.CheckpointManager(tmp_path, async_save=False, keep_last=None) as mgr:
        with pytest.raises(cs.UnsupportedStateError, match="metrics 1 and '1' are both stored as '1'"):
            mgr.save(1, _state(1), metrics={1: 0.5, "1": 0.7})
        assert mgr.steps() == []


def test_metrics_are_recorded_in_the_manifest(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state(1), metrics={"loss": 0.25, "nan": float("nan")})
        mgr.wait()
        assert mgr.manifest(1).metrics == {"loss": 0.25, "nan": "nan"}


def test_maybe_save_follows_the_policy(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path, keep_last=None, policy=cs.policies.EverySteps(3)) as mgr:
        saved = [s for s in range(10) if mgr.maybe_save(s, _state(s))]
    assert saved == [0, 3, 6, 9]
    assert committed_steps(tmp_path) == [0, 3, 6, 9]


def test_async_snapshot_is_isolated_from_later_mutation(tmp_path: Path) -> None:
    state = {"w": np.zeros(2_000_000)}
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state)
        state["w"][:] = 42.0  # training continues while step 1 persists
        mgr.wait()
        assert not mgr.load(1)["w"].any()


def test_leftovers_of_torn_saves_are_ignored_and_cleaned(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state(1))
    torn = tmp_path / ".tmp-step_000000000002-1-abcd"
    torn.mkdir()
    (torn / "data.bin").write_bytes(b"half")
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    assert reader.steps() == [1]
    assert cs.verify(tmp_path).leftovers == [torn.name]
    cs.CheckpointManager(tmp_path).close()
    assert not torn.exists()


def test_a_part_that_fails_to_close_still_releases_the_directory(tmp_path: Path) -> None:
    """close() closes every part even if one raises: the lock goes, and a new writer may open."""
    mgr = cs.CheckpointManager(tmp_path)
    mgr.save(1, {"x": np.arange(4)})

    def broken() -> None:
        raise OSError("staging could not be freed")

    assert mgr._pool is not None
    mgr._pool.clear = broken  # type: ignore[method-assign]
    with pytest.raises(OSError, match="could not be freed"):
        mgr.close()
    with cs.CheckpointManager(tmp_path) as again:  # the lock was released
        assert again.steps() == [1]
