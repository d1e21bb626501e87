"""The one-writer lock of an object store: a lease object naming its holder and when it expires.

Object stores have no ``flock``, and a writer that dies never says so. So the writer creates
``.lock`` (conditionally: only if absent) holding ``{"holder", "expires", "boot", "pidns"}`` and
renews it in the background every third of its length. Another writer may take over a lease only
once it has expired, or at once if its holder was a process that no longer runs in this very PID
namespace of this very boot (a hostname names neither: a container in another PID namespace, or
another machine of that name, sees no such process). Renewals and takeovers compare-and-swap on
S3 (``If-Match`` on the ETag); on stores without a conditional update they re-read and overwrite,
which two writers racing to take over the same expired lease could both pass (docs/storage.md).

A writer whose lease expired unrenewed (the store did not answer) commits and deletes nothing
(LockedError) until a renewal goes through; the renewal goes through only while the lease object
still names this writer, so no other writer took over meanwhile, and writing then resumes. A writer
that finds its lease taken over (or gone) stops for good; right before each commit and deletion it
reads the lease object itself (:meth:`Lease.confirm`), not only what its renewer last saw.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from crashsafe.errors import CrashsafeError, LockedError, StorageError
from crashsafe.storage.base import Lock
from crashsafe.storage.localdir import UnsafeEntryError
from crashsafe.storage.retry import status_of

__all__ = ["LEASE_SECONDS", "Lease"]

LEASE_SECONDS = 30.0  # a lease's length; renewed every third of it
_MOST_READ = 4096  # bytes of a lease read: ours are under 100
_PRECONDITION_FAILED = 412  # an If-Match that no longer matches


class _Call(Protocol):
    """The store's calls: ``fs.<method>(*args, **kwargs)`` with retries and deadlines, ``what`` in errors."""

    def __call__(self, what: str, method: str, /, *args: Any, **kwargs: Any) -> Any: ...


class Lease(Lock):
    """A renewed lease on the object ``path`` of the fsspec file system ``fs``."""

    def __init__(self, fs: Any, path: str, location: str, seconds: float, call: _Call) -> None:
        self._fs = fs
        self._location = location
        self._call = call  # the store's calls with retries (its bounds; its endpoint in errors)
        self._seconds = seconds
        self._path = path
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._lost: str | None = None
        self._expires = 0.0
        try:
            self._acquire()
        except UnsafeEntryError as exc:
            raise StorageError(f"refusing the writer lease: {exc} (crashsafe recreates it)") from None
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, name="crashsafe-lease", daemon=True)
        self._renewer.start()

    def _body(self) -> tuple[bytes, float]:
        """A lease of ours expiring a lease length from now, and that time: it becomes this writer's
        own expiry only once the write went through (a renewal that fails moves nothing forward)."""
        expires = time.time() + self._seconds
        body = {"holder": self.holder, "expires": expires, **_here()}
        return json.dumps(body).encode(), expires

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        """The lease as it is now ({} if unreadable) and its tag; (None, None) if there is none.
        At most ``_MOST_READ`` bytes are read: a larger ``.lock`` is not a lease of ours (unreadable),
        however large it is. The tag is read first, so that a lease renewed between the two reads
        makes a stale tag (whose swap fails), never a stale body under a fresh tag."""
        fs = self._fs
        fs.invalidate_cache(self._path)
        try:
            info = self._call("reading the writer lease", "info", self._path)
            size = int(info.get("size") or 0)
            end = min(size, _MOST_READ)
            data = b""
            if end:
                data = self._call("reading the lease", "cat_file", self._path, start=0, end=end)
        except FileNotFoundError:
            return None, None
        try:
            body = json.loads(data) if size <= _MOST_READ else {}
        except ValueError:
            body = {}
        tag = str(info.get("ETag") or f"{size}:{data.decode('latin-1')}")
        return body if isinstance(body, dict) else {}, tag

    def _acquire(self) -> None:
        """Create the lease, or take over one whose holder is gone: expired, or held by a process
        that no longer runs in this PID namespace of this boot (:func:`_dead_here`). A lease that
        looks alive is watched until it should expire: if its holder renews it meanwhile, another
        writer is running (LockedError)."""
        new, expires = self._body()
        try:
            self._call("taking the lease", "pipe_file", self._path, new, mode="create")
            self._expires = expires
            return
        except FileExistsError:
            pass
        body, tag = self._read()
        if body is not None and body.get("holder") == self.holder:
            self._expires = expires  # ours: the creation went through, its answer was lost, and the
            return  # retry met it
        left = _remaining(body)
        if left > 0 and not _dead_here(body):
            time.sleep(min(left, self._seconds) + 0.5)  # a live holder renews before it expires
            now_body, now_tag = self._read()
            if now_tag != tag and _remaining(now_body) > 0:
                raise LockedError(
                    f"{self._location} is being written by another CheckpointManager "
                    f"({(now_body or {}).get('holder', '?')}, which keeps renewing its lease). Only one "
                    "writer is allowed: stop the other job, or use another location. Readers can open it "
                    "with CheckpointManager(..., read_only=True)."
                )
            tag = now_tag
        if not self._swap(tag):
            raise LockedError(f"another writer took over the lease of {self._location} first")

    def _swap(self, tag: str | None) -> bool:
        """Replace the lease with ours if it is still the one tagged ``tag``."""
        fs = self._fs
        body, expires = self._body()
        if "s3" in _protocols(fs) and tag is not None and tag.startswith('"'):
            bucket, key, _ = fs.split_path(self._path)
            try:
                what = "renewing the writer lease"
                self._call(what, "call_s3", "put_object", Bucket=bucket, Key=key, Body=body, IfMatch=tag)
            except StorageError as exc:
                if status_of(exc) == _PRECONDITION_FAILED:
                    # the lease changed; to ours if this very write went through and only its answer
                    # was lost (the retry then compared with the tag it had replaced)
                    ours = bool(self._read()[0] == json.loads(body))
                    self._expires = expires if ours else self._expires
                    return ours
                raise
            self._expires = expires
            return True
        if self._read()[1] != tag:
            return False
        self._call("renewing the writer lease", "pipe_file", self._path, body)
        self._expires = expires
        return True

    def _renew(self) -> bool:
        """Renew the lease while the lease object names this writer; False once it does not (another
        writer took it over, or it was removed). After an expiry too: a lease that still names this
        writer was taken by no one meanwhile (a takeover writes its own holder), so writing resumes."""
        for _ in range(3):  # again if a write of ours whose answer was lost changed the tag
            body, tag = self._read()
            if body is None or body.get("holder") != self.holder:
                return False
            try:
                if self._swap(tag):
                    return True
            except FileNotFoundError:
                return False  # removed between the read and the swap
        raise StorageError(f"the lease on {self._location} kept changing while it was renewed")

    def _renew_loop(self) -> None:
        while not self._stop.wait(self._seconds / 3):
            try:
                if not self._renew():
                    self._lost = f"another writer took over the lease of {self._location} (or removed it)"
                    return
            except CrashsafeError:
                continue  # transient trouble: retried at the next renewal; check() sees an expired lease

    def check(self) -> None:
        if self._lost is not None:
            raise LockedError(
                f"{self._lost}: this writer stopped so that two writers never write one run. Create a "
                "new CheckpointManager once the other writer is gone"
            )
        late = time.time() - self._expires
        if late > 0:
            raise LockedError(
                f"the lease on {self._location} expired before it could be renewed (unrenewed for "
                f"{late + self._seconds:.0f} s: the store does not answer). This writer commits and deletes "
                "nothing until a renewal goes through, and goes on then unless another writer took over"
            )

    def confirm(self) -> None:
        """``check()``, then read the lease object itself: LockedError unless it still names this
        writer. The renewer learns of a takeover only at its next renewal; a commit or a deletion
        asks the store right before it happens (two small requests)."""
        self.check()
        body, _ = self._read()
        if body is None or body.get("holder") != self.holder:
            self._lost = f"another writer took over the lease of {self._location} (or removed it)"
            self.check()

    def release(self) -> None:
        self._stop.set()
        self._renewer.join()
        if self._lost is None:
            with contextlib.suppress(CrashsafeError, FileNotFoundError):
                body, _ = self._read()
                if body is not None and body.get("holder") == self.holder:
                    self._call("releasing the lease", "rm_file", self._path)


def _remaining(body: dict[str, Any] | None) -> float:
    """Seconds the lease ``body`` is still valid (0 if it has expired or is unreadable)."""
    expires = body.get("expires") if body else None
    return max(0.0, expires - time.time()) if isinstance(expires, (int, float)) else 0.0


@functools.cache
def _here() -> dict[str, str]:
    """What names this process's PID space beyond the hostname: the kernel's boot id and the
    inode of this process's PID namespace (Linux; {} elsewhere, so a lease is waited out there)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return {}
    return {"boot": boot, "pidns": pidns} if boot else {}


def _dead_here(body: dict[str, Any] | None) -> bool:
    """Whether the lease's holder was a process of this host that no longer runs: only if the lease
    names this hostname, this boot and this PID namespace. A pid is a number within one namespace:
    a writer in another container (or on another machine) of the same hostname is no process here,
    and taking its live lease at once let a second writer remove the first's shards mid-save."""
    body = body or {}
    host, _, rest = str(body.get("holder", "")).partition(":")
    pid = rest.partition(":")[0]
    here = _here()
    if host != socket.gethostname() or not pid.isdigit() or not here:
        return False
    if any(body.get(name) != value for name, value in here.items()):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _protocols(fs: Any) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
