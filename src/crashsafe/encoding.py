"""The save planner: which codec encodes each array of a snapshot, and against which delta base.

Codecs are chosen per state path by glob, most specific pattern first; lossy codecs only ever get
float tensors that no ``lossless`` pattern covers. Delta codecs encode against the reconstruction
of the path's previous save, which the planner keeps (a *track* per path) and advances only when a
step commits. The planner never touches storage: it turns arrays into payload bytes plus the codec
config and base step their manifest entries need.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe.codecs.base import BytesLike, Codec, DeltaCodec, Reference
from crashsafe.codecs.registry import get_codec
from crashsafe.format.dtypes import FLOAT_DTYPES
from crashsafe.format.manifest import Manifest, base_mark
from crashsafe.state.tree import ArrayLeaf
from crashsafe.state.unchanged import ChangeWatch

__all__ = ["CodecSpec", "Encoded", "SavePlanner"]

CodecSpec = str | Codec | Mapping[str, str | Codec] | None


@dataclass(frozen=True)
class Encoded:
    """One array's payload bytes, the codec that wrote them, and its delta base (if a delta)."""

    payload: BytesLike
    codec: Codec
    base: int | None


@dataclass
class _Track:
    """One delta-coded path: the committed ``step`` whose reconstruction ``reference`` holds."""

    codec: DeltaCodec
    kind: str
    dtype: str
    shape: tuple[int, ...]
    step: int
    reference: Reference


class SavePlanner:
    """Encodes the arrays of successive saves; one per writer (it remembers delta chains, and its
    ``watch`` what the newest committed step holds: the tensors a save need not copy)."""

    def __init__(
        self, codec: CodecSpec = None, lossless: Sequence[str] = (), *, unchanged: bool = True
    ) -> None:
        self.watch = ChangeWatch(unchanged)
        self._codecs = _parse_codecs(codec)
        self._lossless = _parse_patterns(lossless)
        self._tracks: dict[str, _Track] = {}  # per delta-coded path: what its next delta is against
        self._next: dict[str, _Track] = {}  # tracks of the step being saved, kept once it commits
        self._commits = 0  # committed saves: delta chains restart at multiples of full_every
        self._created: dict[int, float] = {}  # the creation times of the steps tracks are at

    def codec_for(self, leaf: ArrayLeaf) -> Codec:
        """The codec of the most specific pattern matching the leaf's path that may take it."""
        exact = (
            leaf.dtype not in FLOAT_DTYPES
            or leaf.kind == "bytes"
            or any(fnmatch.fnmatchcase(leaf.path, pattern) for pattern in self._lossless)
        )
        for pattern, codec in self._codecs:
            if fnmatch.fnmatchcase(leaf.path, pattern):
                if codec.lossy and exact:
                    continue
                return codec
        return get_codec("raw")

    def encode(
        self, leaf: ArrayLeaf, array: np.ndarray[Any, Any], step: int, committed: frozenset[int]
    ) -> Encoded:
        """Encode one array of ``step``; ``committed`` are the steps committed before it."""
        codec = self.codec_for(leaf)
        if not isinstance(codec, DeltaCodec):
            return Encoded(codec.encode(array), codec, None)
        payload, base, self._next[leaf.path] = self._encode_delta(codec, leaf, array, step, committed)
        return Encoded(payload, codec, base)

    def _encode_delta(
        self,
        codec: DeltaCodec,
        leaf: ArrayLeaf,
        array: np.ndarray[Any, Any],
        step: int,
        committed: frozenset[int],
    ) -> tuple[BytesLike, int | None, _Track]:
        """Encode against the path's previous save, or start a new chain with a full save.

        Full saves fall on every ``full_every``-th committed save (not of the path), so the
        chains of paths whose ``full_every`` divide each other restart together and retention
        can drop whole old steps. A chain also restarts when its last step is no longer committed
        or is not earlier than ``step`` (a save below an earlier one), and when the path changed
        kind, dtype or shape: the reader accepts a delta only against an earlier, committed step
        holding the same kind of array.
        """
        track = self._tracks.get(leaf.path)
        if (
            track is not None
            and track.step < step
            and track.step in committed
            and track.codec == codec
            and (track.kind, track.dtype, track.shape) == (leaf.kind, leaf.dtype, leaf.shape)
            and self._commits % codec.full_every != 0
        ):
            payload, reference = codec.encode_delta(array, track.reference)
            return payload, track.step, _Track(codec, leaf.kind, leaf.dtype, leaf.shape, step, reference)
        payload, reference = codec.encode_delta(array, None)
        return payload, None, _Track(codec, leaf.kind, leaf.dtype, leaf.shape, step, reference)

    def referenced(self, path: str) -> None:
        """The step being saved refers to the committed bytes of ``path`` (unchanged): its delta chain
        goes on from where it was."""
        track = self._tracks.get(path)
        if track is not None:
            self._next[path] = track

    def committed(self, manifest: Manifest, rank: int | None) -> None:
        """``manifest`` (encoded since the last call; ``rank``: this writer's, None for one process)
        committed: its reconstructions are the new bases, and what it holds the newest state."""
        step, created = manifest.step, manifest.created
        self.watch.committed(manifest, rank)
        self._tracks, self._next = self._next, {}
        self._commits += 1
        self._created[step] = created
        tracked = {track.step for track in self._tracks.values()}
        self._created = {at: when for at, when in self._created.items() if at in tracked or at == step}

    def base_marks(self, bases: Iterable[int]) -> dict[str, float]:
        """What a manifest's ``info`` records of the saves its deltas are against: each base step's
        creation time (:func:`crashsafe.chain.base_mark`), so that a base saved again since (a run
        that fell back and trained on) is never taken for the one the deltas need."""
        return {base_mark(base): self._created[base] for base in bases if base in self._created}

    def reset(self) -> None:
        """Forget every chain (after a failed save, whose references advanced in place, or a read
        that found damage): the next save of each path is full, and copies every tensor."""
        self._tracks, self._next = {}, {}
        self.watch.forget()


def _parse_patterns(patterns: Sequence[str]) -> tuple[str, ...]:
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"lossless must be a list of glob patterns, got {patterns!r}")
    return tuple(patterns)


def _parse_codecs(spec: CodecSpec) -> list[tuple[str, Codec]]:
    if spec is None:
        return []
    if isinstance(spec, (str, Codec)):
        return [("*", get_codec(spec))]
    if not isinstance(spec, Mapping):
        raise TypeError(f"codec must be a codec, an id or a {{pattern: codec}} dict, got {spec!r}")
    pairs = [(str(pattern), get_codec(codec)) for pattern, codec in spec.items()]
    return sorted(pairs, key=lambda pc: _specificity(pc[0]), reverse=True)


def _specificity(pattern: str) -> tuple[int, int]:
    literal = sum(1 for ch in pattern if ch not in "*?[]")
    return literal, -pattern.count("*")
