"""Read a committed step: validate the manifest, then read and checksum each payload before use."""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import xxhash

from crashsafe._memory import alloc_bytes
from crashsafe.codecs.registry import get_codec
from crashsafe.errors import CodecError, CorruptCheckpointError, NoCheckpointError
from crashsafe.format.dtypes import storage_dtype
from crashsafe.format.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    PayloadEntry,
    loads,
)
from crashsafe.storage.layout import step_dir

__all__ = ["StepReader", "read_manifest"]


def read_manifest(root: Path, step: int) -> Manifest:
    """The validated manifest of a committed step."""
    path = step_dir(root, step)
    where = f"checkpoint step {step} ({path})"
    if not path.is_dir():
        raise NoCheckpointError(f"step {step} is not committed in {root}")
    try:
        with open(path / MANIFEST_NAME, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: manifest.json is missing") from None
    manifest = loads(data, f"{where}: manifest.json")
    if manifest.step != step:
        raise CorruptCheckpointError(f"{where}: manifest says step {manifest.step}")
    return manifest


class StepReader:
    """Verified access to one committed step's payloads (a context manager)."""

    def __init__(self, root: Path, step: int) -> None:
        self.root = root
        self.step = step
        self.path = step_dir(root, step)
        self.where = f"checkpoint step {step} ({self.path})"
        self.manifest = read_manifest(root, step)
        self._fds: dict[str, int] = {}
        try:
            for name, size in self.manifest.files.items():
                try:
                    fd = os.open(self.path / name, os.O_RDONLY)
                except FileNotFoundError:
                    raise CorruptCheckpointError(f"{self.where}: data file {name} is missing") from None
                self._fds[name] = fd
                actual = os.fstat(fd).st_size
                if actual != size:
                    raise CorruptCheckpointError(
                        f"{self.where}: {name} is {actual} bytes but the manifest says {size} "
                        f"({'truncated' if actual < size else 'extended'})"
                    )
        except BaseException:
            self.close()
            raise

    def read_stored(self, entry: PayloadEntry) -> np.ndarray[Any, Any]:
        """The stored (encoded) bytes of a payload, checksum-verified."""
        buf = alloc_bytes(entry.nbytes)
        view = buf.data
        fd = self._fds[entry.file]
        pos = 0
        while pos < entry.nbytes:
            n = os.preadv(fd, [view[pos:]], entry.offset + pos)
            if n == 0:
                raise CorruptCheckpointError(f"{self.where}: {entry.file} ended early")
            pos += n
        digest = xxhash.xxh3_64_hexdigest(view)
        if digest != entry.xxh3:
            raise CorruptCheckpointError(
                f"{self.where}: payload '{entry.path}' fails its checksum ({entry.file} bytes "
                f"{entry.offset}..{entry.offset + entry.nbytes} are damaged)"
            )
        return buf

    def read(self, entry: PayloadEntry) -> np.ndarray[Any, Any]:
        """Verified, decoded array of a payload in its storage dtype."""
        stored = self.read_stored(entry)
        try:
            codec = get_codec(entry.codec)
            return codec.decode(stored.data, storage_dtype(entry.dtype), entry.shape)
        except CodecError as exc:
            raise CorruptCheckpointError(f"{self.where}: payload '{entry.path}': {exc}") from None

    def verify(self) -> None:
        """Check every payload's codec, size and checksum (raises CorruptCheckpointError)."""
        for entry in self.manifest.payloads:
            try:
                codec = get_codec(entry.codec)
            except CodecError as exc:
                raise CorruptCheckpointError(f"{self.where}: payload '{entry.path}': {exc}") from None
            expected = codec.stored_nbytes(entry.raw_nbytes)
            if expected is not None and expected != entry.nbytes:
                raise CorruptCheckpointError(
                    f"{self.where}: payload '{entry.path}' has {entry.nbytes} bytes but its shape and "
                    f"codec imply {expected}"
                )
            self.read_stored(entry)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> StepReader:
        return self

    def __exit__(
        self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]
    ) -> None:
        self.close()
