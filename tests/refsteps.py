"""Steps with references (format version 4, issue 29), committed the way the writer commits them:
through the real commit protocol (``StepWriter``), each reference a copy of the entry that holds its
bytes plus ``ref``, the ``base_created`` mark of every referenced step in ``info``. And forgeries of
them: a manifest rewritten and re-signed, as whoever may write the directory can."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from crashsafe.format.dtypes import storage_dtype
from crashsafe.format.manifest import MANIFEST_NAME, Manifest, PayloadEntry, _canonical, base_mark
from crashsafe.storage.base import Store
from crashsafe.storage.layout import step_dir
from crashsafe.storage.reader import read_manifest
from crashsafe.storage.stores import open_store
from crashsafe.storage.writer import StepWriter

Body = dict[str, Any]


def commit_references(
    location: str | Path | Store,
    step: int,
    holder: int,
    owned: Mapping[str, np.ndarray[Any, Any]] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> Manifest:
    """Commit ``step``: every payload of the committed step ``holder`` becomes a reference to the
    step that holds its bytes (``holder`` itself, or the step its reference names), except the
    paths in ``owned``, written anew from those arrays (raw; a shard keeps its place). The tree and
    info are the holder's, with an int ``step`` in the state set to ``step``. Returns the manifest."""
    store = location if isinstance(location, Store) else open_store(location, storage_options=storage_options)
    try:
        prior = read_manifest(store, holder)
        writer = StepWriter(store, step)
        payloads, marks = [], {}
        for entry in prior.payloads:
            if owned is not None and entry.path in owned:
                payloads.append(_write(writer, entry, owned[entry.path]))
                continue
            ref = holder if entry.ref is None else entry.ref
            marks[base_mark(ref)] = prior.created if entry.ref is None else prior.info[base_mark(ref)]
            payloads.append(dataclasses.replace(entry, ref=ref))
        tree = _with_step(prior.tree, step)
        rank_trees = tuple(_with_step(t, step) for t in prior.rank_trees)
        info = {**prior.info, **marks}
        manifest = Manifest(
            step, time.time(), tree, tuple(payloads), writer.files(), prior.metrics, info, rank_trees
        )
        writer.commit(manifest)
        return manifest
    finally:
        if not isinstance(location, Store):
            store.close()


def _write(writer: StepWriter, entry: PayloadEntry, value: np.ndarray[Any, Any]) -> PayloadEntry:
    """``value`` written raw as a new payload owned by the step, in ``entry``'s place."""
    data = np.ascontiguousarray(value, dtype=storage_dtype(entry.dtype)).reshape(entry.shape)
    put = writer.write_payload(data.data, chunk=None if entry.chunks is None else entry.chunks.size)
    return dataclasses.replace(
        entry, file=put.file, offset=put.offset, nbytes=put.nbytes, xxh3=put.xxh3, codec={"id": "raw"},
        base=None, chunks=put.chunks, ref=None,
    )  # fmt: skip


def _with_step(tree: dict[str, Any], step: int) -> dict[str, Any]:
    """A state tree whose top-level int ``step`` (if any) is ``step``."""
    if tree.get("t") != "dict" or "step" not in tree["keys"]:
        return tree
    vals = list(tree["vals"])
    at = tree["keys"].index("step")
    if vals[at].get("t") == "int":
        vals[at] = {"t": "int", "v": str(step)}
    return {**tree, "vals": vals}


def resign(directory: Path, step: int, edit: Callable[[Body], None]) -> None:
    """Edit a local step's manifest as JSON and sign it anew (a forger's work)."""
    path = step_dir(directory, step) / MANIFEST_NAME
    body = json.loads(path.read_bytes())
    body.pop("checksum")
    edit(body)
    body["checksum"] = xxhash.xxh3_64_hexdigest(_canonical(body))
    path.write_bytes(json.dumps(body).encode())


def payload(body: Body, path: str) -> dict[str, Any]:
    """The JSON payload entry of ``path`` (the first, in a distributed step)."""
    entry = next(p for p in body["payloads"] if p["path"] == path)
    assert isinstance(entry, dict)
    return entry
