"""Read a committed step of any store: validate its manifest, then read and checksum payloads.

This layer verifies bytes; it never decodes them (rule 14). The store underneath only moves bytes
(:mod:`crashsafe.storage.base`); everything a store could get wrong (a short file, a forged or
damaged manifest, a payload that does not match its checksum) is caught here, for every backend.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from crashsafe._closing import Closing
from crashsafe._memory import alloc_bytes
from crashsafe.errors import CorruptCheckpointError, NoCheckpointError
from crashsafe.format.manifest import MAX_MANIFEST_BYTES, Manifest, PayloadEntry, loads
from crashsafe.storage.base import Store, StoredFile, StoredStep

__all__ = ["StepReader", "read_manifest"]

_CHECK_CHUNK = 8 << 20


def _manifest_of(stored: StoredStep) -> Manifest:
    manifest = loads(stored.manifest_bytes(MAX_MANIFEST_BYTES + 1), f"{stored.where}: manifest.json")
    if manifest.step != stored.step:
        raise CorruptCheckpointError(f"{stored.where}: manifest says step {manifest.step}")
    return manifest


def _vanished(stored: StoredStep) -> NoCheckpointError:
    return NoCheckpointError(
        f"step {stored.step} was deleted (by retention?) while it was read; read another step"
    )


def read_manifest(store: Store, step: int) -> Manifest:
    """The validated manifest of a committed step."""
    with store.open_step(step) as stored:
        try:
            return _manifest_of(stored)
        except CorruptCheckpointError:
            if stored.vanished():  # deleted while read: its files go one by one
                raise _vanished(stored) from None
            raise


class StepReader(Closing):
    """Verified access to one committed step's stored payload bytes (a context manager)."""

    def __init__(self, store: Store, step: int) -> None:
        self.step = step
        self._stored = store.open_step(step)
        self.where = self._stored.where
        self._files: dict[str, StoredFile] = {}
        try:
            self.manifest = _manifest_of(self._stored)
            for name, size in self.manifest.files.items():
                self._files[name] = file = self._stored.open_file(name)
                if file.size != size:
                    raise CorruptCheckpointError(
                        f"{self.where}: {name} is {file.size} bytes but the manifest says {size} "
                        f"({'truncated' if file.size < size else 'extended'})"
                    )
        except CorruptCheckpointError:
            vanished = self._stored.vanished()
            self.close()
            if vanished:
                raise _vanished(self._stored) from None
            raise
        except BaseException:
            self.close()
            raise

    def raise_if_vanished(self) -> None:
        """Raise NoCheckpointError if the step read here was deleted meanwhile (by retention):
        then errors about its files are not damage."""
        if self._stored.vanished():
            raise _vanished(self._stored)

    def read_stored(self, entry: PayloadEntry) -> np.ndarray[Any, Any]:
        """The stored (encoded) bytes of a payload, checksum-verified."""
        try:
            buf = alloc_bytes(entry.nbytes)
        except (MemoryError, OSError):  # OSError: mmap's ENOMEM
            raise CorruptCheckpointError(
                f"{self.where}: payload '{entry.path}' is {entry.nbytes} bytes, more than this machine "
                "can allocate"
            ) from None
        self._files[entry.file].read_into(buf.data, entry.offset)
        self._check(entry, xxhash.xxh3_64_hexdigest(buf.data))
        return buf

    def check_stored(self, entry: PayloadEntry) -> None:
        """Verify a payload's checksum, streaming it through a small buffer (for verification)."""
        buf = np.empty(min(entry.nbytes, _CHECK_CHUNK), dtype=np.uint8)
        digest = xxhash.xxh3_64()
        done = 0
        while done < entry.nbytes:
            view = buf.data[: min(len(buf), entry.nbytes - done)]
            self._files[entry.file].read_into(view, entry.offset + done)
            digest.update(view)
            done += len(view)
        self._check(entry, digest.hexdigest())

    def _check(self, entry: PayloadEntry, digest: str) -> None:
        if digest != entry.xxh3:
            raise CorruptCheckpointError(
                f"{self.where}: payload '{entry.path}' fails its checksum ({entry.file} bytes "
                f"{entry.offset}..{entry.offset + entry.nbytes} are damaged)"
            )

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()
        self._stored.close()
