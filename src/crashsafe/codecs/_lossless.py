"""Lossless byte packing shared by the delta codecs: optional XOR, byte shuffle, zstd, in chunks.

XOR against the previous save turns unchanged high bytes (sign, exponent, top of the mantissa)
into zeros; the shuffle groups the i-th byte of every element so zstd sees those runs. Working in
chunks of ``CHUNK_BYTES`` keeps the extra memory bounded for tensors of any size. Decoding streams
into the output the caller allocated for the declared shape, never trusting sizes in the payload.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zstandard

from crashsafe.errors import CodecError

__all__ = ["CHUNK_BYTES", "pack", "unpack"]

CHUNK_BYTES = 1 << 24
SCRATCH_BYTES = 1 << 20  # decode scratch: fits in cache while it is spread over the output's columns


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


def unpack(
    data: Any, out: np.ndarray[Any, Any], xor: bool, what: str, group: int | None = None
) -> np.ndarray[Any, Any]:
    """Inverse of :func:`pack` into ``out`` (C-contiguous); with ``xor`` the bytes are XOR-ed in.

    The stream holds ``out``'s bytes shuffled per ``group`` elements (default: :func:`pack`'s chunks):
    byte 0 of each element of the group, then byte 1, ... It is decompressed a scratch buffer at a
    time straight into the strided byte columns of ``out``, so decoding allocates nothing sized by
    the payload, and exactly ``out.nbytes`` bytes must come out of one zstd frame.
    """
    width = out.dtype.itemsize
    columns = out.reshape(-1).view(np.uint8).reshape(-1, width)
    per_group = group or max(1, CHUNK_BYTES // width)
    scratch = np.empty(max(1, min(SCRATCH_BYTES, out.nbytes)), dtype=np.uint8)
    try:
        with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False) as reader:
            for start in range(0, columns.shape[0], per_group):
                for plane in columns[start : start + per_group].T:
                    _read_plane(reader, plane, scratch, xor, what)
            if reader.read(1):
                raise CodecError(f"{what} payload decompresses to more bytes than its shape needs")
    except zstandard.ZstdError as exc:
        raise CodecError(f"{what} payload does not decompress: {exc}") from None
    return out


def _read_plane(
    reader: Any, plane: np.ndarray[Any, Any], scratch: np.ndarray[Any, Any], xor: bool, what: str
) -> None:
    """Fill one byte plane (a strided view) from the stream, a scratch buffer at a time."""
    for start in range(0, plane.size, scratch.size):
        target = plane[start : start + scratch.size]
        if not xor and target.flags.c_contiguous:  # a single plane: no need for the scratch
            _fill(reader, target, what)
            continue
        piece = scratch[: target.size]
        _fill(reader, piece, what)
        if xor:
            np.bitwise_xor(target, piece, out=target)
        else:
            target[...] = piece


def _fill(reader: Any, target: np.ndarray[Any, Any], what: str) -> None:
    """Read exactly ``target.size`` decompressed bytes into the contiguous uint8 ``target``."""
    view = target.data
    got = 0
    while got < len(view):
        read = reader.readinto(view[got:])
        if read == 0:
            raise CodecError(f"{what} payload decompresses to fewer bytes than its shape needs")
        got += read
