"""CheckpointManager: policy -> snapshot -> encode -> persist -> commit -> retention, and restore.

The training loop waits only for the snapshot (a copy into reusable staging buffers); encoding,
writing, fsync, the atomic commit and retention run in one background thread. At most one save
is in flight: a new save first waits for the previous one, whose error (if any) it raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import numpy as np

from crashsafe.chain import doomed_steps, protected_steps, read_step
from crashsafe.codecs.base import BytesLike, Codec, DeltaCodec, Reference
from crashsafe.codecs.registry import get_codec
from crashsafe.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    CrashsafeError,
    NoCheckpointError,
    SaveFailedError,
    StorageError,
    UnsupportedStateError,
)
from crashsafe.format.dtypes import FLOAT_DTYPES
from crashsafe.format.manifest import MAX_STEP, Manifest, PayloadEntry
from crashsafe.policies.base import EverySteps, SaveContext, SavePolicy
from crashsafe.policies.retention import validate_retention
from crashsafe.state.rebuild import apply_into, check_into, to_value, unflatten
from crashsafe.state.staging import StagingPool, view_bytes
from crashsafe.state.tree import ArrayLeaf, flatten
from crashsafe.storage.layout import committed_steps, leftovers
from crashsafe.storage.localdir import LocalDir
from crashsafe.storage.lock import WriterLock
from crashsafe.storage.reader import read_manifest
from crashsafe.storage.writer import StepWriter, delete_steps, remove_leftovers, storage_error

__all__ = ["CheckpointManager", "CodecSpec", "SaveStats"]

CodecSpec = str | Codec | Mapping[str, str | Codec] | None
_VERSION = "0.1.0"
_READ_ATTEMPTS = 5  # a reader re-lists the steps this often when every step it tried vanished


@dataclass(frozen=True)
class SaveStats:
    """Measured cost of one committed save (seconds and bytes)."""

    step: int
    stall: float
    persist: float
    raw_bytes: int
    stored_bytes: int


class CheckpointManager:
    """Saves and restores training state in ``directory``, one ``step_<n>`` per committed step.

    Args:
        directory: where checkpoints live (created if missing).
        keep_last: keep the newest N committed steps (None keeps all).
        keep_every: also keep every step that is a multiple of this.
        async_save: persist in a background thread after a memcpy snapshot.
        codec: one codec (``"raw"``, ``"zstd"``, a Codec) or ``{glob: codec}`` by state path, most
            specific pattern first. Lossy codecs (``LC``, ``Scar``, ``TopN``) only take float
            tensors; other leaves fall through to the next matching pattern, else ``raw``. Delta
            codecs (``Incremental``, ``LC``, ...) encode against the previous save of the same
            path, which the manager keeps in memory; the first save after start is a full one.
        lossless: glob patterns of state paths that never get a lossy codec.
        policy: decides ``maybe_save``; default saves at every call.
        read_only: open for reading only (no lock; save is refused).
        save_on_sigterm: on SIGTERM, the next ``save``/``maybe_save`` commits, then exits (143).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        async_save: bool = True,
        codec: CodecSpec = None,
        lossless: Sequence[str] = (),
        policy: SavePolicy | None = None,
        read_only: bool = False,
        save_on_sigterm: bool = False,
    ) -> None:
        validate_retention(keep_last, keep_every)
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.read_only = read_only
        self.policy: SavePolicy = policy if policy is not None else EverySteps(1)
        self._codecs = _parse_codecs(codec)
        self._lossless = _parse_patterns(lossless)
        self._tracks: dict[str, _Track] = {}  # per delta-coded path: what its next delta is against
        self._bases: dict[int, frozenset[int]] = {}  # step -> steps its deltas need (cache)
        self._committed = 0  # saves committed by this manager: delta chains restart at multiples
        self._lock: WriterLock | None = None
        self._dir: LocalDir | None = None  # a writer's directory, held open for its lifetime
        self._pool = StagingPool() if async_save else None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[SaveStats] | None = None
        self._pending_step: int | None = None
        self._stats: list[SaveStats] = []
        self._started = time.perf_counter()
        self._stalled = 0.0
        self._last_save: tuple[int, float] | None = None
        self._preempted = threading.Event()
        self._previous_handler: Any = None
        self._closed = False
        if read_only:
            if not self.directory.is_dir():
                raise NoCheckpointError(f"checkpoint directory {self.directory} does not exist")
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._dir = LocalDir.open(self.directory)
        except OSError as exc:
            raise storage_error(exc, f"creating the checkpoint directory {self.directory}") from None
        try:
            self._lock = WriterLock(self._dir)
        except BaseException:
            self._dir.close()
            raise
        remove_leftovers(self._dir, leftovers(self._dir))
        if async_save:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="crashsafe-persist")
        if save_on_sigterm:
            self._install_sigterm()

    # ----------------------------------------------------------------------------- saving

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None) -> None:
        """Checkpoint ``state`` as ``step``. Returns once the state is copied (async) or committed."""
        root = self._writable()
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step <= MAX_STEP:
            raise ValueError(f"step must be a non-negative int below 2**63, got {step!r}")
        step = int(step)
        if not isinstance(state, Mapping):
            raise UnsupportedStateError(f"state must be a dict of named values, got a {type(state).__name__}")
        begin = time.perf_counter()
        self._wait_pending()
        self._check_directory(root, f"saving step {step}")
        committed = frozenset(committed_steps(root))
        if step in committed:
            raise CheckpointExistsError(
                f"step {step} is already committed in {self.directory}; committed checkpoints are "
                "never overwritten. Save under a new step, or delete it with `crashsafe gc`."
            )
        clean_metrics = _clean_metrics(metrics)
        tree, leaves = flatten(state)
        arrays = (
            self._pool.capture(leaves) if self._pool is not None else [view_bytes(leaf) for leaf in leaves]
        )
        stall = time.perf_counter() - begin
        self._stalled += stall
        self._last_save = (step, self._train_time())

        def persist() -> SaveStats:
            return self._persist(root, step, committed, tree, leaves, arrays, clean_metrics, stall)

        if self._executor is None:  # sync: the loop also waits for the write and the commit
            stats = persist()
            blocked = time.perf_counter() - begin
            self._stalled += blocked - stall
            self._stats.append(dataclasses.replace(stats, stall=blocked))
        else:
            self._pending = self._executor.submit(persist)
            self._pending_step = step
        if self._preempted.is_set():
            self._exit_after_preemption()

    def maybe_save(
        self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None
    ) -> bool:
        """Save if the policy says so (or a SIGTERM arrived); return whether it saved."""
        if self._preempted.is_set():
            if self._last_save is None or self._last_save[0] != step:
                self.save(step, state, metrics)
            self._exit_after_preemption()
        context = self.context(step, metrics)
        if not self.policy.should_save(context):
            return False
        self.save(step, state, metrics)
        return True

    def context(self, step: int, metrics: Mapping[str, Any] | None = None) -> SaveContext:
        """The facts a policy decides on, as measured by this manager."""
        if self._pending is not None and self._pending.done():
            self._wait_pending()  # a finished background save: its measured cost is visible now
        stats = self._stats[-5:]
        return SaveContext(
            step=step,
            train_time=self._train_time(),
            last_save_step=self._last_save[0] if self._last_save else None,
            last_save_train_time=self._last_save[1] if self._last_save else None,
            stall=sum(s.stall for s in stats) / len(stats) if stats else None,
            persist=sum(s.persist for s in stats) / len(stats) if stats else None,
            saves=len(self._stats),
            metrics=dict(metrics or {}),
        )

    def wait(self) -> None:
        """Block until every pending save is committed; raise its error if it failed."""
        self._wait_pending()

    @property
    def stats(self) -> list[SaveStats]:
        """Costs of the saves this manager committed, oldest first."""
        return list(self._stats)

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (with ``save_on_sigterm=True``)."""
        return self._preempted.is_set()

    def _train_time(self) -> float:
        return time.perf_counter() - self._started - self._stalled

    def _persist(
        self,
        root: LocalDir,
        step: int,
        committed: frozenset[int],
        tree: dict[str, Any],
        leaves: list[ArrayLeaf],
        arrays: list[np.ndarray[Any, Any]],
        metrics: dict[str, Any],
        stall: float,
    ) -> SaveStats:
        begin = time.perf_counter()
        writer = StepWriter(root, step)
        tracks: dict[str, _Track] = {}
        try:
            entries = []
            for leaf, array in zip(leaves, arrays, strict=True):
                codec = self._codec_for(leaf)
                base = None
                if isinstance(codec, DeltaCodec):
                    payload, base, tracks[leaf.path] = self._encode_delta(codec, leaf, array, step, committed)
                else:
                    payload = codec.encode(array)
                file, offset, nbytes, digest = writer.write_payload(payload)
                entries.append(
                    PayloadEntry(
                        leaf.path,
                        leaf.kind,
                        leaf.dtype,
                        leaf.shape,
                        file,
                        offset,
                        nbytes,
                        digest,
                        codec.get_config(),
                        base,
                    )
                )
            manifest = Manifest(
                step=step,
                created=time.time(),
                tree=tree,
                payloads=tuple(entries),
                files={"data.bin": writer.offset},
                metrics=metrics,
                info={"crashsafe": _VERSION},
            )
            writer.commit(manifest)
        except BaseException:
            writer.abort()
            self._tracks = {}  # references were advanced in place for a step that never committed
            raise
        self._tracks = tracks
        self._bases[step] = frozenset(e.base for e in entries if e.base is not None)
        self._committed += 1
        persisted = time.perf_counter() - begin  # durable and committed; retention comes after
        self._apply_retention(root, step)
        return SaveStats(step, stall, persisted, manifest.raw_nbytes, manifest.stored_nbytes)

    def _codec_for(self, leaf: ArrayLeaf) -> Codec:
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

    def _encode_delta(
        self,
        codec: DeltaCodec,
        leaf: ArrayLeaf,
        array: np.ndarray[Any, Any],
        step: int,
        committed: frozenset[int],
    ) -> tuple[BytesLike, int | None, _Track]:
        """Encode against the path's previous save, or start a new chain with a full save.

        Full saves fall on every ``full_every``-th save of this manager (not of the path), so the
        chains of paths whose ``full_every`` divide each other restart together and retention
        can drop whole old steps. A chain also restarts when its last step is no longer committed
        or is not earlier than ``step`` (a save below an earlier one): a base is always an earlier,
        committed step, or the reader would refuse the delta.
        """
        track = self._tracks.get(leaf.path)
        if (
            track is not None
            and track.step < step
            and track.step in committed
            and track.codec == codec
            and (track.dtype, track.shape) == (leaf.dtype, leaf.shape)
            and self._committed % codec.full_every != 0
        ):
            payload, reference = codec.encode_delta(array, track.reference)
            return payload, track.step, _Track(codec, leaf.dtype, leaf.shape, step, reference)
        payload, reference = codec.encode_delta(array, None)
        return payload, None, _Track(codec, leaf.dtype, leaf.shape, step, reference)

    def _apply_retention(self, root: LocalDir, saved: int) -> list[int]:
        """Delete what the retention policy drops, except steps a kept step's delta chain needs and
        the step just ``saved`` (even when it is older than others, e.g. after a rewind)."""
        doomed = doomed_steps(root, self.keep_last, self.keep_every, self._bases, keep=[saved])
        self._delete(root, doomed)
        return doomed

    def _delete(self, root: LocalDir, steps: list[int]) -> None:
        delete_steps(root, steps)  # dependants before their bases
        for step in steps:
            self._bases.pop(step, None)

    def delete(self, steps: Sequence[int]) -> None:
        """Delete committed ``steps`` crash-safely (each is renamed out of view, then removed).

        Refuses, deleting nothing, if a step that stays needs one of them as a delta base.
        """
        root = self._writable()
        self._wait_pending()
        self._check_directory(root, "deleting steps")
        doomed = sorted(set(steps) & set(committed_steps(root)))
        staying = [s for s in committed_steps(root) if s not in doomed]
        needed = sorted(protected_steps(root, staying, self._bases) & set(doomed))
        if needed:
            raise CrashsafeError(
                f"cannot delete step {needed[0]}: a step that stays is a delta of it. Delete the steps "
                "that depend on it too, or keep it"
            )
        self._delete(root, doomed)

    def gc(self, *, delete_damaged: bool = False) -> list[int]:
        """Apply this manager's retention now (and, with ``delete_damaged``, delete every step that
        does not verify); return the deleted steps. Torn leftovers were removed when it opened."""
        from crashsafe.verification import verify

        root = self._writable()
        self._wait_pending()
        self._check_directory(root, "collecting garbage")
        doomed = set(doomed_steps(root, self.keep_last, self.keep_every, self._bases))
        if delete_damaged:
            doomed |= {r.step for r in verify(self.directory).damaged}
        self._delete(root, sorted(doomed))
        return sorted(doomed)

    def _wait_pending(self) -> None:
        pending, step = self._pending, self._pending_step
        if pending is None:
            return
        self._pending = self._pending_step = None
        try:
            self._stats.append(pending.result())
        except CrashsafeError:
            raise
        except Exception as exc:
            raise SaveFailedError(
                f"saving step {step} in the background failed: {exc!r}. Committed checkpoints are intact."
            ) from exc

    def _writable(self) -> LocalDir:
        if self._closed:
            raise CrashsafeError("this CheckpointManager is closed; create a new one")
        if self.read_only or self._dir is None:
            raise CrashsafeError(
                f"{self.directory} was opened read_only; open it without read_only=True to save"
            )
        return self._dir

    def _check_directory(self, root: LocalDir, doing: str) -> None:
        """Refuse to go on if the directory was deleted or replaced under this writer: its lock
        no longer guards the path, and writing on would fork the run."""
        if not root.is_current():
            raise storage_error(FileNotFoundError(), doing, root)

    @contextlib.contextmanager
    def _root(self) -> Iterator[LocalDir]:
        """The directory to read: a writer's own handle, or (readers) the path opened afresh, so a
        reader follows a directory that is replaced."""
        if self._dir is not None and not self._closed:
            yield self._dir
            return
        try:
            handle = LocalDir.open(self.directory)
        except FileNotFoundError:
            raise NoCheckpointError(f"checkpoint directory {self.directory} does not exist") from None
        except OSError as exc:
            raise storage_error(exc, f"opening the checkpoint directory {self.directory}") from None
        with handle:
            yield handle

    # ----------------------------------------------------------------------------- reading

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        with self._root() as root:
            return committed_steps(root)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int | None = None) -> Manifest:
        """The validated manifest of ``step`` (default: the newest)."""
        with self._root() as root:
            if step is None:
                steps = committed_steps(root)
                if not steps:
                    raise NoCheckpointError(f"no committed checkpoint in {self.directory}")
                step = steps[-1]
            return read_manifest(root, step)

    def load(self, step: int | None = None, *, numpy: bool = False) -> dict[str, Any]:
        """The state as saved: tensors, arrays and python values, checksums verified.

        With ``step=None`` the newest intact step is read; damaged newer steps are skipped with a
        :class:`CorruptCheckpointWarning`. An explicit damaged ``step`` raises.
        """
        loaded = self._load(step, numpy)
        if loaded is None:
            raise NoCheckpointError(f"no committed checkpoint in {self.directory}; nothing to load")
        return loaded[1]

    def restore(self, state: MutableMapping[str, Any], step: int | None = None) -> int | None:
        """Load a checkpoint into ``state`` in place; return its step, or None if there is none.

        Modules, optimizers and schedulers get ``load_state_dict``; tensors and arrays are copied
        into; python values in dicts and lists are replaced. Mismatches are refused before anything
        changes, except what only an object's own ``load_state_dict`` can judge: if one raises,
        restore stops there (``docs/state.md`` says exactly what is checked first).
        """
        if not isinstance(state, MutableMapping):
            raise UnsupportedStateError(
                f"restore needs the dict of live objects, got a {type(state).__name__}"
            )
        loaded = self._load(step, numpy=False)
        if loaded is None:
            return None
        found, saved = loaded
        check_into(state, saved)  # a mismatch raises before anything live is changed
        apply_into(state, saved)
        return found

    def _load(self, step: int | None, numpy: bool) -> tuple[int, dict[str, Any]] | None:
        """The step asked for, or the newest intact one (None if there is no step at all)."""
        if not self.read_only and not self._closed:
            self._wait_pending()
        with self._root() as root:
            if step is not None:
                return step, self._read(root, step, numpy)
            return self._load_newest(root, numpy)

    def _load_newest(self, root: LocalDir, numpy: bool) -> tuple[int, dict[str, Any]] | None:
        """Try committed steps newest first, skipping damaged ones with a warning. A step that a
        writer deletes while it is read is not damage: when every step tried vanished, the steps
        are listed afresh (a reader sees the writer's newer steps then)."""
        damage: dict[int, str] = {}
        for _ in range(_READ_ATTEMPTS):
            steps = committed_steps(root)
            if not steps:
                return None
            vanished = False
            for candidate in reversed(steps):
                if candidate in damage:
                    continue
                try:
                    return candidate, self._read(root, candidate, numpy)
                except (CorruptCheckpointError, StorageError) as exc:
                    damage[candidate] = str(exc)
                    warnings.warn(
                        f"skipping damaged checkpoint: {exc}. Falling back to an older step.",
                        CorruptCheckpointWarning,
                        stacklevel=4,
                    )
                except NoCheckpointError:
                    vanished = True  # deleted by the writer's retention while we read it
            if not vanished:
                break
        if not damage:
            raise NoCheckpointError(
                f"every step of {self.directory} was deleted while it was read, {_READ_ATTEMPTS} times "
                "over; another process is deleting steps. Try again"
            )
        raise CorruptCheckpointError(
            f"every checkpoint in {self.directory} is damaged: "
            + "; ".join(damage[s] for s in sorted(damage, reverse=True))
            + ". Run `crashsafe verify` for details."
        )

    def _read(self, root: LocalDir, step: int, numpy: bool) -> dict[str, Any]:
        try:
            manifest, arrays = read_step(root, step)
        except CorruptCheckpointError:
            self._tracks = {}  # never append deltas to a chain that may hold damage: next save is full
            raise
        except OSError as exc:
            if isinstance(exc, CrashsafeError):
                raise
            raise storage_error(exc, f"reading step {step} from {self.directory}") from None
        values = [to_value(e.kind, e.dtype, a, numpy) for e, a in zip(manifest.payloads, arrays, strict=True)]
        state = unflatten(manifest.tree, values)
        if not isinstance(state, dict):
            raise CorruptCheckpointError(f"step {step}: the saved state is not a dict")
        return state

    # ----------------------------------------------------------------------------- lifecycle

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise CrashsafeError("save_on_sigterm=True must be set up from the main thread")

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            self._preempted.set()

        self._previous_handler = signal.signal(signal.SIGTERM, on_sigterm)

    def _exit_after_preemption(self) -> None:
        self.close()
        raise SystemExit(128 + signal.SIGTERM)

    def close(self) -> None:
        """Wait for the pending save, stop the background thread and release the lock."""
        if self._closed:
            return
        try:
            if not self.read_only:
                self._wait_pending()
        finally:
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self._pool is not None:
                self._pool.clear()
            if self._lock is not None:
                self._lock.release()
            if self._dir is not None:
                self._dir.close()
            if self._previous_handler is not None:
                with contextlib.suppress(ValueError):
                    signal.signal(signal.SIGTERM, self._previous_handler)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
        else:
            with contextlib.suppress(Exception):
                self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, steps={self.steps()})"


@dataclass
class _Track:
    """One delta-coded path: the committed ``step`` whose reconstruction ``reference`` holds."""

    codec: DeltaCodec
    dtype: str
    shape: tuple[int, ...]
    step: int
    reference: Reference


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


def _clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise UnsupportedStateError(f"metrics must be a dict of numbers, got {metrics!r}")
    clean: dict[str, Any] = {}
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise UnsupportedStateError(
                f"metric {key!r} = {value!r} is not a number; metrics hold numbers only"
            ) from None
        clean[str(key)] = number if math.isfinite(number) else repr(number)
    return clean
