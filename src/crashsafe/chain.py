"""Delta chains: which earlier steps a step needs, and reading a step through them.

A payload written by a :class:`~crashsafe.codecs.DeltaCodec` names its base step in the manifest;
decoding it needs the base's reconstruction, which may itself be a delta. :func:`read_step`
validates the whole chain before it decodes any byte (each base committed and earlier, holding the
same path with the same kind, dtype, shape and codec), then decodes oldest first, verifying every
payload's checksum. :func:`protected_steps` tells retention which steps kept steps still need.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np

from crashsafe.codecs.base import DeltaCodec, Reference
from crashsafe.codecs.registry import get_codec
from crashsafe.errors import CodecError, CorruptCheckpointError, NoCheckpointError
from crashsafe.format.dtypes import storage_dtype
from crashsafe.format.manifest import Manifest, PayloadEntry
from crashsafe.policies.retention import steps_to_delete
from crashsafe.storage.layout import committed_steps
from crashsafe.storage.reader import StepReader, read_manifest

__all__ = ["direct_bases", "doomed_steps", "protected_steps", "read_step"]


def direct_bases(manifest: Manifest) -> frozenset[int]:
    """The steps this step's delta payloads are encoded against."""
    return frozenset(p.base for p in manifest.payloads if p.base is not None)


def protected_steps(
    root: Path, keep: Iterable[int], known: MutableMapping[int, frozenset[int]] | None = None
) -> frozenset[int]:
    """Every step the steps in ``keep`` need to stay restorable, through all their chains.

    ``known`` caches step -> :func:`direct_bases` across calls (manifests are read only for steps
    it lacks). A step whose manifest cannot be read protects nothing: it cannot be restored anyway.
    """
    cache: MutableMapping[int, frozenset[int]] = {} if known is None else known
    needed: set[int] = set()
    todo = list(keep)
    while todo:
        step = todo.pop()
        bases = cache.get(step)
        if bases is None:
            try:
                bases = direct_bases(read_manifest(root, step))
            except (CorruptCheckpointError, NoCheckpointError):
                bases = frozenset()
            cache[step] = bases
        for base in bases - needed:
            needed.add(base)
            todo.append(base)
    return frozenset(needed)


def doomed_steps(
    root: Path,
    keep_last: int | None,
    keep_every: int | None,
    known: MutableMapping[int, frozenset[int]] | None = None,
) -> list[int]:
    """Committed steps retention may delete: those the policy drops, minus every delta base a
    kept step still needs (``known`` as in :func:`protected_steps`)."""
    steps = committed_steps(root)
    dropped = set(steps_to_delete(steps, keep_last, keep_every))
    needed = protected_steps(root, [s for s in steps if s not in dropped], known)
    return steps_to_delete(steps, keep_last, keep_every, needed)


def read_step(root: Path, step: int) -> tuple[Manifest, list[np.ndarray[Any, Any]]]:
    """The manifest of ``step`` and every payload decoded (storage dtype), through delta chains."""
    target = read_manifest(root, step)
    manifests: dict[int, dict[str, list[PayloadEntry]]] = {step: _by_path(target)}
    plan: dict[int, list[tuple[int, PayloadEntry]]] = {}
    for i, entry in enumerate(target.payloads):
        for at, link in _chain(root, step, entry, manifests):
            plan.setdefault(at, []).append((i, link))
    values: list[np.ndarray[Any, Any] | None] = [None] * len(target.payloads)
    references: dict[int, tuple[int, Reference]] = {}
    for at in sorted(plan):
        with StepReader(root, at) as reader:
            for i, link in plan[at]:
                try:
                    codec = get_codec(link.codec)
                    if not isinstance(codec, DeltaCodec):
                        values[i] = reader.read(link)
                        continue
                    base: Reference | None = None
                    if link.base is not None:
                        previous = references.get(i)
                        if previous is None or previous[0] != link.base:
                            raise CodecError(f"its chain does not reach base step {link.base}")
                        base = previous[1]
                    stored = reader.read_stored(link)
                    reference = codec.decode_delta(stored.data, storage_dtype(link.dtype), link.shape, base)
                except CodecError as exc:
                    raise CorruptCheckpointError(f"{reader.where}: payload '{link.path}': {exc}") from None
                references[i] = (at, reference)
    for i, (_, reference) in references.items():
        values[i] = reference.array
    assert all(v is not None for v in values)
    return target, [v for v in values if v is not None]


def _chain(
    root: Path, step: int, entry: PayloadEntry, manifests: dict[int, dict[str, list[PayloadEntry]]]
) -> list[tuple[int, PayloadEntry]]:
    """(step, entry) from the full payload up to ``entry``, every link validated."""
    links = [(step, entry)]
    link = entry
    while link.base is not None:
        base = link.base
        where = f"checkpoint step {step} in {root}: payload '{entry.path}'"
        if base not in manifests:
            try:
                manifests[base] = _by_path(read_manifest(root, base))
            except NoCheckpointError:
                raise CorruptCheckpointError(
                    f"{where} is a delta whose base step {base} is missing (deleted outside crashsafe?); "
                    "restore another step"
                ) from None
        found = manifests[base].get(entry.path, [])
        if len(found) != 1:
            raise CorruptCheckpointError(f"{where}: base step {base} does not hold this path")
        prior = found[0]
        same = (prior.kind, prior.dtype, prior.shape, prior.codec) == (
            link.kind,
            link.dtype,
            link.shape,
            link.codec,
        )
        if not same:
            raise CorruptCheckpointError(
                f"{where}: base step {base} holds it with another kind, dtype, shape or codec"
            )
        links.append((base, prior))
        link = prior
    return links[::-1]


def _by_path(manifest: Manifest) -> dict[str, list[PayloadEntry]]:
    index: dict[str, list[PayloadEntry]] = {}
    for payload in manifest.payloads:
        index.setdefault(payload.path, []).append(payload)
    return index
