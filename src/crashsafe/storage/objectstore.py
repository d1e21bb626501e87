"""Object stores (S3, GCS, Azure, ...) through fsspec: a step commits by writing its manifest last.

Object stores have no rename, so a step is committed when its manifest exists:

1. payloads are packed into shard objects ``step_<n>/data-<attempt>-<k>.bin``, under a name unique
   to this attempt (two writers never overwrite each other's bytes), uploaded in parallel;
2. once every shard is acknowledged (an acknowledged PUT is durable), ``step_<n>/manifest.json`` is
   created, conditionally where the store supports it (S3 ``If-None-Match: *``): of two writers
   racing on one step exactly one commits, the other gets CheckpointExistsError.

Readers list only steps whose manifest exists; shards of a killed writer, or of the loser of a
race, are invisible and removed by the next writer. Deleting removes the manifest first (the step
vanishes at once), then its shards. Transient errors (5xx, timeouts, dropped connections) are
retried with backoff (:mod:`crashsafe.storage.retry`), each request within time-outs (``bounds``);
then the error is a StorageError (a save's says its step was not committed). One writer at a time
holds a lease object (:mod:`crashsafe.storage.lease`).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import fsspec.asyn

import crashsafe._faults as faults
from crashsafe.codecs.base import BytesLike
from crashsafe.errors import CheckpointExistsError, CorruptCheckpointError, NoCheckpointError, StorageError
from crashsafe.format.manifest import MANIFEST_NAME
from crashsafe.storage.background import IOLoop
from crashsafe.storage.base import Capabilities, Draft, Lock, Store, StoredFile, StoredStep
from crashsafe.storage.bounds import bounded, make_client, within
from crashsafe.storage.layout import LOCK_NAME, is_step_file, parse_step_name, step_name
from crashsafe.storage.lease import LEASE_SECONDS, Lease
from crashsafe.storage.retry import with_retries
from crashsafe.storage.urlfs import open_fs

__all__ = ["FsspecStore"]

# 16 MiB objects, 8 requests at once: the fastest of the raw s3fs ways measured on the test
# server (bench/results/storage.md), and the usual size of S3 clients' parts
SHARD_BYTES = 16 << 20  # payloads are packed into objects of about this size
RANGE_BYTES = 16 << 20  # large reads are split into ranges fetched in parallel
PART_BYTES = 16 << 20  # S3 multipart part size for large payloads
PARTS_IN_FLIGHT = 4  # parts of one large payload uploaded at once
UPLOADS = 8  # shards in flight at once
READS = 8  # shards of a step being read fetched at once (the one read and the next ones)
# fsspec protocols whose "create" write is atomic create-if-absent
_ATOMIC_CREATE = frozenset({"s3", "s3a", "file", "local", "memory"})


class FsspecStore(Store):
    """Checkpoints under an fsspec URL; ``storage_options`` go to fsspec as they are, with S3's
    time-outs and attempts bounded (:mod:`crashsafe.storage.bounds`)."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any],
        *,
        create: bool = False,
        lease_seconds: float | None = None,
    ) -> None:
        self._options = dict(storage_options)
        self._io: IOLoop | None = None  # a loop of its own (see background())
        self._lease: Lease | None = None  # held by this writer: checked before each commit and deletion
        self.location = url
        options, self.bounds, self.where = bounded(url, storage_options)  # where: with its endpoint
        self.fs, self.root = open_fs(url, options, storage_options)  # file://: the safe local one
        protocols = {self.fs.protocol} if isinstance(self.fs.protocol, str) else set(self.fs.protocol)
        self.is_s3 = bool(protocols & {"s3", "s3a"})
        if self.is_s3:
            self.fs.retries = 1  # s3fs's own retry loop: crashsafe's is the one (bounds.py)
        self._client_made = not self.is_s3  # S3's is made before the first request (_call)
        self.capabilities = Capabilities(
            atomic_rename=False, conditional_put=bool(protocols & _ATOMIC_CREATE), durable_fsync=False
        )
        self.lease_seconds = LEASE_SECONDS if lease_seconds is None else lease_seconds
        if create:
            try:
                self._call("creating the location", "makedirs", self.root, exist_ok=True)
            except (FileExistsError, StorageError) as exc:
                if isinstance(exc, StorageError) and not isinstance(exc.__cause__, NotADirectoryError):
                    raise
                raise StorageError(
                    f"cannot create {url}: a file stands where its directory (or a parent) belongs; "
                    "choose another location"
                ) from None

    def require_root(self) -> None:
        """NoCheckpointError unless something is stored under the root (or, for a bucket's root, the
        bucket exists): for a reader, a URL that leads nowhere is a mistake, not an empty run."""
        try:
            self._call("opening the location", "info", self.root)
        except FileNotFoundError:
            raise NoCheckpointError(
                f"checkpoint location {self.location} does not exist (nothing is stored there); check the URL"
            ) from None

    def background(self) -> Store:
        """The same location through an S3 client whose requests run on an event loop of its own,
        started by the calling thread (so at its CPU priority): the mirror's uploads then yield the
        cores to training. Other backends: this store. Never fsspec's cached client: the cache keys
        loops by their text, and gave the next background store a client on a stopped loop."""
        if not self.is_s3:
            return self
        io = IOLoop("crashsafe-background-io")
        try:
            own = {**self._options, "loop": io.loop, "skip_instance_cache": True}
            store = FsspecStore(self.location, own)
        except BaseException:
            io.stop()
            raise
        store._io = io
        store._lease = self._lease
        return store

    def close(self) -> None:
        """Stop the store's own event loop, if it has one, after closing the client on it."""
        io, self._io = self._io, None
        if io is None:
            return
        creator = getattr(self.fs, "_s3creator", None)  # s3fs's client, made on first use
        if creator is not None:
            with contextlib.suppress(Exception):  # best effort: the loop goes anyway
                fsspec.asyn.sync(io.loop, creator.__aexit__, None, None, None, timeout=5)
        io.stop()

    # ------------------------------------------------------------------------- paths and calls

    def path(self, *names: str) -> str:
        return "/".join((self.root, *names))

    def _call(self, what: str, method: str, *args: Any, nbytes: int = 0, **kwargs: Any) -> Any:
        """``self.fs.<method>(*args, **kwargs)`` with retries, each attempt within its deadline for
        about ``nbytes`` moved (:mod:`crashsafe.storage.bounds`), the S3 client made first (``make_client``);
        an error names ``what`` was done, the location and its endpoint."""
        if not self._client_made:  # (not in the constructor: opening a store makes no request)
            make_client(self.fs, self.bounds, self.where)
            self._client_made = True
        call = within(getattr(self.fs, method), self.bounds.deadline(nbytes))
        return with_retries(lambda: call(*args, **kwargs), f"{what} ({self.where})", self.bounds.attempts)

    def _objects(self) -> list[str]:
        """Keys below the root, relative to it, at most two levels deep (step_<n>/<file>). One flat
        listing (on S3 a request per 1000 keys), not one per step prefix."""
        self.fs.invalidate_cache(self.root)
        try:
            found = self._call("listing checkpoints", "find", self.root)
        except FileNotFoundError:
            return []
        prefix = self.root + "/"
        return [
            key[len(prefix) :] for key in found if key.startswith(prefix) and key.count("/", len(prefix)) <= 1
        ]

    # ------------------------------------------------------------------------- Store

    def steps(self) -> list[int]:
        committed = set()
        for key in self._objects():
            name, _, file = key.partition("/")
            step = parse_step_name(name)
            if step is not None and file == MANIFEST_NAME:
                committed.add(step)
        return sorted(committed)

    def has_step(self, step: int) -> bool:
        """One request for the step's manifest (what ``steps()`` looks for), not a listing."""
        path = self.path(step_name(step), MANIFEST_NAME)
        self.fs.invalidate_cache(path)
        try:
            self._call(f"checking step {step}", "info", path)
        except FileNotFoundError:
            return False
        return True

    def open_step(self, step: int) -> StoredStep:
        return _ObjectStep(self, step)

    def begin(self, step: int, *, attempt: str | None = None, part: str | None = None) -> Draft:
        return _ObjectDraft(self, step, attempt, part)

    def check_lease(self) -> None:
        """LockedError if this store's writer lost its lease (taken over, or expired unrenewed): it
        then commits and deletes nothing more, beside a writer that took over (a writer paused past
        its lease, or cut off from the store, resumes here). The lease object is read, not only
        what the renewer last saw: a takeover since its last renewal stops this commit."""
        if self._lease is not None:
            self._lease.confirm()

    def delete(self, step: int) -> None:
        """Remove the manifest (the step is gone for readers), then every object of the step. With the
        manifest gone already (a deletion cut short, or one whose answer was lost), the rest goes too."""
        self.check_lease()
        name = step_name(step)
        with contextlib.suppress(FileNotFoundError):
            self._call(f"deleting step {step}", "rm_file", self.path(name, MANIFEST_NAME))
        faults.reached("after_unlink_manifest")
        self._remove([key for key in self._objects() if key.startswith(name + "/")])

    def leftovers(self) -> list[str]:
        """Objects of steps without a manifest (torn saves, interrupted deletions), and shards a
        committed step's manifest does not name (the loser of a race): only objects named as
        crashsafe names a step's files (another object under ``step_<n>/`` is not crashsafe's)."""
        by_step: dict[str, list[str]] = {}
        for key in self._objects():
            name, _, file = key.partition("/")
            if parse_step_name(name) is not None and is_step_file(file):
                by_step.setdefault(name, []).append(file)
        found = []
        for name, files in sorted(by_step.items()):
            if MANIFEST_NAME not in files:
                found += [f"{name}/{f}" for f in files]
                continue
            step = parse_step_name(name)
            assert step is not None
            try:
                from crashsafe.storage.reader import read_manifest

                named = set(read_manifest(self, step).files)
            except (CorruptCheckpointError, NoCheckpointError):
                continue  # a damaged step keeps its bytes (verify reports it; gc can delete it)
            found += [f"{name}/{f}" for f in files if f != MANIFEST_NAME and f not in named]
        return found

    def remove_leftovers(self, names: Sequence[str]) -> None:
        self.check_lease()
        self._remove(list(names))

    def _remove(self, keys: list[str]) -> None:
        for i, key in enumerate(keys):
            with contextlib.suppress(FileNotFoundError):
                self._call(f"removing {key}", "rm_file", self.path(key))
            if i == 0:
                faults.reached("mid_delete")

    def lock(self) -> Lock:
        self._lease = Lease(self.fs, self.path(LOCK_NAME), self.location, self.lease_seconds, self._call)
        return self._lease

    def stored_bytes(self, step: int) -> int:
        name = step_name(step)
        self.fs.invalidate_cache(self.root)
        try:
            sizes = self._call(f"sizing step {step}", "du", self.path(name), total=False)
        except FileNotFoundError:
            return 0
        return int(sum(sizes.values()))


class _Parts:
    """A large payload as s3fs's multipart upload slices it: each part copied only when sent."""

    def __init__(self, view: memoryview) -> None:
        self._view = view

    def __len__(self) -> int:
        return len(self._view)

    def __getitem__(self, part: slice) -> bytes:
        return bytes(self._view[part])


class _ObjectFile(StoredFile):
    """A shard of a committed step. A packed shard (up to SHARD_BYTES) is fetched whole, one
    request instead of one per payload, and the next ones of the step are fetched ahead while it is
    read (READS at once); once every byte of it was read, its copy is dropped. A shard larger
    than that (one large payload) is read in parallel ranges."""

    def __init__(self, step: _ObjectStep, path: str, size: int, index: int) -> None:
        self._step = step
        self._store = step.store
        self._path = path
        self.size = size
        self.index = index  # the order the reader opened it in: the order it reads shards in
        self._where = step.where
        self._whole: Future[bytes] | None = None
        self._read = 0  # bytes read from the fetched copy
        self._done = False  # every byte was read once (so reading ahead skips it)

    @property
    def packed(self) -> bool:
        return self.size <= SHARD_BYTES

    def fetch_ahead(self) -> None:
        """Start fetching this shard whole in the background, unless it is fetched or was read
        (called under the step's lock)."""
        if self.packed and self._whole is None and not self._done:
            self._whole = self._step.submit(lambda: self._fetch([0], [self.size])[0])

    def read_into(self, view: memoryview, offset: int) -> None:
        n = len(view)
        if offset + n > self.size:
            raise CorruptCheckpointError(f"{self._where}: {self._path} ended early")
        if self.packed:  # readers may be several threads: the bookkeeping is under the step's lock
            with self._step.lock:
                if self._whole is None:  # read again after it was dropped: fetch it again
                    self._done, self._read = False, 0
                self._step.reading(self)
                whole = self._whole
            assert whole is not None
            view[:] = memoryview(whole.result())[offset : offset + n]
            with self._step.lock:
                self._read += n
                if self._read >= self.size and self._whole is whole:  # each byte was read once
                    self._whole, self._done = None, True
            return
        starts = list(range(offset, offset + n, RANGE_BYTES)) or [offset]
        pos = 0
        for part in self._fetch(starts, [min(s + RANGE_BYTES, offset + n) for s in starts]):
            view[pos : pos + len(part)] = part
            pos += len(part)

    def _fetch(self, starts: list[int], ends: list[int]) -> list[bytes]:
        paths, nbytes = [self._path] * len(starts), sum(ends) - sum(starts)
        try:
            parts: list[bytes] = self._store._call(
                f"reading {self._path}", "cat_ranges", paths, starts, ends, on_error="raise", nbytes=nbytes
            )
        except FileNotFoundError:  # damage, or (the reader finds out) a step deleted while read
            raise CorruptCheckpointError(f"{self._where}: {self._path} is missing") from None
        if [len(p) for p in parts] != [e - s for s, e in zip(starts, ends, strict=True)]:
            raise CorruptCheckpointError(f"{self._where}: {self._path} ended early")
        return parts

    def close(self) -> None:
        if self._whole is not None:
            self._whole.cancel()
        self._whole = None


class _ObjectStep(StoredStep):
    def __init__(self, store: FsspecStore, step: int) -> None:
        self.step = step
        self.store = store
        self._name = step_name(step)
        self.where = f"checkpoint step {step} ({store.location}/{self._name})"
        self._sizes: dict[str, int] | None = None
        self._opened: list[_ObjectFile] = []
        self._pool: ThreadPoolExecutor | None = None
        self.lock = threading.Lock()
        self._tag = self._manifest_tag()
        if self._tag is None:
            raise NoCheckpointError(f"step {step} is not committed in {store.location}")

    def _manifest_tag(self) -> str | None:
        """Identity of the manifest object (ETag, or size+mtime), None if it does not exist."""
        path = self.store.path(self._name, MANIFEST_NAME)
        self.store.fs.invalidate_cache(path)
        try:
            info = self.store._call(f"opening step {self.step}", "info", path)
        except FileNotFoundError:
            return None
        return str(
            info.get("ETag") or info.get("etag") or (info.get("size"), info.get("mtime"), info.get("created"))
        )

    def manifest_bytes(self, limit: int) -> bytes:
        path = self.store.path(self._name, MANIFEST_NAME)
        try:
            data: bytes = self.store._call(
                f"reading step {self.step}", "cat_file", path, start=0, end=limit, nbytes=limit
            )
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.where}: manifest.json is missing") from None
        return data

    def _listed_size(self, name: str) -> int | None:
        """The size of the step's object ``name`` from one listing of the step (one request for all
        its shards instead of one each); None if the listing does not show it."""
        if self._sizes is None:
            folder = self.store.path(self._name)
            self.store.fs.invalidate_cache(folder)
            try:
                found = self.store._call(f"listing step {self.step}", "find", folder, detail=True)
            except FileNotFoundError:
                found = {}
            prefix = folder.rstrip("/") + "/"
            self._sizes = {
                key[len(prefix) :]: int(info["size"])
                for key, info in found.items()
                if key.startswith(prefix) and info.get("type", "file") == "file" and "size" in info
            }
        return self._sizes.get(name)

    def open_file(self, name: str) -> StoredFile:
        path = self.store.path(self._name, name)
        size = self._listed_size(name)
        if size is None:  # not listed: ask for it by name (a store whose listing lags)
            try:
                info = self.store._call(f"opening {name} of step {self.step}", "info", path)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.where}: data file {name} is missing") from None
            if info.get("type", "file") != "file":
                raise CorruptCheckpointError(f"{self.where}: {name} is not a file")
            size = int(info["size"])
        file = _ObjectFile(self, path, size, len(self._opened))
        self._opened.append(file)
        return file

    def submit(self, fetch: Callable[[], bytes]) -> Future[bytes]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READS, thread_name_prefix="crashsafe-read")
        return self._pool.submit(fetch)

    def reading(self, file: _ObjectFile) -> None:
        """``file`` is being read: make sure it and the next READS - 1 shards are being fetched
        (called under ``lock``)."""
        file.fetch_ahead()
        ahead = 1
        for other in self._opened[file.index + 1 :]:
            if ahead >= READS:
                break
            if other.packed:
                other.fetch_ahead()
                ahead += 1

    def vanished(self) -> bool:
        return self._manifest_tag() != self._tag

    def close(self) -> None:
        for file in self._opened:
            file.close()
        self._opened.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class _ObjectDraft(Draft):
    """Payloads packed into shards, each uploaded in the background as soon as it is full, while
    the next payloads are still being encoded; the manifest goes last."""

    def __init__(self, store: FsspecStore, step: int, attempt: str | None, part: str | None) -> None:
        self._store = store
        self.step = step
        self._name = step_name(step)
        self._part = "" if part is None else f"{part}-"
        folder = store.path(self._name)  # a no-op on object stores; file:// needs the directory
        try:
            committed = step in store.steps()
            if not committed:
                store._call(f"starting step {step}", "makedirs", folder, exist_ok=True)
        except StorageError as exc:
            raise self._not_committed(exc) from exc
        if committed:
            raise CheckpointExistsError(
                f"step {step} is already committed in {store.location}; committed checkpoints are "
                "never overwritten. Save under a new step, or delete it first with `crashsafe gc`."
            )
        self._attempt = attempt or secrets.token_hex(8)
        self._files: dict[str, int] = {}
        self._current: str | None = None  # the shard being filled with small payloads
        self._buffer = bytearray()
        self._pool = ThreadPoolExecutor(UPLOADS, thread_name_prefix="crashsafe-upload")
        self._uploads: list[Future[None]] = []
        self._uploaded = threading.Lock()

    def write(self, data: BytesLike) -> tuple[str, int]:
        view = memoryview(data).cast("B")
        if len(view) >= SHARD_BYTES:  # a large payload is a shard of its own
            self._flush()
            name = self._new_shard()
            self._files[name] = len(view)
            self._upload(name, view)
            return name, 0
        if self._current is None or len(self._buffer) + len(view) > SHARD_BYTES:
            self._flush()
            self._current = self._new_shard()
        offset = len(self._buffer)
        self._buffer += view
        self._files[self._current] = len(self._buffer)
        return self._current, offset

    def files(self) -> dict[str, int]:
        return dict(self._files)

    def _new_shard(self) -> str:
        return f"data-{self._attempt}-{self._part}{len(self._files):05d}.bin"

    def _flush(self) -> None:
        if self._current is not None and self._buffer:
            data, self._buffer = self._buffer, bytearray()
            self._upload(self._current, memoryview(data))
        self._current = None

    def _upload(self, name: str, data: memoryview) -> None:
        path = self._store.path(self._name, name)
        self._uploads.append(self._pool.submit(self._put, path, data))

    def _put(self, path: str, data: memoryview) -> None:
        body: Any
        options: dict[str, Any] = {}
        if isinstance(data.obj, bytearray):
            body = data.obj  # a packed shard: handed over whole
        elif self._store.is_s3 and len(data) >= 2 * PART_BYTES:
            body = _Parts(data)  # s3fs uploads it in parts, copying one part at a time
            options = {"chunksize": PART_BYTES, "max_concurrency": PARTS_IN_FLIGHT}
        else:
            body = bytes(data)  # fsspec backends take bytes
        self._store._call(f"uploading {path}", "pipe_file", path, body, nbytes=len(data), **options)
        with self._uploaded:
            faults.reached("mid_upload")

    def _not_committed(self, exc: StorageError) -> StorageError:
        """``exc`` saying what it means for the save: nothing of it is committed."""
        return StorageError(f"{exc}. Step {self.step} was not committed; committed checkpoints are intact")

    def persist(self) -> None:
        try:
            self._flush()
            for upload in self._uploads:
                upload.result()  # the first failed upload fails the step
        except StorageError as exc:
            self.abort()
            raise self._not_committed(exc) from exc
        except BaseException:
            self.abort()
            raise
        faults.reached("after_upload_data")

    def commit(self, manifest: bytes) -> None:
        """Upload the manifest last. An upload that failed may still have been carried out (its
        answer lost): the data files are deleted only once the manifest there is known not to be
        this one, and the commit stands if it is. A writer whose lease is lost commits nothing."""
        self.persist()
        try:
            self._store.check_lease()
        except StorageError as exc:  # the store did not answer: nothing was committed
            self.abort()
            raise self._not_committed(exc) from exc
        except BaseException:
            self.abort()  # (removes nothing: the shards are leftovers for the writer that took over)
            raise
        faults.reached("after_lease_check")  # the manifest's upload comes next
        try:
            self._put_manifest(manifest)
        except Exception as exc:
            mine = self._holds(manifest)
            if mine is False:
                self.abort()
                if isinstance(exc, StorageError):
                    raise self._not_committed(exc) from exc
                raise
            if mine is None:  # the files stay until a writer's cleanup finds no manifest naming them
                self._pool.shutdown(wait=True)
                raise StorageError(
                    f"committing step {self.step} in {self._store.location} failed ({exc}), and the store "
                    "cannot say now whether the manifest arrived; `crashsafe verify` will tell once it "
                    "answers. Committed checkpoints are intact"
                ) from exc
        except BaseException:
            self._pool.shutdown(wait=True)  # interrupted: the files stay until a writer cleans up
            raise
        self._pool.shutdown()
        faults.reached("after_put_manifest")

    def _holds(self, manifest: bytes) -> bool | None:
        """Whether the step's manifest in the store is ``manifest`` (None: the store cannot say).
        Reads one byte more than ``manifest`` at most: whatever stands there, memory stays bounded."""
        path = self._store.path(self._name, MANIFEST_NAME)
        end = len(manifest) + 1
        try:
            stored = self._store._call(f"reading {path}", "cat_file", path, start=0, end=end, nbytes=end)
        except FileNotFoundError:
            return False
        except Exception:
            return None
        return bool(stored == manifest)

    def _put_manifest(self, manifest: bytes) -> None:
        path = self._store.path(self._name, MANIFEST_NAME)
        fs = self._store.fs
        if not self._store.capabilities.conditional_put and fs.exists(path):
            raise FileExistsError(path)  # best effort where the store cannot create atomically
        try:
            what = f"committing step {self.step}"
            self._store._call(what, "pipe_file", path, manifest, mode="create", nbytes=len(manifest))
        except FileExistsError:
            raise CheckpointExistsError(
                f"step {self.step} was committed in {self._store.location} by another writer while this "
                "one saved it; its commit stands and this save was dropped"
            ) from None

    def abort(self) -> None:
        for upload in self._uploads:
            upload.cancel()
        self._pool.shutdown(wait=True)
        with contextlib.suppress(Exception):  # best effort: leftovers are invisible and cleaned later
            self._store.remove_leftovers([f"{self._name}/{name}" for name in self._files])
