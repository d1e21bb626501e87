"""Peer replicas of the memory tier: which ranks hold a copy of each rank's part (:func:`placement`,
from :mod:`crashsafe.distributed.placement`), and the copies themselves, sent rank to rank over the
job's gloo group (:func:`exchange`). See docs/distributed.md, "Peer replicas: placement and transfer".

The wire, per transfer, from the source: a header (int64: magic, status, body length, payload
length), the body (the step's manifest, or the source's error text), the payloads' stored bytes in
manifest order, in chunks of at most 64 MiB; then from the target an answer (int64: magic, status,
text length) and its error text. A peer is untrusted input (rules 3, 11, 12): every length is
bounded before anything is allocated, the manifest goes through the reader's own validator before a
byte is kept, and the payloads are checked against it before the target store is touched. Each
ordered pair of ranks numbers its transfers, and each message has a tag of its own, so no two
transfers' messages meet. A target always takes every message its source sends (refused bytes are
read and dropped): in gloo, a message nobody takes times its sender out and closes the pair.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe.copying import check_copy, write_copy
from crashsafe.distributed.group import DEFAULT_TIMEOUT
from crashsafe.distributed.placement import placement
from crashsafe.errors import (
    CoordinationError,
    CorruptCheckpointError,
    CrashsafeError,
    InvalidArgumentError,
    NoCheckpointError,
)
from crashsafe.format.manifest import MAX_MANIFEST_BYTES, PART_KEY, Manifest, dumps, loads
from crashsafe.storage.base import Store
from crashsafe.storage.reader import StepReader, check_bytes, read_manifest

__all__ = ["Transfer", "exchange", "placement"]

_MAGIC = 0x63_73_70_65_65_72_00_01  # b"cspeer", wire version 1
_OK, _FAILED = 0, 1
_CHUNK = 64 << 20  # payload bytes per message
_MAX_TEXT = 4096  # bytes of an error text on the wire
_TAGS = 1 << 16  # tags per transfer: header, body, answer, answer's text, then the payload's chunks
_HEADER, _BODY, _ANSWER, _ANSWER_TEXT, _FIRST_CHUNK = range(5)
_MAX_CHUNKS = _TAGS - _FIRST_CHUNK
_MAX_PAIR_TRANSFERS = (1 << 31) // _TAGS  # torch's tags are non-negative int32


@dataclass(frozen=True)
class Transfer:
    """One copy of a rank's part: ``owner``'s step ``step``, sent by ``source`` from its store of
    ``owner``'s parts, kept by ``target`` in its own."""

    owner: int  # whose part (the rank that saved it)
    step: int
    source: int  # rank (in the group) that sends it, from its store of owner's parts
    target: int  # rank that receives it, into its store of owner's parts


Staged = Callable[[Transfer], "tuple[Manifest, Sequence[np.ndarray[Any, Any]]] | None"]


def exchange(
    group: Any,
    rank: int,
    transfers: Sequence[Transfer],
    store_of: Callable[[int], Store],
    what: str,
    staged: Staged | None = None,
) -> dict[Transfer, str | None]:
    """Run every transfer in which this rank (``rank`` of ``group``, a gloo group whose timeout
    bounds the whole call) is source or target; every rank of the group calls it with the same
    ``transfers``. A source reads step ``step`` of ``store_of(owner)``, every payload checksummed,
    and sends it (a step it cannot send, an error text instead); a target checks what it receives
    and commits it into ``store_of(owner)`` (replacing another save of that step number there;
    keeping the very same save if it is intact) and answers. ``staged(t)``, where it gives them, are
    the manifest of a step this rank just committed and the bytes it committed it from, in payload
    order, still in memory: sent as they are, neither read nor checksummed again (the target checks
    them). Returns,
    for each transfer this rank took part in, None (done: the target holds the copy, checked) or
    what went wrong. Raises only for ``transfers`` no rank could run (InvalidArgumentError, on
    every rank alike)."""
    transfers = list(transfers)
    link = _Link(group, what)
    _check(transfers, link.world, rank)
    if link.rank != rank:
        raise InvalidArgumentError(
            f"rank={rank}, but this process is rank {link.rank} of the group: pass that"
        )
    tags = _tags(transfers)
    sending = [_Sending(link, t, tags[t], store_of, staged) for t in transfers if t.source == rank]
    outcome: dict[Transfer, str | None] = {}
    answers: list[_Posted] = []
    for t in transfers:
        if t.target == rank:
            outcome[t] = _receive(link, t, tags[t], store_of, answers)
    for sent in sending:
        outcome[sent.transfer] = sent.finish()
    for posted in answers:  # the sources hear them or report them lost
        with contextlib.suppress(_Lost):
            link.wait(posted)
    return {t: outcome[t] for t in transfers if t in outcome}


def _check(transfers: list[Transfer], world: int, rank: int) -> None:
    """Refuse a list of transfers that could not run: ranks outside the group, a rank sending to
    itself, one part sent twice to one rank, or a part a rank both receives and sends (it would send
    what it held before)."""
    if not 0 <= rank < world:
        raise InvalidArgumentError(
            f"rank {rank} is not a rank of the group of {world}: pass the group's rank"
        )
    for t in transfers:
        ranks = (t.owner, t.source, t.target) if isinstance(t, Transfer) else ()
        if (
            not ranks
            or not all(_whole(r) and 0 <= r < world for r in ranks)
            or not _whole(t.step)
            or t.step < 0
        ):
            raise InvalidArgumentError(
                f"{t!r} is not a Transfer of a step (0 or more) between ranks of the group of {world}: fix it"
            )
        if t.source == t.target:
            raise InvalidArgumentError(f"{t!r} sends to its own source: drop it (the part is there)")
    targets = {(t.owner, t.step, t.target) for t in transfers}
    if len(targets) != len(transfers):
        raise InvalidArgumentError("the transfers send one part to one rank twice: send each part once")
    for t in transfers:
        if (t.owner, t.step, t.source) in targets:
            raise InvalidArgumentError(
                f"{t!r}: rank {t.source} would send step {t.step} of rank {t.owner}'s part while it "
                "receives it in the same exchange: send it in a later one"
            )


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tags(transfers: list[Transfer]) -> dict[Transfer, int]:
    """Each transfer's first tag: its number among the transfers of its ordered pair of ranks."""
    count: dict[tuple[int, int], int] = {}
    tags = {}
    for t in transfers:
        n = count.get((t.source, t.target), 0)
        if n >= _MAX_PAIR_TRANSFERS:
            raise InvalidArgumentError(
                f"more than {_MAX_PAIR_TRANSFERS} transfers from rank {t.source} to rank {t.target}: "
                "split them"
            )
        count[(t.source, t.target)] = n + 1
        tags[t] = n * _TAGS
    return tags


class _Lost(CrashsafeError):
    """A peer did not answer (dead, hung, or not in this exchange): its pair of ranks is broken."""


@dataclass
class _Posted:
    """A message posted to or from ``peer``: its work and the tensor it reads or fills."""

    peer: int
    work: Any
    tensor: Any


class _Link:
    """Messages between this rank and the others of ``group``, within one deadline (the group's
    timeout from the start of the exchange); a peer lost once is not waited for again."""

    def __init__(self, group: Any, what: str) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self._dist, self._group, self.what = torch, dist, group, what
        self.world: int = dist.get_world_size(group)
        self.rank: int = dist.get_rank(group)
        try:
            timeout = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):  # (torch's own; its default where it has none)
            timeout = DEFAULT_TIMEOUT
        self.timeout: float = timeout
        self._deadline = time.monotonic() + timeout
        self._lost: dict[int, str] = {}

    def send(self, peer: int, tensor: Any, tag: int) -> _Posted:
        self._alive(peer)
        try:
            work = self._dist.isend(tensor, group=self._group, group_dst=peer, tag=tag)
        except RuntimeError as exc:
            raise self._lose(peer, str(exc)) from None
        return _Posted(peer, work, tensor)

    def post_recv(self, peer: int, tensor: Any, tag: int) -> _Posted:
        self._alive(peer)
        try:
            work = self._dist.irecv(tensor, group=self._group, group_src=peer, tag=tag)
        except RuntimeError as exc:
            raise self._lose(peer, str(exc)) from None
        return _Posted(peer, work, tensor)

    def recv(self, peer: int, tensor: Any, tag: int) -> Any:
        """``tensor``, filled with the message of ``peer`` tagged ``tag``."""
        self.wait(self.post_recv(peer, tensor, tag))
        return tensor

    def wait(self, posted: _Posted) -> None:
        left = max(self._deadline - time.monotonic(), 0.001)
        try:
            posted.work.wait(datetime.timedelta(seconds=left))
        except RuntimeError as exc:
            raise self._lose(posted.peer, str(exc)) from None

    def lose(self, peer: int, problem: str) -> str:
        """Give up on ``peer`` (its messages cannot be read); what to report."""
        return str(self._lose(peer, problem, answered=True))

    def _alive(self, peer: int) -> None:
        if peer in self._lost:
            raise _Lost(self._lost[peer])

    def _lose(self, peer: int, problem: str, answered: bool = False) -> _Lost:
        if peer not in self._lost:
            if answered:
                self._lost[peer] = f"{self.what}: rank {peer} {problem}"
            else:
                self._lost[peer] = str(
                    CoordinationError(
                        f"{self.what}: rank {peer} did not answer within {self.timeout:.0f} s ({problem}). "
                        "It died, hangs, or did not make the same exchange call (every rank must, with the "
                        "same transfers); the copies it was to send or receive were not made"
                    )
                )
        return _Lost(self._lost[peer])


def _not_sent(link: _Link, t: Transfer, reason: str) -> str:
    """What both ends report of a transfer whose source could not send it."""
    part = f"step {t.step} of rank {t.owner}'s part"
    return f"{link.what}: rank {t.source} did not send {part} to rank {t.target}: {reason}"


def _not_kept(link: _Link, t: Transfer, reason: str) -> str:
    """What both ends report of a transfer whose target did not keep it."""
    part = f"step {t.step} of rank {t.owner}'s part"
    return f"{link.what}: rank {t.target} did not keep {part} from rank {t.source}: {reason}"


def _text(message: str) -> bytes:
    return message.encode("utf-8", "replace")[:_MAX_TEXT]


def _uint8(data: bytes) -> Any:
    import numpy as np
    import torch

    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


def _chunks(total: int) -> list[tuple[int, int]]:
    """The byte ranges of a payload of ``total`` bytes that travel one message each."""
    return [(start, min(start + _CHUNK, total)) for start in range(0, total, _CHUNK)]


def _owns_all(manifest: Manifest, where: str) -> None:
    """A memory-tier step owns all its bytes, raw: a reference or a delta needs another step."""
    for entry in manifest.payloads:
        if entry.ref is not None or entry.base is not None:
            kind = (
                f"refers to step {entry.ref}'s bytes"
                if entry.ref is not None
                else f"is a delta of step {entry.base}"
            )
            raise CorruptCheckpointError(
                f"{where}: payload '{entry.path}' {kind}; a peer copy must own all its bytes (the memory "
                "tier saves raw, whole steps): it is not copied"
            )


def _in_memory(manifest: Manifest, arrays: Sequence[np.ndarray[Any, Any]]) -> tuple[bytes, list[Any]] | None:
    """A step's manifest and the wire's chunks of the bytes it was committed from (in payload order):
    a chunk inside one array is a view of it, one across arrays a copy of its pieces. None if the
    arrays are not the payloads' bytes one for one (they are read from the store then)."""
    import torch

    where = f"step {manifest.step} as just committed"
    _owns_all(manifest, where)
    flats = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    if [f.nbytes for f in flats] != [e.nbytes for e in manifest.payloads]:
        return None
    total = sum(f.nbytes for f in flats)
    if len(_chunks(total)) > _MAX_CHUNKS:
        raise CrashsafeError(f"{where} holds {total} bytes, more than a peer copy carries")
    starts = np.cumsum([0] + [f.nbytes for f in flats])
    pieces = []
    for start, stop in _chunks(total):
        first = int(np.searchsorted(starts, start, side="right")) - 1
        parts, at, i = [], start, first
        while at < stop:
            if flats[i].nbytes:
                parts.append(flats[i][at - starts[i] : min(stop, starts[i + 1]) - starts[i]])
            at = int(starts[i + 1])
            i += 1
        pieces.append(torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts)))
    return dumps(manifest), pieces


class _Sending:
    """A transfer this rank sends: the step read and checksummed, then every message posted, and
    its target's answer awaited by :meth:`finish`."""

    def __init__(
        self,
        link: _Link,
        transfer: Transfer,
        tag: int,
        store_of: Callable[[int], Store],
        staged: Staged | None,
    ) -> None:
        self.transfer, self._link, self._tag = transfer, link, tag
        self._posted: list[_Posted] = []
        self._answer: _Posted | None = None
        self.problem: str | None = None
        t = transfer
        try:
            found = staged(t) if staged is not None else None
            sent = _in_memory(*found) if found is not None else None  # None: read from the store
            body, pieces = sent if sent is not None else self._read(store_of(t.owner))
            status = _OK
        except Exception as exc:  # any problem of this transfer goes to its target, which else would wait
            body, pieces, status = _text(str(exc)), [], _FAILED
            self.problem = _not_sent(link, t, str(exc))
        total = sum(int(piece.numel()) for piece in pieces)
        torch = link.torch
        header = torch.tensor([_MAGIC, status, len(body), total], dtype=torch.int64)
        try:
            self._posted.append(link.send(t.target, header, tag + _HEADER))
            if body:
                self._posted.append(link.send(t.target, _uint8(body), tag + _BODY))
            for i, piece in enumerate(pieces):
                self._posted.append(link.send(t.target, piece, tag + _FIRST_CHUNK + i))
            if status == _OK:
                self._answer = link.post_recv(t.target, torch.empty(3, dtype=torch.int64), tag + _ANSWER)
        except _Lost as lost:
            self.problem = self.problem or str(lost)

    def _read(self, store: Store) -> tuple[bytes, list[Any]]:
        """The step's manifest and its payloads' stored bytes in the wire's chunks, each payload
        checksummed as it is read."""
        import torch

        with StepReader(store, self.transfer.step) as reader:
            manifest = reader.manifest
            _owns_all(manifest, reader.where)
            total = sum(entry.nbytes for entry in manifest.payloads)
            if len(_chunks(total)) > _MAX_CHUNKS:
                raise CrashsafeError(f"{reader.where} holds {total} bytes, more than a peer copy carries")
            payload = torch.empty(total, dtype=torch.uint8)
            flat, at = payload.numpy(), 0
            for entry in manifest.payloads:
                reader.read_into(entry, flat[at : at + entry.nbytes])
                at += entry.nbytes
            return dumps(manifest), [payload[start:stop] for start, stop in _chunks(total)]

    def finish(self) -> str | None:
        """None once the target holds the copy, checked; else what went wrong."""
        link, t = self._link, self.transfer
        try:
            for posted in self._posted:
                link.wait(posted)
            if self._answer is None:
                return self.problem
            link.wait(self._answer)
            magic, status, length = self._answer.tensor.tolist()
            if magic != _MAGIC or status not in (_OK, _FAILED) or not 0 <= length <= _MAX_TEXT:
                return link.lose(
                    t.target, f"answered with a header this rank cannot read ({magic}, {status}, {length})"
                )
            if status == _OK:
                return None
            text = link.recv(
                t.target, link.torch.empty(length, dtype=link.torch.uint8), self._tag + _ANSWER_TEXT
            )
        except _Lost as lost:
            return self.problem or str(lost)
        return _not_kept(link, t, bytes(text.numpy()).decode("utf-8", "replace"))


def _receive(
    link: _Link, t: Transfer, tag: int, store_of: Callable[[int], Store], answers: list[_Posted]
) -> str | None:
    """Take transfer ``t`` from its source, keep it, and answer (``answers``: the answers posted)."""
    torch, src = link.torch, t.source
    try:
        magic, status, length, total = link.recv(
            src, torch.empty(4, dtype=torch.int64), tag + _HEADER
        ).tolist()
        limit = MAX_MANIFEST_BYTES if status == _OK else _MAX_TEXT
        if (
            magic != _MAGIC
            or status not in (_OK, _FAILED)
            or not 0 <= length <= limit
            or not 0 <= total <= _MAX_CHUNKS * _CHUNK
            or (status == _FAILED and total)
        ):
            return link.lose(
                src,
                f"sent a header this rank cannot read ({magic}, {status}, {length}, {total}): another "
                "version of crashsafe, or not crashsafe",
            )
        body = (
            bytes(link.recv(src, torch.empty(length, dtype=torch.uint8), tag + _BODY).numpy())
            if length
            else b""
        )
        if status == _FAILED:
            return _not_sent(link, t, body.decode("utf-8", "replace"))
        reason, payload = None, None
        try:
            manifest = _accepted(t, body, total, link.world)
            store = store_of(t.owner)
            if not _holds(store, manifest):  # (the very save, intact: kept; its bytes are dropped)
                payload = torch.empty(total, dtype=torch.uint8)
        except Exception as exc:  # refused: the bytes are still taken (and dropped)
            reason = f"refused: {exc}"
        _take(link, src, tag, total, payload)
        if payload is not None:
            reason = _commit(t, store, manifest, payload)
    except _Lost as lost:
        return str(lost)
    with contextlib.suppress(_Lost):  # (a source gone since it sent: the copy is kept all the same)
        answers.extend(_answer(link, src, tag, reason))
    return None if reason is None else _not_kept(link, t, reason)


def _accepted(t: Transfer, body: bytes, total: int, world: int) -> Manifest:
    """The manifest a source sent, validated as a reader validates one, for the step ``t`` names,
    owning all its bytes, ``total`` of them, and not labelled another part (``memory.part``)."""
    where = f"rank {t.source}'s manifest of step {t.step} of rank {t.owner}'s part"
    manifest = loads(body, where)
    if manifest.step != t.step:
        raise CorruptCheckpointError(f"{where} is a manifest of step {manifest.step}")
    part = manifest.info.get(PART_KEY, f"{t.owner}/{world}")
    if part != f"{t.owner}/{world}":
        raise CorruptCheckpointError(f"{where} is labelled {PART_KEY}={part!r}, another part")
    _owns_all(manifest, where)
    if sum(entry.nbytes for entry in manifest.payloads) != total:
        raise CorruptCheckpointError(f"{where} carries {total} payload bytes, and its manifest lists others")
    return manifest


def _holds(store: Store, manifest: Manifest) -> bool:
    """Whether ``store`` holds the very save ``manifest`` is, intact (then it is kept, not written
    again); another save of that step number, or a damaged one, is replaced."""
    step = manifest.step
    if not store.has_step(step):
        return False
    try:
        mine = read_manifest(store, step)
        if mine.created != manifest.created or [e.xxh3 for e in mine.payloads] != [
            e.xxh3 for e in manifest.payloads
        ]:
            return False
        check_copy(store, step)
    except (CorruptCheckpointError, NoCheckpointError):
        return False
    return True


def _take(link: _Link, src: int, tag: int, total: int, payload: Any) -> None:
    """Receive the payload's chunks into ``payload``, or (None: refused or kept) read and drop them."""
    into = payload if payload is not None else link.torch.empty(min(total, _CHUNK), dtype=link.torch.uint8)
    for i, (start, stop) in enumerate(_chunks(total)):
        part = into[start:stop] if payload is not None else into[: stop - start]
        link.recv(src, part, tag + _FIRST_CHUNK + i)


def _commit(t: Transfer, store: Store, manifest: Manifest, payload: Any) -> str | None:
    """Check the received bytes against the manifest, then commit them, checked, as step ``t.step``
    of ``store`` (in place of another save of that step number); what went wrong, or None. (Not read
    back: a RAM disk gives back what was written; the mirror's uploads are read back.)"""
    where = f"rank {t.source}'s copy of step {t.step} of rank {t.owner}'s part"
    try:
        flat, at = payload.numpy(), 0
        spans: dict[int, memoryview] = {}
        for entry in manifest.payloads:
            spans[id(entry)] = view = flat[at : at + entry.nbytes].data
            check_bytes(where, entry, view)  # damaged on the way: the store is not touched
            at += entry.nbytes
        if store.has_step(t.step):
            store.delete(t.step)
        write_copy(store, manifest, lambda entry: spans[id(entry)], verified=True)
    except Exception as exc:  # (a problem of this transfer alone)
        return str(exc)
    return None


def _answer(link: _Link, src: int, tag: int, reason: str | None) -> list[_Posted]:
    """Tell the source whether its copy was kept (posted; awaited at the end of the exchange)."""
    torch = link.torch
    text = b"" if reason is None else _text(reason)
    answer = torch.tensor([_MAGIC, _OK if reason is None else _FAILED, len(text)], dtype=torch.int64)
    posted = [link.send(src, answer, tag + _ANSWER)]
    if text:
        posted.append(link.send(src, _uint8(text), tag + _ANSWER_TEXT))
    return posted
