"""Incremental lossless codec: XOR against the previous save, byte shuffle, zstd.

Bit-exact for every dtype. Consecutive training states share sign, exponent and the top mantissa
bits, so their XOR is mostly zero bytes in the high byte planes. Every ``full_every``-th save of a
tensor is self-contained, which bounds the chain a restore has to read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe.codecs._frame import FrameReader, FrameWriter
from crashsafe.codecs._lossless import pack, unpack
from crashsafe.codecs.base import BytesLike, DeltaCodec, Reference, check_int, empty_output
from crashsafe.codecs.registry import register_codec
from crashsafe.errors import CodecError

__all__ = ["Incremental"]

MAGIC = b"CSXR"
VERSION = 1
_FULL, _DELTA = 0, 1


@register_codec
@dataclass(frozen=True)
class Incremental(DeltaCodec):
    """Lossless XOR delta against the previous save; ``level`` is the zstd level."""

    codec_id = "incremental"
    full_every: int = 20
    level: int = 1

    def __post_init__(self) -> None:
        check_int("incremental", "full_every", self.full_every, 1)
        check_int("incremental", "level", self.level, -7, 22)

    def encode_delta(
        self, array: np.ndarray[Any, Any], reference: Reference | None
    ) -> tuple[BytesLike, Reference]:
        out = FrameWriter(MAGIC)
        out.u8(VERSION)
        if reference is None:
            out.u8(_FULL)
            out.blob(pack(array, self.level))
            return out.getvalue(), Reference(np.array(array, copy=True))
        if reference.array.shape != array.shape or reference.array.dtype != array.dtype:
            raise CodecError(
                f"incremental reference is {reference.array.dtype}{reference.array.shape}, the array "
                f"{array.dtype}{array.shape}; start a new chain with a full payload"
            )
        out.u8(_DELTA)
        out.blob(pack(array, self.level, against=reference.array))
        np.copyto(reference.array, array)
        return out.getvalue(), reference

    def decode_delta(
        self, data: BytesLike, dtype: np.dtype[Any], shape: tuple[int, ...], reference: Reference | None
    ) -> Reference:
        src = FrameReader(data, MAGIC, "incremental")
        src.expect(VERSION, src.u8(), "version")
        kind = src.u8()
        if kind == _FULL:
            if reference is not None:
                raise CodecError("incremental payload is full but the manifest names a base step")
            out = empty_output(dtype, shape, "incremental")
            unpack(src.blob(), out, xor=False, what="incremental")
            src.done()
            return Reference(out)
        if kind != _DELTA:
            raise CodecError(f"incremental payload has unknown kind {kind}")
        if reference is None:
            raise CodecError(
                "incremental payload is a delta against an earlier step; read it through its chain "
                "(CheckpointManager.load or crashsafe.chain.read_step)"
            )
        if reference.array.shape != tuple(shape) or reference.array.dtype != dtype:
            raise CodecError("incremental delta does not fit the array of its base step")
        unpack(src.blob(), reference.array, xor=True, what="incremental")
        src.done()
        return reference
