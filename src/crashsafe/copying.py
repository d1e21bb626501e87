"""Copy a committed step into another store: the mirror's upload (:mod:`crashsafe.mirroring`) and a
peer's replica (:mod:`crashsafe.distributed.peers`) both commit a step from bytes checked against
its manifest, then read the copy back and check it.

The copy is a new step of the target store (rule 1): its payloads packed the target's way, each
written with the writer's checksum, the manifest validated as a reader would before the commit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from crashsafe.chain import ChainReader
from crashsafe.codecs.base import BytesLike
from crashsafe.errors import CorruptCheckpointError, CrashsafeError, NoCheckpointError
from crashsafe.format.manifest import Manifest, PayloadEntry, base_mark
from crashsafe.references import Parts
from crashsafe.storage.base import Store
from crashsafe.storage.reader import StepReader, read_manifest
from crashsafe.storage.writer import StepWriter

__all__ = ["check_copy", "copy_step", "write_copy"]


def write_copy(
    target: Store,
    manifest: Manifest,
    owned: Callable[[PayloadEntry], BytesLike],
    referred: Callable[[PayloadEntry], PayloadEntry] | None = None,
    *,
    verified: bool = False,
) -> None:
    """Commit ``manifest``'s step in ``target``: each payload it owns from the bytes ``owned(entry)``
    gives, each reference as the entry ``referred(entry)`` gives (none allowed without it).
    ``verified``: those bytes were checked against their entries' checksums already (not hashed
    again); otherwise the writer's checksum of them must be the entry's. Nothing is committed on error."""
    writer = StepWriter(target, manifest.step)
    try:
        entries: list[PayloadEntry] = []
        for entry in manifest.payloads:
            if entry.ref is not None:
                if referred is None:
                    raise CrashsafeError(
                        f"step {manifest.step} refers to the bytes of step {entry.ref}, which this copy "
                        "cannot hold: copy a step that owns all its bytes"
                    )
                entries.append(referred(entry))
                continue
            chunk = None if entry.chunks is None else entry.chunks.size
            hashed = (entry.xxh3 if entry.chunks is None else entry.chunks) if verified else None
            put = writer.write_payload(owned(entry), hashed, chunk=chunk)
            if put.xxh3 != entry.xxh3 or put.nbytes != entry.nbytes:
                raise CorruptCheckpointError(
                    f"payload '{entry.path}' of step {manifest.step} changed while it was copied (checksum "
                    f"{put.xxh3}, {put.nbytes} bytes, not {entry.xxh3}, {entry.nbytes}); copy it again"
                )
            entries.append(dataclasses.replace(entry, file=put.file, offset=put.offset))
        writer.commit(dataclasses.replace(manifest, payloads=tuple(entries), files=writer.files()))
    except BaseException:
        writer.abort()
        raise


def copy_step(source: Store, target: Store, step: int) -> None:
    """Copy one committed step: every payload it owns read and checksummed from ``source``, written
    to ``target`` (packed the target's way), committed there, then read back and checksummed. A
    reference is copied as a reference to the target's copy of the step holding its bytes (copied
    before it, oldest first: those bytes are uploaded once, with that step), checked there."""
    with StepReader(source, step) as reader:
        holders: dict[int, Parts] = {}
        write_copy(
            target,
            reader.manifest,
            lambda entry: reader.read_stored(entry).data,
            lambda entry: _referred(target, holders, reader.manifest, entry),
        )
    check_copy(target, step)


def _referred(
    target: Store, holders: dict[int, Parts], manifest: Manifest, entry: PayloadEntry
) -> PayloadEntry:
    """Reference ``entry`` of ``manifest`` as ``target`` holds it: the target's own entry of the
    very save of the step it refers to, for the same bytes (it may pack them elsewhere). ``holders``
    keeps the target's holder steps read so far."""
    ref = entry.ref
    assert ref is not None
    if ref not in holders:
        try:
            holders[ref] = Parts(read_manifest(target, ref))
        except (CorruptCheckpointError, NoCheckpointError) as exc:
            raise CrashsafeError(
                f"step {manifest.step} refers to the bytes of step {ref}, which the mirror does not hold "
                f"intact ({exc}): step {manifest.step} is mirrored once step {ref} is"
            ) from None
    holder = holders[ref]
    same = holder.find(entry)
    moved = [dataclasses.replace(p, file=entry.file, offset=entry.offset) for p in same]
    mark = manifest.info.get(base_mark(ref))
    if holder.manifest.created != mark or moved != [dataclasses.replace(entry, ref=None)]:
        raise CrashsafeError(
            f"step {manifest.step} refers to the bytes of step {ref}, and the mirror's step {ref} is another "
            f"save or holds other bytes: step {manifest.step} is not mirrored"
        )
    return dataclasses.replace(same[0], ref=ref)


def check_copy(store: Store, step: int) -> None:
    """Checksum every payload ``step`` owns in ``store``, and check that each of its references
    holds there (the bytes it refers to are checked as those of the step that holds them)."""
    with StepReader(store, step) as copy, ChainReader(store) as chains:
        for entry in copy.manifest.payloads:
            if entry.ref is None:
                copy.check_stored(entry)
            else:
                chains.owner(step, entry)
