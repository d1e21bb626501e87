"""The identity codec: little-endian C-order bytes, written straight from the staging buffer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe.codecs.base import BytesLike, Codec, empty_output
from crashsafe.codecs.registry import register_codec
from crashsafe.errors import CodecError

__all__ = ["Raw"]


@register_codec
@dataclass(frozen=True)
class Raw(Codec):
    """Store bytes as they are (zero-copy)."""

    codec_id = "raw"

    def encode(self, array: np.ndarray[Any, Any]) -> BytesLike:
        return array.reshape(-1).view(np.uint8).data

    def stored_nbytes(self, raw_nbytes: int) -> int | None:
        return raw_nbytes

    def decode(self, data: BytesLike, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        raw = np.frombuffer(data, dtype=np.uint8)
        expected = math.prod(shape) * dtype.itemsize  # exact: a forged shape must not wrap around
        if raw.size != expected:
            raise CodecError(f"raw payload has {raw.size} bytes, expected {expected}")
        view = raw.view(dtype).reshape(shape)
        if view.flags.writeable:
            return view
        out = empty_output(dtype, shape, "raw")
        out[...] = view
        return out

    def decode_into(self, data: BytesLike, out: np.ndarray[Any, Any]) -> None:
        raw = np.frombuffer(data, dtype=np.uint8)
        if raw.size != out.nbytes:
            raise CodecError(f"raw payload has {raw.size} bytes, expected {out.nbytes}")
        out.reshape(-1).view(np.uint8)[...] = raw
