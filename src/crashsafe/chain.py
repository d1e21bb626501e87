"""Decoding committed steps, through references and delta chains; and which earlier steps a step needs.

A payload written by a :class:`~crashsafe.codecs.DeltaCodec` names its base step in the manifest;
decoding it needs the base's reconstruction, which may itself be a delta. A payload that refers to
an earlier step's bytes (``ref``, format version 4) is read as that step's own payload once the
reference is checked (:mod:`crashsafe.references`); every link of a chain may be one. :class:`ChainReader`
validates a payload's whole chain before it decodes any byte (each base committed and earlier,
holding the same path with the same kind, dtype, shape and codec), then decodes oldest first,
verifying every payload's checksum. Payloads are decoded one at a time, so verification holds one
decoded array (plus, for consecutive steps, one reconstruction per delta-coded path), never a
whole step. :func:`protected_steps` tells retention which steps kept steps still need (their bases and the
steps they refer to).

Steps may be deleted by retention while they are read: an error about a step that is no longer
committed is reported as :class:`NoCheckpointError` (it vanished), never as damage. A step reader
opens every data file of its step at once, and :meth:`ChainReader.open_chains` every step a
payload's chain runs through, before any byte is decoded: a local step's open files stay readable
after a writer deletes it, so a local read that got that far never finds its steps gone.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any, TypeVar

import numpy as np

from crashsafe._closing import Closing
from crashsafe._cuda import DeviceUpload
from crashsafe.codecs.base import Codec, DeltaCodec, Reference
from crashsafe.codecs.raw import Raw
from crashsafe.codecs.registry import get_codec
from crashsafe.errors import CodecError, CorruptCheckpointError, NoCheckpointError
from crashsafe.format.chunks import chunk_span
from crashsafe.format.dtypes import storage_dtype
from crashsafe.format.manifest import Manifest, PayloadEntry, base_mark
from crashsafe.policies.keep import KeepPolicy, StepFacts
from crashsafe.references import Part, Parts, held, part_of, referred_damage
from crashsafe.step_facts import facts_lookup
from crashsafe.storage.base import Store
from crashsafe.storage.reader import StepReader, read_manifest

__all__ = ["ChainReader", "direct_bases", "doomed_steps", "protected_steps", "read_step"]

_T = TypeVar("_T")
_OPEN_READERS = 32  # step readers kept open (each holds a few fds)


def direct_bases(manifest: Manifest) -> frozenset[int]:
    """The steps this step needs: those its delta payloads are encoded against, and those whose
    bytes its references are (retention, the catalog and the mirror keep them alike)."""
    return frozenset(p.base for p in manifest.payloads if p.base is not None) | manifest.references


def protected_steps(
    store: Store, keep: Iterable[int], known: MutableMapping[int, frozenset[int]] | None = None
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
                bases = direct_bases(read_manifest(store, step))
            except (CorruptCheckpointError, NoCheckpointError):
                bases = frozenset()
            cache[step] = bases
        for base in bases - needed:
            needed.add(base)
            todo.append(base)
    return frozenset(needed)


def doomed_steps(
    store: Store,
    policy: KeepPolicy | None,
    known: MutableMapping[int, frozenset[int]] | None = None,
    keep: Iterable[int] = (),
    facts: MutableMapping[int, StepFacts] | None = None,
    steps: Iterable[int] | None = None,
) -> list[int]:
    """Committed steps retention may delete: all but those ``policy`` keeps (None keeps every step),
    the newest, the steps in ``keep``, and every delta base a kept step still needs. ``known`` and
    ``facts`` cache each step's delta bases and facts across calls (:func:`protected_steps`,
    :func:`~crashsafe.step_facts.facts_lookup`): manifests are read once, and only when needed.
    ``steps``: the committed steps to judge (default: the store's; ``crashsafe gc`` plans with the
    steps left once the damaged ones go)."""
    steps = sorted(store.steps() if steps is None else steps)
    if policy is None or not steps:
        return []
    bases: MutableMapping[int, frozenset[int]] = {} if known is None else known

    def seen(step: int, manifest: Manifest) -> None:  # a manifest read for facts gives the bases too
        bases.setdefault(step, direct_bases(manifest))

    kept = {steps[-1], *keep, *policy.keep(steps, facts_lookup(store, steps, facts, seen))} & set(steps)
    needed = protected_steps(store, kept, bases)
    return [s for s in steps if s not in kept and s not in needed]


def read_step(store: Store, step: int) -> tuple[Manifest, list[np.ndarray[Any, Any]]]:
    """The manifest of ``step`` and every payload decoded (storage dtype), through delta chains."""
    with ChainReader(store) as chains:
        arrays = [array for _, array in chains.payloads(step)]
        return chains.manifest(step), arrays


class ChainReader(Closing):
    """Decodes the payloads of committed steps of one directory, following delta chains.

    Step readers stay open while it lives (a chain revisits its steps once per payload; the least
    recently used go beyond a few dozen, but never the step read now nor the steps it refers to). With
    ``keep_references`` the newest reconstruction of each delta-coded path is kept, so reading
    consecutive steps (as verification does) decodes every link of a chain once, not once per step,
    and bytes that several steps refer to are verified once.
    """

    def __init__(self, store: Store, *, keep_references: bool = False) -> None:
        self.store = store
        self._readers: OrderedDict[int, StepReader] = OrderedDict()
        self._held: set[int] = set()  # steps whose readers stay open (open_chains)
        self._reading_now: int | None = None  # the step read now: it and the steps it refers to stay open
        self._pinned: frozenset[int] = frozenset()
        self._parts: dict[int, Parts] = {}  # each open step's payloads by part
        self._references: dict[Part, tuple[int, Reference]] | None = {} if keep_references else None
        self._intact: set[int] = set()  # steps a pass verified whole; and parts of others read by references:
        self._verified: set[tuple[int, Part]] | None = set() if keep_references else None

    def manifest(self, step: int) -> Manifest:
        return self._reader(step).manifest

    def payloads(self, step: int, *, verify_only: bool = False) -> Iterator[tuple[PayloadEntry, Any]]:
        """Yield (entry, array) for every payload of ``step``, decoded and verified, in manifest
        order. With ``verify_only`` raw payloads are checksummed in a stream and yielded as None."""
        for entry in self.manifest(step).payloads:
            yield entry, self.decode(step, entry, verify_only=verify_only)
        if verify_only and self._verified is not None:
            self._intact.add(step)  # its parts need not be remembered one by one

    def decode(
        self,
        step: int,
        entry: PayloadEntry,
        *,
        verify_only: bool = False,
        out: np.ndarray[Any, Any] | None = None,
        upload: DeviceUpload | None = None,
    ) -> Any:
        """One payload of ``step``, decoded through its chain and verified (storage dtype).

        With ``out`` (C-contiguous, the payload's storage dtype and shape: the memory of a live
        tensor) it is decoded into ``out``, raw bytes read straight in and checksummed as they land,
        and ``out`` is returned. If it turns out damaged, ``out`` may hold part of it. With
        ``upload`` (device memory) raw bytes go through its pinned bounce buffers, checksummed as
        they land there, and a payload to decode is decoded into host memory, then copied once. A
        reference is read from the step that holds its bytes."""
        with self._reading(step):
            at, own = self._owner(step, entry)
            seen = (at, part_of(own))
            if verify_only and self._verified is not None and (at in self._intact or seen in self._verified):
                return None  # bytes another step refers to, verified in this pass already
            with self._referred(step, at, entry):
                if upload is not None:
                    return self._upload(at, own, upload)
                if out is not None:
                    return self._into(at, own, out)
                found = self._payload(at, own, verify_only)
            if verify_only and self._verified is not None and at != step:
                self._verified.add(seen)
            return found

    def owner(self, step: int, entry: PayloadEntry) -> tuple[int, PayloadEntry]:
        """The step whose data file holds the bytes of ``entry`` (a payload of ``step``) and its own
        entry for them: ``(step, entry)``, or for a reference the holder's, checked."""
        with self._reading(step):
            return self._owner(step, entry)

    def open_chains(self, step: int, entries: Iterable[PayloadEntry]) -> None:
        """Open (and validate) now every step the chains and references of ``entries``, payloads of
        ``step``, run through, and keep them open while this reader lives: decoding them later opens
        nothing, so a writer that deletes those steps meanwhile cannot take a local step away mid-read."""
        self._held.add(step)
        with self._reading(step):
            for entry in entries:
                if entry.base is not None or entry.ref is not None:
                    at, own = self._owner(step, entry)
                    self._held.add(at)
                    if own.base is not None:
                        with self._referred(step, at, entry):
                            self._held.update(link for link, _ in self._chain(at, own))

    def span(
        self, step: int, entry: PayloadEntry, first: int, count: int, *, verify_only: bool = False
    ) -> np.ndarray[Any, Any] | None:
        """Elements ``[first, first + count)`` of the flat array of a payload of ``step`` with chunk
        checksums (a raw shard), read-only, in its storage dtype: only the chunks that hold them are
        read, each verified (``verify_only``: verified and not returned). Damage of any byte outside
        those chunks goes unnoticed here: reading the whole payload (:meth:`decode`) finds it."""
        if entry.chunks is None or not 0 <= first <= first + count <= math.prod(entry.shape):
            raise ValueError(f"payload '{entry.path}' has no chunk checksums or no elements {first}+{count}")
        itemsize = storage_dtype(entry.dtype).itemsize
        start, stop = first * itemsize, (first + count) * itemsize
        chunks = chunk_span(start, stop, entry.chunks.size)
        with self._reading(step):
            at, own = self._owner(step, entry)
            with self._referred(step, at, entry):
                if verify_only:
                    self._reader(at).check_stored(own, chunks)
                    return None
                data = self._reader(at).read_stored(own, chunks)
        skip = start - chunks[0] * entry.chunks.size
        return data[skip : skip + stop - start].view(storage_dtype(entry.dtype))

    def cached(self, step: int, entry: PayloadEntry, start: int = 0, stop: int | None = None) -> bool:
        """Whether the first of bytes ``[start, stop)`` of a payload of ``step`` are in the page
        cache (see StepReader.cached)."""
        at, own = self.owner(step, entry)
        return self._reader(at).cached(own, start, stop)

    def check(self, step: int, entry: PayloadEntry) -> None:
        """Verify the stored bytes of a payload and of every link of its chain, decoding nothing."""
        with self._reading(step):
            at, own = self._owner(step, entry)
            with self._referred(step, at, entry):
                links = self._chain(at, own) if own.base is not None else [(at, own)]
                for link_at, link in links:
                    self._reader(link_at).check_stored(link)

    @contextlib.contextmanager
    def _reading(self, step: int) -> Iterator[None]:
        """Errors of a read of ``step``: a step deleted meanwhile (by retention) vanished, not damaged.
        While ``step`` is read, it and the steps it refers to stay open: references that alternate
        between more holders than the readers kept open read each manifest once, not once each."""
        target = self._reader(step)
        if step != self._reading_now:
            self._reading_now, self._pinned = step, frozenset({step}) | target.manifest.references
        try:
            yield
        except (CorruptCheckpointError, NoCheckpointError):
            target.raise_if_vanished()
            raise

    @contextlib.contextmanager
    def _referred(self, step: int, at: int, entry: PayloadEntry) -> Iterator[None]:
        """Damage found reading bytes of step ``at`` that ``entry`` of ``step`` refers to names both."""
        try:
            yield
        except CorruptCheckpointError as exc:
            if at == step:
                raise
            raise referred_damage(self._where(step, entry), at, exc) from None

    def _where(self, step: int, entry: PayloadEntry) -> str:
        return f"checkpoint step {step} in {self.store.location}: payload '{entry.path}'"

    def _owner(self, step: int, entry: PayloadEntry) -> tuple[int, PayloadEntry]:
        """See :meth:`owner` (without telling a vanished ``step`` from damage)."""
        ref = entry.ref
        if ref is None:
            return step, entry
        said = f"{self._where(step, entry)} refers to step {ref}"
        try:
            holder = self._parts_of(ref)
        except NoCheckpointError:
            raise CorruptCheckpointError(
                f"{said}, which is missing (deleted outside crashsafe?); restore another step"
            ) from None
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{said}, which is damaged: {exc}") from None
        return ref, held(self.manifest(step), entry, holder, self._where(step, entry))

    def _parts_of(self, step: int) -> Parts:
        """The payloads of ``step`` by part (indexed once per open reader of it)."""
        manifest = self.manifest(step)
        parts = self._parts.get(step)
        if parts is None or parts.manifest is not manifest:
            parts = self._parts[step] = Parts(manifest)
        return parts

    def _into(self, step: int, entry: PayloadEntry, out: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        reader = self._reader(step)
        codec = self._codec(reader, entry)
        if (out.dtype, out.shape) != _layout(entry) or not out.flags.c_contiguous:
            raise ValueError(f"payload '{entry.path}' cannot be decoded into a {out.dtype}{out.shape} array")
        if isinstance(codec, Raw) and entry.nbytes == entry.raw_nbytes:
            reader.read_into(entry, out)
            return out
        if not isinstance(codec, DeltaCodec) or entry.base is None:
            _decode(reader, entry, lambda data: codec.decode_into(data, out))
            return out
        reference = None
        for at, link in self._chain(step, entry):
            reference = self._link(codec, step, at, link, reference, out)
        return out

    def _upload(self, step: int, entry: PayloadEntry, upload: DeviceUpload) -> None:
        reader = self._reader(step)
        stream = reader.stream(entry)
        if stream.local and isinstance(self._codec(reader, entry), Raw) and entry.nbytes == entry.raw_nbytes:
            upload.fill(entry.nbytes, stream.read)
            stream.finish()
            return
        # decoded on the host, or from a store that cannot map (one request for it all), then one copy
        dtype, shape = _layout(entry)
        upload.put(self._into(step, entry, np.empty(shape, dtype=dtype)))

    def _payload(self, step: int, entry: PayloadEntry, verify_only: bool) -> Any:
        reader = self._reader(step)
        codec = self._codec(reader, entry)
        if not isinstance(codec, DeltaCodec):
            if verify_only and codec.stored_nbytes(entry.raw_nbytes) == entry.nbytes:
                reader.check_stored(entry)  # e.g. raw: the size check above is all decoding would do
                return None
            return _decode(reader, entry, lambda data: codec.decode(data, *_layout(entry)))
        links = self._chain(step, entry)
        reference = None
        part = part_of(entry)
        cached = self._references.pop(part, None) if self._references is not None else None
        if cached is not None and cached[0] in {at for at, _ in links}:  # the last: bytes referred to again
            reference = cached[1]
            links = links[[at for at, _ in links].index(cached[0]) + 1 :]
        for at, link in links:
            reference = self._link(codec, step, at, link, reference)
        assert reference is not None
        if self._references is not None:
            self._references[part] = (step, reference)
        return reference.array

    def _link(
        self,
        codec: DeltaCodec,
        step: int,
        at: int,
        link: PayloadEntry,
        reference: Reference | None,
        out: np.ndarray[Any, Any] | None = None,
    ) -> Reference:
        """Decode one link (of step ``at``) of a chain of ``step``'s payload; the full payload at its
        start goes into ``out`` if given. Damage of a base step is reported as such."""
        reader = self._reader(at)
        dtype, shape = _layout(link)
        try:
            if reference is None and out is not None:
                _decode(reader, link, lambda data: codec.decode_into(data, out))
                return Reference(out)
            return _decode(reader, link, lambda data: codec.decode_delta(data, dtype, shape, reference))
        except CorruptCheckpointError as exc:
            if at == step:
                raise
            raise CorruptCheckpointError(
                f"checkpoint step {step}: payload '{link.path}' is a delta of step {at}, which is "
                f"damaged: {exc}"
            ) from None

    def _chain(self, step: int, entry: PayloadEntry) -> list[tuple[int, PayloadEntry]]:
        """(step, entry) from the full payload up to ``entry`` (one ``step`` holds), every link
        validated; a base step's entry that is a reference stands for the entry it refers to."""
        links = [(step, entry)]
        link, at = entry, step
        where = self._where(step, entry)
        while link.base is not None:
            base = link.base
            try:
                prior_parts = self._parts_of(base)
            except NoCheckpointError:
                raise CorruptCheckpointError(
                    f"{where} is a delta of step {base}, but base step {base} is missing (deleted outside "
                    "crashsafe?); "
                    "restore another step"
                ) from None
            except CorruptCheckpointError as exc:
                raise CorruptCheckpointError(
                    f"{where} is a delta of step {base}, which is damaged: {exc}"
                ) from None
            wanted = self.manifest(at).info.get(base_mark(base))  # older steps record no mark
            if wanted is not None and wanted != prior_parts.manifest.created:
                raise CorruptCheckpointError(
                    f"{where} is a delta of step {base}, but step {base} was saved again after step {at} "
                    "was (a run that fell back and trained on): the deltas do not decode against it; "
                    "restore another step"
                )
            found = prior_parts.find(entry)
            if len(found) != 1:
                raise CorruptCheckpointError(f"{where}: base step {base} does not hold this path")
            prior = found[0]
            if (prior.kind, prior.dtype, prior.shape, prior.codec) != (
                link.kind,
                link.dtype,
                link.shape,
                link.codec,
            ):
                raise CorruptCheckpointError(
                    f"{where}: base step {base} holds it with another kind, dtype, shape or codec"
                )
            try:
                at, link = self._owner(base, prior)
            except CorruptCheckpointError as exc:
                raise CorruptCheckpointError(f"{where} is a delta of step {base}: {exc}") from None
            links.append((at, link))
        return links[::-1]

    def _codec(self, reader: StepReader, entry: PayloadEntry) -> Codec:
        try:
            return get_codec(entry.codec)
        except CodecError as exc:
            raise CorruptCheckpointError(f"{reader.where}: payload '{entry.path}': {exc}") from None

    def _reader(self, step: int) -> StepReader:
        reader = self._readers.get(step)
        if reader is not None:
            self._readers.move_to_end(step)
            return reader
        reader = self._readers[step] = StepReader(self.store, step)
        while len(self._readers) > _OPEN_READERS:  # the least recently used ones that are not held
            kept = self._held | self._pinned | {step}
            idle = next((at for at in self._readers if at not in kept), None)
            if idle is None:
                break
            self._readers.pop(idle).close()
            self._parts.pop(idle, None)
        return reader

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._held.clear()
        self._reading_now, self._pinned = None, frozenset()
        self._parts.clear()
        self._intact.clear()


def _layout(entry: PayloadEntry) -> tuple[np.dtype[Any], tuple[int, ...]]:
    return storage_dtype(entry.dtype), entry.shape


def _decode(reader: StepReader, entry: PayloadEntry, decode: Callable[[memoryview], _T]) -> _T:
    """Read, verify and decode one payload; any failure to decode is damage of that payload.

    This is the trust boundary: codecs (built-in or registered by users) decode bytes from disk,
    so whatever a codec raises on bytes it cannot decode becomes a CorruptCheckpointError, which
    lets restore fall back to an older step.
    """
    stored = reader.read_stored(entry)
    try:
        return decode(stored.data)
    except CodecError as exc:
        problem = str(exc)
    except MemoryError:
        problem = f"it declares {entry.raw_nbytes} bytes, more than this machine can allocate"
    except Exception as exc:  # see the docstring: the trust boundary
        problem = f"it does not decode ({type(exc).__name__}: {exc})"
    raise CorruptCheckpointError(f"{reader.where}: payload '{entry.path}': {problem}")
