"""Little binary frames for codec payloads: a magic tag, fixed-width fields and raw arrays.

Payloads are data, never code (no pickle). The reader checks every length against the bytes that
are really there and raises :class:`CodecError` instead of reading past the end or allocating
what a damaged or forged header claims.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from crashsafe.codecs.base import BytesLike
from crashsafe.errors import CodecError

__all__ = ["FrameReader", "FrameWriter"]

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class FrameWriter:
    """Collects the parts of a payload; :meth:`getvalue` joins them once."""

    def __init__(self, magic: bytes) -> None:
        self._parts: list[BytesLike] = [magic]

    def u8(self, value: int) -> None:
        self._parts.append(_U8.pack(value))

    def u32(self, value: int) -> None:
        self._parts.append(_U32.pack(value))

    def u64(self, value: int) -> None:
        self._parts.append(_U64.pack(value))

    def array(self, values: np.ndarray[Any, Any]) -> None:
        """Raw little-endian bytes of ``values`` (the reader must know dtype and count)."""
        self._parts.append(np.ascontiguousarray(values).reshape(-1).view(np.uint8).data)

    def blob(self, data: BytesLike) -> None:
        """A length-prefixed byte string."""
        self.u64(memoryview(data).nbytes)
        self._parts.append(data)

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


class FrameReader:
    """Reads what :class:`FrameWriter` wrote, refusing anything that does not fit."""

    def __init__(self, data: BytesLike, magic: bytes, what: str) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0
        self.what = what
        if bytes(self._view[: len(magic)]) != magic:
            raise CodecError(f"{what} payload does not start with {magic!r}; it is not this codec's output")
        self._pos = len(magic)

    def _take(self, n: int) -> memoryview:
        if n < 0 or self._pos + n > len(self._view):
            raise CodecError(f"{self.what} payload is truncated or its header is damaged")
        out = self._view[self._pos : self._pos + n]
        self._pos += n
        return out

    def u8(self) -> int:
        return int(_U8.unpack(self._take(1))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self._take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack(self._take(8))[0])

    def array(self, dtype: np.dtype[Any] | type[Any], count: int) -> np.ndarray[Any, Any]:
        """A read-only array view of the next ``count`` elements."""
        dt = np.dtype(dtype)
        return np.frombuffer(self._take(count * dt.itemsize), dtype=dt)

    def blob(self) -> memoryview:
        return self._take(self.u64())

    def expect(self, value: int, got: int, field: str) -> None:
        """Raise unless a header field holds the value the caller needs."""
        if value != got:
            raise CodecError(f"{self.what} payload has {field}={got}, expected {value}")

    def done(self) -> None:
        """Raise if bytes are left over (a damaged length somewhere)."""
        if self._pos != len(self._view):
            extra = len(self._view) - self._pos
            raise CodecError(f"{self.what} payload has {extra} unexpected trailing bytes")
