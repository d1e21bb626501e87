"""Many processes, one checkpoint: real DDP and FSDP2 jobs on gloo (127.0.0.1), killed for real and
resumed; resharding; damage that makes every rank fall back; a rank dying mid-commit."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

import crashsafe as cs
from crashsafe.export import export_safetensors
from crashsafe.loading import array_ids
from crashsafe.storage.layout import step_dir


def _run(launch: Any, kind: str, world: int, directory: Path, out: Path, steps: int = 12, *more: Any) -> None:
    codes = launch("job.py", world, kind, directory, steps, 3, out, 60, *more).wait()
    assert codes == [0] * world, codes


def _same(a: Path, b: Path) -> None:
    with np.load(a) as left, np.load(b) as right:
        assert sorted(left.files) == sorted(right.files)
        for name in left.files:
            assert np.array_equal(left[name], right[name]), name


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_save_and_resume_with_two_ranks(tmp_path: Path, launch: Any, kind: str) -> None:
    """Run 12 steps straight; run 6, rebuild everything, resume to 12: the end is bit-identical.
    DDP's replicated state is written once; FSDP2's shards once each."""
    _run(launch, kind, 2, tmp_path / "straight", tmp_path / "straight.npz")
    _run(launch, kind, 2, tmp_path / "resumed", tmp_path / "resumed.npz", 12, 6)
    _same(tmp_path / "straight.npz", tmp_path / "resumed.npz")
    reader = cs.CheckpointManager(tmp_path / "resumed", read_only=True)
    manifest = reader.manifest()
    assert manifest.world == 2 and {p.rank for p in manifest.payloads} == {0, 1}
    if kind == "ddp":  # every replicated array once: only RNG states, which may differ, twice
        paths = [p.path for p in manifest.payloads]
        assert all(paths.count(p) == 1 for p in paths if p.startswith(("model.", "optim.")))
        assert {p for p in paths if paths.count(p) > 1} <= {p for p in paths if p.startswith("rng.")}
    else:  # every parameter and moment in two shards, one per rank
        shards = [p for p in manifest.payloads if p.shard is not None]
        assert shards and all(sum(q.path == p.path for q in shards) == 2 for p in shards)
    full = reader.load()  # one plain process: whole tensors under the model's names
    with np.load(tmp_path / "resumed.npz") as final:
        for name, tensor in full["model"].items():
            assert np.array_equal(tensor.numpy(), final[f"model.{name}"]), name
        export_safetensors(tmp_path / "resumed", tmp_path / "model.safetensors", prefix="model.")
        exported = load_file(tmp_path / "model.safetensors")  # whole tensors, gathered from the shards
        assert sorted(exported) == sorted(full["model"])
        for name, array in exported.items():
            assert np.array_equal(array, final[f"model.{name}"]), name
    assert cs.verify(tmp_path / "resumed").ok


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_at_random_moments_then_resume_bit_identically(tmp_path: Path, launch: Any) -> None:
    """FSDP2 on 2 ranks, killed for real at random moments of training and saving: once every rank,
    once one rank (the other then fails within the coordination timeout, never hangs). Every
    committed step verifies, and the job resumed to the end is bit-identical to an uninterrupted one."""
    kind, steps = "fsdp", 60
    _run(launch, kind, 2, tmp_path / "straight", tmp_path / "straight.npz", steps)
    rng = random.Random(3)
    directory = tmp_path / "killed"
    for victims in (None, [1]):
        ranks = launch("job.py", 2, kind, directory, steps, 3, tmp_path / "unused.npz", 10)
        first = ranks.procs[0][0].stdout
        assert first is not None and first.readline().startswith("resumed")
        time.sleep(rng.uniform(0.5, 1.5))
        ranks.kill(victims)
        started = time.monotonic()
        codes = ranks.wait(60)
        assert all(code != 0 for code in codes) and time.monotonic() - started < 30
        report = cs.verify(directory)
        assert report.ok, [d.problem for d in report.damaged]
    final = launch("job.py", 2, kind, directory, steps, 3, tmp_path / "killed.npz", 60)
    resumed = final.procs[0][0].stdout
    assert resumed is not None and int(resumed.readline().split()[1]) > 0  # it really resumed
    assert final.wait() == [0, 0]
    _same(tmp_path / "straight.npz", tmp_path / "killed.npz")


def test_a_rank_killed_mid_commit_commits_nothing_and_the_others_raise(tmp_path: Path, launch: Any) -> None:
    """Rank 0 dies right after writing the first step's manifest (before the rename): no step is
    committed, rank 1 (whose save waits for the commit) fails with CoordinationError within the
    timeout instead of hanging, and the next writer cleans the leftover up."""
    directory = tmp_path / "ckpt"
    sync = {"JOB_SYNC_SAVES": "1"}
    ranks = launch(
        "job.py", 2, "ddp", directory, 6, 3, tmp_path / "x.npz", 8,
        env_of={0: {**sync, "CRASHSAFE_KILL_AT": "after_write_manifest"}, 1: sync},
    )  # fmt: skip
    started = time.monotonic()
    codes = ranks.wait(60)
    assert codes[0] == -9 and codes[1] != 0 and time.monotonic() - started < 40
    log = (tmp_path / next(p.name for p in tmp_path.iterdir() if p.name.startswith("rank1-"))).read_text()
    assert "CoordinationError" in log
    assert cs.CheckpointManager(directory, read_only=True).steps() == []
    assert [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]  # a leftover ...
    _run(launch, "ddp", 2, directory, tmp_path / "done.npz", 6)
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]  # ... cleaned


def test_a_damaged_shard_makes_every_rank_fall_back_together(tmp_path: Path, launch: Any) -> None:
    directory = tmp_path / "ckpt"
    _run(launch, "fsdp", 2, directory, tmp_path / "six.npz", 6)  # steps 3 and 6 committed
    data = step_dir(directory, 6) / "data-r1.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # damage rank 1's part only
    data.write_bytes(bytes(raw))
    # rank 1 reaches save(6) late: rank 0 has replaced the damaged step 6 by then (under load this
    # once made rank 1 list no step 6, skip the collective replacement and deadlock with rank 0)
    late = {1: {"JOB_LATE_SAVE": "1.5"}}
    ranks = launch("job.py", 2, "fsdp", directory, 6, 3, tmp_path / "again.npz", 20, env_of=late)
    firsts = [proc.stdout.readline().strip() for proc, _ in ranks.procs if proc.stdout is not None]
    assert ranks.wait() == [0, 0]
    assert firsts == ["resumed 3", "resumed 3"]  # both ranks went back to step 3, not just rank 1
    _same(tmp_path / "six.npz", tmp_path / "again.npz")  # and retrained steps 4..6 identically


def test_restore_reads_each_part_into_live_memory_and_falls_back_whole(tmp_path: Path, launch: Any) -> None:
    """Restoring into a job whose model and optimizer hold every tensor, each rank reads exactly its
    own raw shards, straight into its live tensors' memory. With rank 1's part of step 6 damaged,
    rank 0 has already written step 6 into its live memory when the damage is found: every rank then
    restores step 3 whole, ending exactly as a restore of step 3 alone."""
    directory = tmp_path / "ckpt"
    _run(launch, "fsdp", 2, directory, tmp_path / "six.npz", 6)  # steps 3 and 6 committed

    def restore(out: str, *step: int) -> list[dict[str, Any]]:
        ranks = launch("inplace.py", 2, directory, tmp_path / out, *step)
        lines = [json.loads(proc.stdout.readline()) for proc, _ in ranks.procs if proc.stdout is not None]
        assert ranks.wait() == [0, 0]
        return lines

    manifest = cs.CheckpointManager(directory, read_only=True).manifest(6)
    payloads = [[manifest.payloads[i] for i in array_ids(manifest.tree_of(r))] for r in (0, 1)]
    shares = [sum(p.nbytes for p in part if not p.path.startswith("rng.")) for part in payloads]
    lines = restore("restored.npz")
    assert [line["step"] for line in lines] == [6, 6]
    assert [line["read_into"] for line in lines] == shares  # its own part, every byte of it in place
    assert all(line["kept_memory"] for line in lines)
    _same(tmp_path / "six.npz", tmp_path / "restored.npz")
    restore("three.npz", 3)
    data = step_dir(directory, 6) / "data-r1.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) - 100] ^= 0xFF  # rank 1's last payload: found after rank 0 wrote all of step 6
    data.write_bytes(bytes(raw))
    lines = restore("fell.npz")
    assert [line["step"] for line in lines] == [3, 3]
    _same(tmp_path / "three.npz", tmp_path / "fell.npz")


def test_a_tensor_that_differs_between_ranks_is_kept_for_each(tmp_path: Path, launch: Any) -> None:
    """Replicas are found by content, not by name: a tensor each rank holds under one name with its
    own values is written by each rank and each restores its own (DCP keeps rank 0's for all:
    bench/distributed/replicas.py); one every rank holds alike is written once. So at every save:
    the first, one whose arrays changed, one after a rank forgot what the ranks held, a steady one.
    A save of a committed step planned in the background is refused there, on every rank. A load with
    mmap=True maps each rank's own part (it mapped rank 0's for every rank, with a warning)."""
    ranks = launch("differing.py", 2, tmp_path / "ckpt")
    out = [[json.loads(line) for line in proc.stdout] for proc, _ in ranks.procs if proc.stdout is not None]
    assert ranks.wait() == [0, 0]
    assert [lines[0] for lines in out] == [{"refused": True}] * 2  # found in the background, on every rank
    restored = [lines[1] for lines in out]
    assert restored == [{"mine": 4.0, "same": 4.0, "extra": 7.0}, {"mine": 8.0, "same": 4.0, "extra": 7.0}]
    assert [lines[2] for lines in out] == restored  # load(mmap=True) gave rank 1 rank 0's 'mine'
    reader = cs.CheckpointManager(tmp_path / "ckpt", read_only=True)
    for step in (1, 2, 3, 4):
        paths = sorted(p.path for p in reader.manifest(step).payloads)
        assert paths == (["mine", "mine", "same"] if step == 1 else ["extra", "mine", "mine", "same"])
    assert cs.verify(tmp_path / "ckpt").ok


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resharding_4_to_2_to_1_to_4_is_bit_identical(tmp_path: Path, launch: Any) -> None:
    """An FSDP2 checkpoint of 4 ranks restored by 2, then by one plain process (whole tensors,
    no torch.distributed), then by 4 again: every layout holds the same model and optimizer."""
    _run(launch, "fsdp", 4, tmp_path / "four", tmp_path / "four.npz", 6)
    hops = [(2, "four", "two"), (1, "two", "one"), (4, "one", "four-again")]
    for world, source, target in hops:
        codes = launch(
            "reshard.py", world, tmp_path / source, tmp_path / target, tmp_path / f"{target}.npz"
        ).wait()
        assert codes == [0] * world, (world, codes)
        _same(tmp_path / "four.npz", tmp_path / f"{target}.npz")
    assert cs.CheckpointManager(tmp_path / "two", read_only=True).manifest().world == 2
    assert cs.CheckpointManager(tmp_path / "one", read_only=True).manifest().world == 1


def test_a_deletion_failing_on_rank_0_after_a_commit_fails_no_rank(tmp_path: Path, launch: Any) -> None:
    """Rank 0 applies retention once every rank heard the step committed: its deletions failing
    (an I/O error injected where a file is deleted) warn on rank 0 and fail no rank's save."""
    location = tmp_path / "ckpt"
    ranks = launch("retention.py", 2, location, env_of={0: {"CRASHSAFE_FAIL_AT": "mid_delete"}})
    reports = [json.loads(proc.stdout.read()) for proc, _ in ranks.procs if proc.stdout is not None]
    assert ranks.wait() == [0, 0]
    seen = {"after_1": [1], "after_2": [2], "after_3": [3], "after_4": [4]}  # each failed one left view
    assert reports == [{**seen, "warned": 2}, {**seen, "warned": 0}]
    cs.CheckpointManager(location).close()  # the next writer removes what the failed deletions left
    assert sorted(p.name for p in location.iterdir()) == [".lock", "step_000000000004"]
    assert cs.verify(location).ok


def test_a_restore_one_rank_cannot_take_changes_no_rank(tmp_path: Path, launch: Any) -> None:
    """Rank 1's live state has a key the checkpoint lacks: every rank refuses, and rank 0's model is
    not overwritten (it was, while the error blamed damage). A step never committed is
    NoCheckpointError on every rank, as in one process (it was CorruptCheckpointError)."""
    ranks = launch("refused.py", 2, tmp_path / "ckpt")
    reports = [json.loads(proc.stdout.read()) for proc, _ in ranks.procs if proc.stdout is not None]
    assert ranks.wait() == [0, 0]
    for report in reports:
        assert report["weight"] == 5.0 and report["missing"] == "NoCheckpointError", report
        message = report["mismatch"][1]
        assert "'sampler_epoch' is not in the checkpoint" in message and "damaged" not in message, message
    assert reports[1]["mismatch"][0] == "UnsupportedStateError"


def test_ranks_never_commit_a_step_saved_apart(tmp_path: Path, launch: Any) -> None:
    """A time-based policy decides on each rank's clock, and rank 0's steps take longer: maybe_save
    saved different steps on the two ranks, and each such pair was committed with one rank's part
    missing (damaged steps, then retention deleted the intact ones). Now rank 0 decides for all, and
    a save of different step numbers is refused with nothing committed."""
    directory = tmp_path / "ckpt"
    ranks = launch("apart.py", 2, directory)
    reports = [json.loads(proc.stdout.read()) for proc, _ in ranks.procs if proc.stdout is not None]
    assert ranks.wait() == [0, 0]
    assert reports[0] == reports[1], reports
    report = reports[0]
    assert len(report["saved"]) >= 2 and report["committed"] == [0, *report["saved"]]
    assert report["refused"] is True and report["after"] == report["committed"]
    assert cs.verify(directory).ok


@pytest.mark.parametrize("where", ["dir", "s3"])
def test_delete_gc_and_restore_are_collective(where: str, tmp_path: Path, launch: Any, request: Any) -> None:
    """Rank 0 deletes for every rank (no two ranks race on one step), a refusal reaches every rank,
    and every rank sees the same steps, on a directory and on a real S3 API (moto) alike."""
    location, options = str(tmp_path / "ckpt"), {}
    if where == "s3":
        bucket = request.getfixturevalue("bucket")  # tests/conftest.py: moto's S3 on 127.0.0.1
        options = request.getfixturevalue("options")
        location = f"s3://{bucket}/run"
    uneven = {"JOB_WIDTH": "33"}  # the ranks' shards differ in shape: verify once decoded one rank's
    # deltas against the other's reconstruction, and reported intact steps as damaged
    ranks = launch("ops.py", 2, location, json.dumps(options), env_of={0: uneven, 1: uneven})
    reports = [json.loads(proc.stdout.read()) for proc, _ in ranks.procs if proc.stdout is not None]
    assert ranks.wait() == [0, 0]
    assert reports[0] == reports[1]
    assert reports[0] == {
        "saved": [1, 2, 3, 4], "intact": [1, 2, 3, 4], "refused": "cannot delete step 1",
        "after_delete": [1, 3, 4], "gc": [1], "after_gc": [3, 4], "restored": 4, "same": True,
    }  # fmt: skip
