"""Read a committed step's bytes: validate the manifest, then read and checksum each payload.

This layer moves and verifies bytes; it never decodes them (rule 14). Everything is opened
relative to the checkpoint directory's fd without following links (rule 11), so a step or file
symlinked elsewhere, a FIFO or a directory where a file belongs is reported as damage.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

import numpy as np
import xxhash

from crashsafe._memory import alloc_bytes
from crashsafe.errors import CorruptCheckpointError, NoCheckpointError
from crashsafe.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, PayloadEntry, loads
from crashsafe.storage.layout import step_name
from crashsafe.storage.localdir import LocalDir

__all__ = ["StepReader", "open_step", "read_manifest"]

_CHECK_CHUNK = 8 << 20


def open_step(root: LocalDir, step: int) -> LocalDir:
    """The directory of a committed step; NoCheckpointError if there is none."""
    try:
        return root.subdir(step_name(step))
    except FileNotFoundError:
        raise NoCheckpointError(f"step {step} is not committed in {root.path}") from None
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"checkpoint step {step}: {exc}") from None
    except OSError as exc:
        raise CorruptCheckpointError(
            f"checkpoint step {step} cannot be opened ({exc.strerror or exc})"
        ) from None


def _manifest_in(directory: LocalDir, step: int, where: str) -> Manifest:
    try:
        data = directory.read_file(MANIFEST_NAME, MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: manifest.json is missing") from None
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None
    except OSError as exc:
        raise CorruptCheckpointError(
            f"{where}: manifest.json cannot be read ({exc.strerror or exc})"
        ) from None
    manifest = loads(data, f"{where}: manifest.json")
    if manifest.step != step:
        raise CorruptCheckpointError(f"{where}: manifest says step {manifest.step}")
    return manifest


def read_manifest(root: LocalDir, step: int) -> Manifest:
    """The validated manifest of a committed step."""
    with open_step(root, step) as directory:
        try:
            return _manifest_in(directory, step, f"checkpoint step {step} ({directory.path})")
        except CorruptCheckpointError:
            _raise_if_vanished(root, directory, step)
            raise


def _raise_if_vanished(root: LocalDir, directory: LocalDir, step: int) -> None:
    """Raise NoCheckpointError if ``directory`` is no longer the committed step ``step``: a writer
    deleted it while it was read (its files go one by one), which is not damage."""
    if root.entry_identity(step_name(step)) != directory.identity:
        raise NoCheckpointError(
            f"step {step} was deleted (by retention?) while it was read; read another step"
        )


class StepReader:
    """Verified access to one committed step's stored payload bytes (a context manager)."""

    def __init__(self, root: LocalDir, step: int) -> None:
        self.root = root
        self.step = step
        self.dir = open_step(root, step)
        self.where = f"checkpoint step {step} ({self.dir.path})"
        self._fds: dict[str, int] = {}
        try:
            self.manifest = _manifest_in(self.dir, step, self.where)
            for name, size in self.manifest.files.items():
                self._fds[name] = fd = self._open(name)
                actual = os.fstat(fd).st_size
                if actual != size:
                    raise CorruptCheckpointError(
                        f"{self.where}: {name} is {actual} bytes but the manifest says {size} "
                        f"({'truncated' if actual < size else 'extended'})"
                    )
        except CorruptCheckpointError:
            try:
                _raise_if_vanished(root, self.dir, step)
                raise
            finally:
                self.close()
        except BaseException:
            self.close()
            raise

    def _open(self, name: str) -> int:
        try:
            return self.dir.open_file(name)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.where}: data file {name} is missing") from None
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{self.where}: {exc}") from None
        except OSError as exc:
            raise CorruptCheckpointError(
                f"{self.where}: {name} cannot be read ({exc.strerror or exc})"
            ) from None

    def raise_if_vanished(self) -> None:
        """Raise NoCheckpointError if the step read here was deleted meanwhile (by retention):
        then errors about its files are not damage."""
        _raise_if_vanished(self.root, self.dir, self.step)

    def read_stored(self, entry: PayloadEntry) -> np.ndarray[Any, Any]:
        """The stored (encoded) bytes of a payload, checksum-verified."""
        try:
            buf = alloc_bytes(entry.nbytes)
        except (MemoryError, OSError):  # OSError: mmap's ENOMEM
            raise CorruptCheckpointError(
                f"{self.where}: payload '{entry.path}' is {entry.nbytes} bytes, more than this machine "
                "can allocate"
            ) from None
        self._read_into(entry, buf.data, entry.offset)
        self._check(entry, xxhash.xxh3_64_hexdigest(buf.data))
        return buf

    def check_stored(self, entry: PayloadEntry) -> None:
        """Verify a payload's checksum, streaming it through a small buffer (for verification)."""
        buf = np.empty(min(entry.nbytes, _CHECK_CHUNK), dtype=np.uint8)
        digest = xxhash.xxh3_64()
        done = 0
        while done < entry.nbytes:
            view = buf.data[: min(len(buf), entry.nbytes - done)]
            self._read_into(entry, view, entry.offset + done)
            digest.update(view)
            done += len(view)
        self._check(entry, digest.hexdigest())

    def _read_into(self, entry: PayloadEntry, view: memoryview, offset: int) -> None:
        fd = self._fds[entry.file]
        pos = 0
        try:
            while pos < len(view):
                n = os.preadv(fd, [view[pos:]], offset + pos)
                if n == 0:
                    raise CorruptCheckpointError(f"{self.where}: {entry.file} ended early")
                pos += n
        except OSError as exc:
            if isinstance(exc, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(
                f"{self.where}: reading {entry.file} failed ({exc.strerror or exc}); the disk may be damaged"
            ) from None

    def _check(self, entry: PayloadEntry, digest: str) -> None:
        if digest != entry.xxh3:
            raise CorruptCheckpointError(
                f"{self.where}: payload '{entry.path}' fails its checksum ({entry.file} bytes "
                f"{entry.offset}..{entry.offset + entry.nbytes} are damaged)"
            )

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.dir.close()

    def __enter__(self) -> StepReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
