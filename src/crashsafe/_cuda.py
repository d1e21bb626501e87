"""CUDA copies for snapshots and restores, without importing torch: pinned host memory, one copy
stream per device, and the events that order those copies against the training stream.

The ordering rule (docs/gpu.md): a snapshot's copies run on the device's copy stream
after everything already queued on the stream that is current when ``save`` is called (the training
stream), and that stream then waits for the copies before its next kernel. So whatever training
launches after ``save`` returns, on that stream or on any stream ordered after it, runs after the
copy: it can never reach the checkpoint. Work on a stream that is not ordered after the training
stream must be ordered by its author, as for any other reader of the same tensors.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from crashsafe._torch import loaded_torch

__all__ = [
    "DeviceCopies",
    "DeviceUpload",
    "copy_stream",
    "default_pinned_limit",
    "device_room",
    "is_cuda",
    "pinned_buffer",
    "pinned_size",
    "synchronize",
    "upload_stream",
]

CHUNK = 16 << 20  # bytes a bounce buffer carries host-to-device at a time
DEPTH = 3  # bounce buffers per upload: one being read into while the others cross the link
_SMALL = 1 << 20  # payloads below this are copied in one call, without the ring's events

_STREAMS: dict[int, Any] = {}  # device index -> its copy stream
_RINGS: list[_Ring] = []  # bounce-buffer rings not in use, reused across restores
_LOCK = threading.Lock()
_UPLOADS = threading.local()  # per thread: device index -> its upload stream


def _forget_in_child() -> None:
    """In a forked child: the parent's streams and buffers are not the child's (CUDA itself refuses a
    forked child), and a parent thread may have held the lock at the fork: take a fresh one."""
    global _LOCK
    _LOCK = threading.Lock()
    _STREAMS.clear()
    _RINGS.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _torch() -> Any:
    torch = loaded_torch()
    assert torch is not None, "CUDA tensors imply torch is imported"
    return torch


def is_cuda(value: Any) -> bool:
    """True for a torch tensor in CUDA device memory."""
    device = getattr(value, "device", None)
    return getattr(device, "type", None) == "cuda"


def upload_stream(device: Any) -> Any:
    """This thread's stream for host-to-device copies on ``device``: restore's reading threads each
    have their own, so one waiting for its copies never waits for another's."""
    torch = _torch()
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    streams: dict[int, Any] = _UPLOADS.__dict__.setdefault("streams", {})
    if index not in streams:
        streams[index] = torch.cuda.Stream(device=index)
    return streams[index]


def copy_stream(device: Any) -> Any:
    """The stream crashsafe copies on for ``device`` (made once per device and process)."""
    torch = _torch()
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    with _LOCK:
        stream = _STREAMS.get(index)
        if stream is None:
            stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def pinned_buffer(nbytes: int) -> Any:
    """A uint8 host tensor in page-locked memory: the link copies it at full speed, asynchronously."""
    torch = _torch()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def default_pinned_limit() -> int:
    """Pinned bytes a process may hold for staging by default: half the machine's memory, shared
    among the processes of one host (``LOCAL_WORLD_SIZE``), since page-locked memory cannot be
    swapped out and too much of it starves everything else."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = 16 << 30
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return int(total // (2 * local))


def synchronize(tensors: list[Any]) -> None:
    """Wait for all work queued on the devices of these CUDA tensors, on every stream: restore's
    copies run on worker threads, whose current stream is not the caller's."""
    if not tensors:
        return
    torch = _torch()
    for index in sorted({t.device.index for t in tensors}):
        torch.cuda.synchronize(index)


def device_room(device: Any) -> int:
    """Bytes ``device`` can give a temporary copy without touching training's memory: what the
    driver has free, less a tenth of the card as margin. What torch's caching allocator holds
    unused does not count: it is the training stream's (next step's activations), and a copy
    stream cannot reuse it without freeing the whole cache first."""
    torch = _torch()
    free, total = torch.cuda.mem_get_info(device)
    return int(free - total // 10)


def pinned_size(nbytes: int) -> int:
    """The pinned bytes torch's pinned allocator takes for a request of ``nbytes``: a power of two."""
    return 1 << max(nbytes - 1, 0).bit_length()


@dataclass
class DeviceCopies:
    """The device copies of one snapshot, queued as the state is walked and issued together on
    each device's copy stream (:meth:`issue`, on the training thread), then waited for by the thread
    that writes the snapshot, each before it reads its bytes (:meth:`ready`), or all (:meth:`wait`).
    An event marks every ``GROUP`` bytes issued, so the writer starts on the first tensors while
    later ones still cross the link."""

    GROUP = 64 << 20
    _queued: dict[int, list[tuple[int, Any, Any]]] = field(default_factory=dict)  # device -> copies
    _count: int = 0  # copies queued so far: each one's ticket is its number
    _landed_by: dict[int, Any] = field(default_factory=dict)  # ticket -> the event its copy precedes
    _sources: list[Any] = field(default_factory=list)  # kept alive until their copies landed

    def add(self, target: Any, source: Any) -> int:
        """Queue copying CUDA tensor ``source`` into ``target`` (pinned host memory, or a device
        clone); return its ticket for :meth:`ready`."""
        ticket, self._count = self._count, self._count + 1
        self._queued.setdefault(source.device.index, []).append((ticket, target, source))
        return ticket

    def run(self, device: int, work: Callable[[], None], keep: Any) -> int:
        """Queue ``work`` (device work reading tensors of ``device``, ``keep`` kept alive until it ran)
        to run on the device's copy stream among the copies, ordered exactly as they are (a snapshot's
        fingerprints, :mod:`crashsafe.state.fingerprint`); return its ticket for :meth:`ready`."""
        ticket, self._count = self._count, self._count + 1
        self._queued.setdefault(device, []).append((ticket, work, keep))
        return ticket

    def clone_of(self, source: Any) -> tuple[Any, int]:
        """A new tensor on ``source``'s device, made on its copy stream, that :meth:`issue` fills
        with ``source``'s values (a device-to-device copy: a first save, before pinned memory
        exists), and its ticket."""
        torch = _torch()
        with torch.cuda.stream(copy_stream(source.device)):
            clone = torch.empty(source.shape, dtype=source.dtype, device=source.device)
        return clone, self.add(clone, source)

    def issue(self, *, ordered: bool = True) -> None:
        """Issue every queued copy on its device's copy stream, after the work already queued on
        the current stream, and make the current stream wait for the copies (design rule 15). Not
        ``ordered``: sources only the copy stream writes (clones), the current stream left alone."""
        torch = _torch() if self._queued else None
        for index, copies in self._queued.items():
            assert torch is not None
            stream = copy_stream(index)
            current = torch.cuda.current_stream(index)
            if ordered:
                stream.wait_stream(current)
            waiting: list[int] = []  # tickets issued since the last event
            issued = 0
            with torch.no_grad(), torch.cuda.stream(stream):
                for n, (ticket, target, source) in enumerate(copies):
                    if callable(target):  # work queued by run()
                        target()
                    else:
                        target.copy_(source, non_blocking=True)
                        issued += target.numel() * target.element_size()
                    waiting.append(ticket)
                    if issued >= self.GROUP or n == len(copies) - 1:
                        event = torch.cuda.Event()
                        event.record(stream)
                        self._landed_by.update(dict.fromkeys(waiting, event))
                        waiting, issued = [], 0
            if ordered:
                current.wait_event(event)  # the last one: after every copy of this device
            self._sources += [source for _, _, source in copies]
        self._queued.clear()

    def ready(self, ticket: int) -> None:
        """Block until the copy of ``ticket`` (and every one issued before it on its device) landed."""
        event = self._landed_by.get(ticket)
        if event is not None:
            event.synchronize()

    def wait(self) -> None:
        """Block until every issued copy landed; then the sources may change or go."""
        for event in {id(e): e for e in self._landed_by.values()}.values():
            event.synchronize()
        self._landed_by.clear()
        self._sources.clear()


class _Ring:
    """Pinned bounce buffers and the event of the last copy out of each."""

    def __init__(self) -> None:
        self.tensors = [pinned_buffer(CHUNK) for _ in range(DEPTH)]
        self.arrays: list[np.ndarray[Any, Any]] = [t.numpy() for t in self.tensors]
        self.events: list[Any] = [None] * DEPTH

    def settle(self) -> None:
        for i, event in enumerate(self.events):
            if event is not None:
                event.synchronize()
                self.events[i] = None


class DeviceUpload:
    """Host-to-device copies of one payload into device memory ``target`` (a flat uint8 CUDA tensor):
    each chunk is read into a pinned bounce buffer while earlier ones cross the link, on the device's
    copy stream. :meth:`finish` returns once every byte landed: nothing is in flight afterwards."""

    def __init__(self, target: Any) -> None:
        torch = _torch()
        self._target = target
        self._stream = upload_stream(target.device)
        self._stream.wait_stream(torch.cuda.current_stream(target.device))  # after work on the old values
        self._ring: _Ring | None = None
        self._turn = 0

    def fill(self, nbytes: int, read: Callable[[np.ndarray[Any, Any]], None]) -> None:
        """Copy ``nbytes`` bytes into the target, in chunks that ``read`` puts into the bounce buffer
        it is given (in order: the next bytes, as many as the buffer holds)."""
        torch = _torch()
        if nbytes < _SMALL:
            host = np.empty(nbytes, dtype=np.uint8)
            read(host)
            self.put(host)
            return
        ring = self._ring = self._ring or _take_ring()
        for offset in range(0, nbytes, CHUNK):
            turn = self._turn % DEPTH
            self._turn += 1
            event = ring.events[turn]
            if event is not None:
                event.synchronize()  # that buffer's last copy has left it
            size = min(CHUNK, nbytes - offset)
            read(ring.arrays[turn][:size])
            with torch.cuda.stream(self._stream):
                self._target[offset : offset + size].copy_(ring.tensors[turn][:size], non_blocking=True)
            event = ring.events[turn] = torch.cuda.Event()
            event.record(self._stream)

    def put(self, host: np.ndarray[Any, Any]) -> None:
        """Copy a whole host array (decoded bytes) into the target, in one call."""
        torch = _torch()
        source = torch.from_numpy(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
        with torch.cuda.stream(self._stream):
            self._target.copy_(source)
        self._stream.synchronize()

    def finish(self) -> None:
        """Wait for every copy (also after a failure: nothing may land in live memory later)."""
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.settle()
            with _LOCK:
                _RINGS.append(ring)
        self._stream.synchronize()


def _take_ring() -> _Ring:
    with _LOCK:
        if _RINGS:
            return _RINGS.pop()
    return _Ring()
