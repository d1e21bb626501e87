"""Lossless zstd, with an optional byte shuffle that groups the i-th byte of every element.

Float weights barely compress as they are (~1.08x); shuffling puts the slowly varying exponent
bytes next to each other, which zstd then finds. The stream is one zstd frame of the whole array,
plane-major when shuffled (byte 0 of every element, then byte 1, ...); decoding streams it straight
into the declared output, so memory is that output plus a fixed scratch, whatever the frame claims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from crashsafe.codecs._lossless import unpack
from crashsafe.codecs.base import BytesLike, Codec, check_bool, check_int, empty_output
from crashsafe.codecs.registry import register_codec

__all__ = ["Zstd"]


@register_codec
@dataclass(frozen=True)
class Zstd(Codec):
    """zstd at ``level``; ``shuffle`` transposes element bytes first (for multi-byte dtypes)."""

    codec_id = "zstd"
    level: int = 1
    shuffle: bool = True

    def __post_init__(self) -> None:
        check_int("zstd", "level", self.level, -7, 22)
        check_bool("zstd", "shuffle", self.shuffle)

    def encode(self, array: np.ndarray[Any, Any]) -> BytesLike:
        raw: np.ndarray[Any, Any] = array.reshape(-1).view(np.uint8)
        if self.shuffle and array.dtype.itemsize > 1:
            raw = raw.reshape(-1, array.dtype.itemsize).T.copy()
        return zstandard.ZstdCompressor(level=self.level).compress(raw.data)

    def decode(self, data: BytesLike, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        out = empty_output(dtype, shape, "zstd")
        self.decode_into(data, out)
        return out

    def decode_into(self, data: BytesLike, out: np.ndarray[Any, Any]) -> None:
        flat = out.reshape(-1)
        planes = flat if self.shuffle else flat.view(np.uint8)  # one byte plane: the bytes in order
        unpack(data, planes, xor=False, what="zstd", group=max(planes.size, 1))
