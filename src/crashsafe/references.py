"""References: payloads of one step whose bytes an earlier committed step holds (format version 4).

A payload that did not change since an earlier step is not written again: the new step's entry is
the holder's own entry for the same part (path, writing rank, shard), copied field for field, plus
``ref``, the holder's step. A reader honours a reference only against the very save of the holder
that the referring step recorded (``info``'s ``base_created.S``), to exactly one entry of the same
part there, which the holder owns (a reference names the step that holds the bytes, never another
reference) and which equals the reference in every other field. The bytes are then read, verified
and decoded as the holder's own payload. Anything else is damage of the referring step. Each
manifest's payloads are indexed by part once, so resolving all of a step's references is linear work.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from crashsafe.errors import CorruptCheckpointError
from crashsafe.format.manifest import Manifest, PayloadEntry, base_mark

__all__ = ["Part", "Parts", "held", "part_of", "referred_damage"]

Part = tuple[str, int | None, Any]  # a payload's path, writing rank and shard


def part_of(entry: PayloadEntry) -> Part:
    """The part of the state ``entry`` holds: its path and, in a distributed step, its writer and
    shard (a rank's delta chain and references run through its own payloads)."""
    return entry.path, entry.rank, entry.shard


class Parts:
    """The payloads of one step's manifest by part, indexed on first use."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._index: dict[Part, list[PayloadEntry]] | None = None

    def find(self, entry: PayloadEntry) -> list[PayloadEntry]:
        """The payloads of this step that hold the same part as ``entry`` (one, in a valid step)."""
        if self._index is None:
            index: dict[Part, list[PayloadEntry]] = {}
            for p in self.manifest.payloads:
                index.setdefault(part_of(p), []).append(p)
            self._index = index
        return self._index.get(part_of(entry), [])


def held(referring: Manifest, entry: PayloadEntry, holder: Parts, where: str) -> PayloadEntry:
    """The holder's own entry that ``entry``, a reference of step ``referring``, stands for, once
    every rule of the module doc holds; else CorruptCheckpointError (``where`` names the payload)."""
    ref = entry.ref
    assert ref is not None
    said = f"{where} refers to step {ref}"
    if referring.info.get(base_mark(ref)) != holder.manifest.created:
        raise CorruptCheckpointError(
            f"{said}, but step {ref} was saved again after step {referring.step} was (a run that fell back "
            "and trained on), or the reference was forged: those are not the bytes it refers to; restore "
            "another step"
        )
    found = holder.find(entry)
    if len(found) != 1:
        holds = "does not hold this part" if not found else f"holds this part {len(found)} times"
        raise CorruptCheckpointError(f"{said}, which {holds}")
    own = found[0]
    if own.ref is not None:
        raise CorruptCheckpointError(
            f"{said}, whose entry for it is itself a reference (to step {own.ref}): a reference names the "
            "step that holds the bytes"
        )
    if dataclasses.replace(entry, ref=None) != own:
        differ = [f.name for f in dataclasses.fields(own) if getattr(own, f.name) != getattr(entry, f.name)]
        raise CorruptCheckpointError(
            f"{said}, which holds it with another {', '.join(d for d in differ if d != 'ref')}"
        )
    return own


def referred_damage(where: str, ref: int, exc: CorruptCheckpointError) -> CorruptCheckpointError:
    """Damage of the bytes step ``ref`` holds, found while reading a reference (``where``) to them."""
    return CorruptCheckpointError(f"{where} refers to step {ref}, which is damaged: {exc}")
