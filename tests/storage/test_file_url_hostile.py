"""A ``file://`` location (the object-store protocol on a local directory) with hostile contents,
made for real: links out of the location, FIFOs where the lease or a step's files belong, a step
directory that is a link. crashsafe must never hang, never read, write or delete through a link,
and keep falling back to intact steps, as it does in a plain directory (tests/core/test_hostile_dir.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import crashsafe as cs
from crashsafe.cli.app import app
from crashsafe.storage.layout import step_dir, step_name
from crashsafe.storage.objectstore import FsspecStore

from ..hostile import make_victim, untouched, within


def _state(step: int) -> dict[str, Any]:
    return {"w": np.full(64, float(step)), "step": step}


def _run(directory: Path, steps: range, **kwargs: Any) -> None:
    with cs.CheckpointManager(f"file://{directory}", keep_last=None, async_save=False, **kwargs) as mgr:
        for step in steps:
            mgr.save(step, _state(step))


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """Files outside the checkpoint location that crashsafe must never touch."""
    return make_victim(tmp_path / "outside")


def _shard(directory: Path, step: int) -> Path:
    (shard,) = step_dir(directory, step).glob("data-*.bin")
    return shard


@pytest.mark.timeout(60)
def test_a_fifo_lease_is_refused_at_once(tmp_path: Path) -> None:
    """It once made the writer wait forever (an open for writing waits for a FIFO's reader)."""
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / ".lock")
    with pytest.raises(cs.StorageError, match=r"\.lock is a link, FIFO"):
        within(10, lambda: cs.CheckpointManager(f"file://{run}"))


def test_a_linked_lease_is_refused_and_its_targetuntouched(tmp_path: Path, victim: Path) -> None:
    """It was once taken for an unreadable lease and overwritten, through the link."""
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(victim / "precious.txt", run / ".lock")
    with pytest.raises(cs.StorageError, match=r"\.lock is a link"):
        cs.CheckpointManager(f"file://{run}")
    untouched(victim)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["manifest", "shard"])
def test_a_fifo_in_a_step_never_blocks(tmp_path: Path, which: str) -> None:
    run = tmp_path / "run"
    _run(run, range(1, 3))
    path = step_dir(run, 2) / "manifest.json" if which == "manifest" else _shard(run, 2)
    path.unlink()
    os.mkfifo(path)
    reader = cs.CheckpointManager(f"file://{run}", read_only=True)
    live = _state(0)
    with pytest.warns(cs.CorruptCheckpointWarning, match="FIFO|is not a file"):
        assert within(10, lambda: reader.restore(live)) == 1
    assert live["step"] == 1 and np.all(live["w"] == 1.0)
    report = within(10, lambda: cs.verify(f"file://{run}"))
    assert report.intact == [1] and [d.step for d in report.damaged] == [2]


@pytest.mark.parametrize("which", ["manifest", "shard"])
def test_a_file_linked_out_of_its_step_is_damage(tmp_path: Path, which: str) -> None:
    """Same bytes behind the link (the checksums match): still not read."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _run(ours, range(1, 3))
    shutil.copytree(ours, theirs)
    path = step_dir(ours, 2) / "manifest.json" if which == "manifest" else _shard(ours, 2)
    path.unlink()
    os.symlink(theirs / path.relative_to(ours), path)
    reader = cs.CheckpointManager(f"file://{ours}", read_only=True)
    with pytest.warns(cs.CorruptCheckpointWarning, match="is a link|is not a file"):
        assert reader.load()["step"] == 1
    assert [d.step for d in cs.verify(f"file://{ours}").damaged] == [2]


def test_a_linked_step_directory_is_never_written_read_or_deleted_through(
    tmp_path: Path, victim: Path
) -> None:
    """A step directory that links to someone else's files: a save of that step is refused (it once
    wrote its shards and manifest into the target), and it is no step to list, restore or delete."""
    run = tmp_path / "run"
    _run(run, range(1, 3))
    os.symlink(victim, step_dir(run, 0))
    os.symlink(victim, step_dir(run, 5))
    with cs.CheckpointManager(f"file://{run}", keep_last=2, async_save=False) as mgr:
        with pytest.raises(cs.CorruptCheckpointError, match="link or a file where a directory belongs"):
            mgr.save(5, _state(5))
        mgr.save(3, _state(3))  # retention runs: steps 1 and 0 are older
        assert mgr.steps() == [2, 3]
    untouched(victim)
    live = _state(0)
    assert cs.CheckpointManager(f"file://{run}", read_only=True).restore(live) == 3
    assert step_dir(run, 0).is_symlink()  # not ours to delete, and never deleted through


def test_a_dangling_link_where_the_manifest_goes_creates_nothing_outside(tmp_path: Path) -> None:
    """A manifest that is a link to nothing is damage: a save of its step replaces it (the link,
    not its target). Creating the manifest was a check for the name, then an open for writing: the
    open created the link's target outside the location. Now it is one O_EXCL open."""
    run, outside = tmp_path / "run", tmp_path / "outside.json"
    _run(run, range(1, 2))
    step_dir(run, 2).mkdir()
    os.symlink(outside, step_dir(run, 2) / "manifest.json")
    with (
        cs.CheckpointManager(f"file://{run}", async_save=False) as mgr,
        pytest.warns(cs.CorruptCheckpointWarning, match="step 2 was committed but damaged"),
    ):
        mgr.save(2, _state(2))
    assert not outside.exists()
    assert not (step_dir(run, 2) / "manifest.json").is_symlink()
    assert cs.CheckpointManager(f"file://{run}", read_only=True).load()["step"] == 2
    store = FsspecStore(f"file://{run}", {})
    step_dir(run, 3).mkdir()
    os.symlink(outside, step_dir(run, 3) / "manifest.json")
    with pytest.raises(FileExistsError):
        store.fs.pipe_file(store.path(step_name(3), "manifest.json"), b"{}", mode="create")
    assert not outside.exists()


def test_a_file_where_the_location_belongs_is_a_clear_error(tmp_path: Path) -> None:
    """As a location, or as its mirror: it raised a bare FileExistsError."""
    (tmp_path / "afile").write_text("x")
    for url in (f"file://{tmp_path}/afile", f"file://{tmp_path}/afile/run"):
        with pytest.raises(cs.StorageError, match="a file stands where its directory"):
            cs.CheckpointManager(url)
        with pytest.raises(cs.StorageError, match="a file stands where its directory"):
            cs.CheckpointManager(tmp_path / "local", mirror=url)
    assert (tmp_path / "afile").read_text() == "x"


def test_only_objects_named_as_a_steps_files_are_leftovers(tmp_path: Path) -> None:
    """Under ``step_<n>/`` without a manifest, every object counted as a torn save's and went when
    a writer opened: a ``notes.txt`` of someone else's too. Only crashsafe's shard names are."""
    from crashsafe.storage.writer import StepWriter

    _run(tmp_path, range(1, 3))
    url = f"file://{tmp_path}"
    store = FsspecStore(url, {})
    torn = StepWriter(store, 5)
    torn.write_payload(np.ones(1 << 16).data)
    torn.persist()  # uploaded ...
    torn.close()  # ... and never committed: a torn save
    (shard,) = step_dir(tmp_path, 5).glob("data-*.bin")
    for step in (1, 7):
        step_dir(tmp_path, step).mkdir(exist_ok=True)
        (step_dir(tmp_path, step) / "notes.txt").write_text("mine")
    assert store.leftovers() == [f"{step_name(5)}/{shard.name}"]
    assert cs.verify(url).leftovers == store.leftovers()
    cs.CheckpointManager(url).close()  # a writer opening removes leftovers
    assert not shard.exists() and FsspecStore(url, {}).leftovers() == []
    for step in (1, 7):
        assert (step_dir(tmp_path, step) / "notes.txt").read_text() == "mine"
    assert cs.CheckpointManager(url, read_only=True).steps() == [1, 2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("blockcache::file://{run}", {}),
        ("simplecache::file://{run}", {}),
        ("filecache::file://{run}", {}),
        ("blockcache://{run}", {"target_protocol": "file"}),
        ("dir://{run}", {"target_protocol": "file", "path": "/"}),
    ],
)
def test_a_caching_or_chained_url_over_local_files_is_refused(
    tmp_path: Path, victim: Path, url: str, options: dict[str, Any]
) -> None:
    """A caching layer is not fsspec's plain local file system, so crashsafe's safe one was not put
    under it: `verify` of ``blockcache::file://`` hung on a FIFO manifest, and links were followed
    out of the location. Such URLs are refused before anything is opened, by the API and the CLI."""
    run = tmp_path / "run"
    _run(run, range(1, 3))
    manifest = step_dir(run, 2) / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    shutil.rmtree(step_dir(run, 1))
    os.symlink(victim, step_dir(run, 1))
    where = url.format(run=run)
    for call in (
        lambda: cs.verify(where, storage_options=options),
        lambda: cs.CheckpointManager(where, storage_options=options, async_save=False),
        lambda: cs.CheckpointManager(where, storage_options=options, read_only=True).load(),
    ):
        with pytest.raises(cs.StorageError, match=r"cannot open .*not through a cache.*Check the URL"):
            within(10, call)
    if not options:
        result = CliRunner().invoke(app, ["verify", where])
        assert result.exit_code == 2 and "not through a cache" in " ".join(result.output.split())
    untouched(victim)
