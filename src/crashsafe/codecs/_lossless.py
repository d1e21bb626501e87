"""Lossless byte packing shared by the delta codecs: optional XOR, byte shuffle, zstd, in chunks.

XOR against the previous save turns unchanged high bytes (sign, exponent, top of the mantissa)
into zeros; the shuffle groups the i-th byte of every element so zstd sees those runs. Working in
chunks of ``CHUNK_BYTES`` keeps the extra memory bounded for tensors of any size.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zstandard

from crashsafe.errors import CodecError

__all__ = ["CHUNK_BYTES", "pack", "unpack"]

CHUNK_BYTES = 1 << 24


def pack(array: np.ndarray[Any, Any], level: int, against: np.ndarray[Any, Any] | None = None) -> bytes:
    """zstd of the chunk-wise byte-shuffled bytes of ``array`` (XOR ``against`` first, if given)."""
    width = array.dtype.itemsize
    raw = array.reshape(-1).view(np.uint8)
    base = None if against is None else against.reshape(-1).view(np.uint8)
    compressor = zstandard.ZstdCompressor(level=level).compressobj()
    parts = []
    step = max(width, CHUNK_BYTES // width * width)
    for start in range(0, raw.size, step):
        chunk = raw[start : start + step]
        if base is not None:
            chunk = np.bitwise_xor(chunk, base[start : start + step])
        if width > 1:
            chunk = chunk.reshape(-1, width).T.copy()
        parts.append(compressor.compress(chunk.data))
    parts.append(compressor.flush())
    return b"".join(parts)


def unpack(data: Any, out: np.ndarray[Any, Any], xor: bool, what: str) -> np.ndarray[Any, Any]:
    """Inverse of :func:`pack` into ``out`` (C-contiguous); with ``xor`` the bytes are XOR-ed in."""
    width = out.dtype.itemsize
    flat = out.reshape(-1).view(np.uint8)
    step = max(width, CHUNK_BYTES // width * width)
    buf = np.empty(min(step, flat.size), dtype=np.uint8)
    try:
        with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False) as reader:
            for start in range(0, flat.size, step):
                n = min(step, flat.size - start)
                view = buf[:n]
                got = 0
                while got < n:
                    read = reader.readinto(view[got:].data)
                    if read == 0:
                        raise CodecError(f"{what} payload decompresses to fewer bytes than its shape needs")
                    got += read
                plain = view.reshape(width, -1).T if width > 1 else view
                target = flat[start : start + n].reshape(plain.shape)
                if xor:
                    np.bitwise_xor(target, plain, out=target)
                else:
                    target[...] = plain
            if reader.read(1):
                raise CodecError(f"{what} payload decompresses to more bytes than its shape needs")
    except zstandard.ZstdError as exc:
        raise CodecError(f"{what} payload does not decompress: {exc}") from None
    return out
