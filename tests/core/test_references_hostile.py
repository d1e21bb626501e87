"""Hostile references (docs/threat-model.md, "References to earlier steps"): a re-signed manifest
whose reference names a later, missing or re-saved step, a part the step lacks, an entry that differs
in any field or is itself a reference, or a reference in a version that has none, is a clear
CorruptCheckpointError; restore falls back to an older step, verify reports it, in bounded work."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crashsafe as cs
import crashsafe.storage.reader as reader_module
from crashsafe.format.manifest import MANIFEST_NAME, Manifest, PayloadEntry, base_mark
from crashsafe.references import Parts, held
from crashsafe.storage.layout import step_dir
from crashsafe.storage.reader import read_manifest
from crashsafe.storage.stores import open_store
from crashsafe.storage.writer import StepWriter

from ..refsteps import Body, commit_references, payload, resign
from .test_references import _run, _same, state

Edit = Callable[[Body], None]


def _set(**change: Any) -> Edit:
    """Change fields of the reference ``base.w``."""
    return lambda body: payload(body, "base.w").update(change)


def _mark(value: Any) -> Edit:
    def edit(body: Body) -> None:
        if value is None:
            del body["info"][base_mark(20)]
        else:
            body["info"][base_mark(20)] = value

    return edit


def _missing(body: Body) -> None:
    payload(body, "base.w").update(ref=5)
    body["info"][base_mark(5)] = 1.5


FORGED: dict[str, tuple[Edit, str]] = {
    "a later step": (_set(ref=31), "refers to step 31, which is not earlier than step 30"),
    "the step itself": (_set(ref=30), "refers to step 30, which is not earlier than step 30"),
    "a negative step": (_set(ref=-1), "invalid payload 'base.w' referenced step: -1"),
    "a step as a string": (_set(ref="20"), "invalid payload 'base.w' referenced step"),
    "a missing step": (_missing, "refers to step 5, which is missing (deleted outside crashsafe?)"),
    "a part the step lacks": (_set(path="base.x"), "refers to step 20, which does not hold this part"),
    "another offset": (_set(offset=8), "which holds it with another offset"),
    "another size": (_set(nbytes=4), "which holds it with another nbytes"),
    "another file": (_set(file="data-1.bin"), "which holds it with another file"),
    "another checksum": (_set(xxh3="0123456789abcdef"), "which holds it with another xxh3"),
    "another codec": (_set(codec={"id": "zstd", "level": 3}), "which holds it with another codec"),
    "a delta base": (_set(base=10), "which holds it with another base"),
    "another dtype": (_set(dtype="int32"), "which holds it with another dtype"),
    "another shape": (_set(shape=[32, 64]), "which holds it with another shape"),
    "another kind": (_set(kind="torch"), "which holds it with another kind"),
    "a wrong creation mark": (_mark(1.5), "but step 20 was saved again after step 30 was"),
    "a creation mark as a string": (_mark("then"), "records no creation time of it (base_created.20)"),
    "no creation mark": (_mark(None), "refers to step 20 but records no creation time of it"),
    "a reference in version 1": (lambda body: body.update(version=1), "which versions 1 to 3 do not have"),
    "a file outside the step": (_set(file="../step_000000000020/data.bin"), "unsafe or invalid data file"),
    "a file name with a slash": (_set(file="a/data.bin"), "unsafe or invalid data file name"),
}


@pytest.mark.parametrize("name", FORGED)
def test_a_forged_reference_is_damage_and_restore_falls_back(tmp_path: Path, name: str) -> None:
    _run(tmp_path)
    edit, message = FORGED[name]
    resign(tmp_path, 30, edit)
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    with pytest.raises(cs.CorruptCheckpointError, match=re.escape(message)):
        reader.load(30)
    live = state(0, 0)
    with pytest.warns(cs.CorruptCheckpointWarning, match="skipping damaged"):
        assert reader.restore(live) == 20
    _same(live, state(20, 20))
    report = cs.verify(tmp_path)
    assert report.intact == [10, 20] and message.split("(")[0] in (report.damaged[0].problem or "")


def test_a_reference_to_a_reference_is_damage(tmp_path: Path) -> None:
    """A reference names the step that holds the bytes: step 40 naming step 30, whose entry is a
    reference to step 20, is refused (a chain of references would be unbounded work to follow)."""
    _run(tmp_path)
    commit_references(tmp_path, 40, 30)
    refs = {p.path: p.ref for p in cs.CheckpointManager(tmp_path, read_only=True).manifest(40).payloads}
    assert refs == {"base.w": 20, "base.b": 20, "head": 30}  # each names the step that holds it

    def forge(body: Body) -> None:
        payload(body, "base.w")["ref"] = 30
        body["info"][base_mark(30)] = cs.CheckpointManager(tmp_path, read_only=True).manifest(30).created

    resign(tmp_path, 40, forge)
    itself = r"whose entry for it is itself a reference \(to step 20\)"
    with pytest.raises(cs.CorruptCheckpointError, match=itself):
        cs.CheckpointManager(tmp_path, read_only=True).load(40)
    with pytest.warns(cs.CorruptCheckpointWarning):
        assert cs.CheckpointManager(tmp_path, read_only=True).load()["step"] == 30


def test_a_step_referred_to_that_was_deleted_outside_crashsafe(tmp_path: Path) -> None:
    _run(tmp_path)
    shutil.rmtree(step_dir(tmp_path, 20))
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    missing = "refers to step 20, which is missing .*restore another"
    with pytest.raises(cs.CorruptCheckpointError, match=missing):
        reader.load(30)
    live = state(0, 0)
    with pytest.warns(cs.CorruptCheckpointWarning):
        assert reader.restore(live) == 10
    _same(live, state(10, 10))


def test_a_step_referred_to_that_was_saved_again_is_never_taken_for_it(tmp_path: Path) -> None:
    """A run that fell back and saved step 20 again: step 30's references to the first step 20
    must not read the new one's bytes (at the same offsets, with other values)."""
    _run(tmp_path)
    shutil.rmtree(step_dir(tmp_path, 20))
    with cs.CheckpointManager(tmp_path, keep_last=None, async_save=False) as mgr:
        mgr.save(20, state(20, 99))
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    with pytest.raises(cs.CorruptCheckpointError, match="step 20 was saved again after step 30 was"):
        reader.load(30)
    with pytest.warns(cs.CorruptCheckpointWarning):
        _same(reader.load(), state(20, 99))


def test_a_damaged_manifest_of_the_step_referred_to(tmp_path: Path) -> None:
    _run(tmp_path)
    (step_dir(tmp_path, 20) / MANIFEST_NAME).write_bytes(b"{}")
    with pytest.raises(cs.CorruptCheckpointError, match="refers to step 20, which is damaged: .*manifest"):
        cs.CheckpointManager(tmp_path, read_only=True).load(30)
    assert cs.verify(tmp_path).intact == [10]


class _Counted(tuple):  # type: ignore[type-arg]
    """A payload table that counts how often it is walked."""

    walks = 0

    def __iter__(self) -> Iterator[Any]:
        type(self).walks += 1
        return super().__iter__()


def test_resolving_every_reference_of_a_step_walks_the_holder_once() -> None:
    """Bounded work: 20,000 references to a step of 20,000 payloads are checked against one index
    of the holder, built with one walk of its payload table (not one walk per reference)."""
    count = 20_000
    owned = tuple(
        PayloadEntry(f"p{i}", "numpy", "float32", (1,), "data.bin", 4 * i, 4, f"{i:016x}", {"id": "raw"})
        for i in range(count)
    )
    tree = {"t": "list", "items": [{"t": "array", "id": i} for i in range(count)]}
    holder = Manifest(1, 1.5, tree, _Counted(owned), {"data.bin": 4 * count})
    refs = tuple(dataclasses.replace(p, ref=1) for p in owned)
    referring = Manifest(2, 2.5, tree, refs, {}, {}, {base_mark(1): 1.5})
    parts = Parts(holder)
    _Counted.walks = 0
    assert [held(referring, p, parts, "step 2") for p in referring.payloads] == list(owned)
    assert _Counted.walks == 1


def test_references_never_read_outside_the_checkpoint(tmp_path: Path) -> None:
    """The bytes a reference reads are the holder's, opened as the holder's own files (never by
    the reference's name): a holder data file replaced by a link is the holder's damage."""
    _run(tmp_path)
    holder = cs.CheckpointManager(tmp_path, read_only=True).manifest(20)
    outside = tmp_path.parent / "outside.bin"
    data = step_dir(tmp_path, 20) / holder.payloads[0].file
    outside.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(outside)
    with pytest.raises(cs.CorruptCheckpointError, match="refers to step 20, which is damaged"):
        cs.CheckpointManager(tmp_path, read_only=True).load(30)


HOLDERS, PARTS = 40, 120  # more holders than a ChainReader keeps open, each holding every part


def _alternating(directory: Path) -> int:
    """Steps 1..HOLDERS hold the same PARTS arrays; the step after refers to part k of step
    ``k % HOLDERS + 1``, so its references alternate between more holders than stay open."""
    state = {f"p{k:03d}": np.full(8, float(k), dtype=np.float32) for k in range(PARTS)}
    with cs.CheckpointManager(directory, keep_last=None, async_save=False) as mgr:
        for step in range(1, HOLDERS + 1):
            mgr.save(step, state)
    step = HOLDERS + 1
    with contextlib.closing(open_store(directory)) as store:
        holders = {s: read_manifest(store, s) for s in range(1, HOLDERS + 1)}
        holding = [k % HOLDERS + 1 for k in range(PARTS)]
        refs = tuple(dataclasses.replace(holders[h].payloads[k], ref=h) for k, h in enumerate(holding))
        writer = StepWriter(store, step)
        info = {base_mark(s): m.created for s, m in holders.items()}
        writer.commit(Manifest(step, time.time(), holders[1].tree, refs, writer.files(), {}, info))
    return step


def test_references_alternating_between_many_holders_read_each_manifest_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded work: a step whose references alternate between more steps than a reader keeps open
    reads each of their manifests once per read of the step (not once per reference: each manifest
    may be 96 MiB, and a step may hold a million references)."""
    step = _alternating(tmp_path)
    reads = [0]
    real = reader_module.loads

    def counted(*args: Any, **kwargs: Any) -> Manifest:
        reads[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(reader_module, "loads", counted)
    reader = cs.CheckpointManager(tmp_path, read_only=True)
    for read in (lambda: reader.load(step), lambda: reader.load(step, mmap=True)):
        reads[0] = 0
        loaded = read()
        assert all(np.all(np.asarray(loaded[f"p{k:03d}"]) == k) for k in range(PARTS))
        assert reads[0] <= HOLDERS + 2  # the step and each holder once (the manager may list the step)
    reads[0] = 0
    assert cs.verify(tmp_path, steps=[step]).ok and reads[0] <= HOLDERS + 1
