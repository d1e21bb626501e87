"""Lossless zstd, with an optional byte shuffle that groups the i-th byte of every element.

Float weights barely compress as they are (~1.08x); shuffling puts the slowly varying exponent
bytes next to each other, which zstd then finds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from crashsafe.codecs.base import BytesLike, Codec
from crashsafe.codecs.registry import register_codec
from crashsafe.errors import CodecError

__all__ = ["Zstd"]


@register_codec
@dataclass(frozen=True)
class Zstd(Codec):
    """zstd at ``level``; ``shuffle`` transposes element bytes first (for multi-byte dtypes)."""

    codec_id = "zstd"
    level: int = 1
    shuffle: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.level, int) or not -7 <= self.level <= 22:
            raise ValueError(f"zstd level must be an int in [-7, 22], got {self.level!r}")
        if not isinstance(self.shuffle, bool):
            raise ValueError("shuffle must be a bool")

    def encode(self, array: np.ndarray[Any, Any]) -> BytesLike:
        raw: np.ndarray[Any, Any] = array.reshape(-1).view(np.uint8)
        if self.shuffle and array.dtype.itemsize > 1:
            raw = raw.reshape(-1, array.dtype.itemsize).T.copy()
        return zstandard.ZstdCompressor(level=self.level).compress(raw.data)

    def decode(self, data: BytesLike, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        try:
            plain = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd payload does not decode: {exc}") from None
        if len(plain) != expected:
            raise CodecError(f"zstd payload decodes to {len(plain)} bytes, expected {expected}")
        raw = np.frombuffer(plain, dtype=np.uint8)
        if self.shuffle and dtype.itemsize > 1:
            raw = raw.reshape(dtype.itemsize, -1).T
        return np.ascontiguousarray(raw).view(dtype).reshape(shape).copy()
