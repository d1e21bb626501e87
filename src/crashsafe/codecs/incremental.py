"""Incremental lossless codec: XOR against the previous save, byte shuffle, zstd.

Bit-exact for every dtype. Consecutive training states share sign, exponent and the top mantissa
bits, so their XOR is mostly zero bytes in the high byte planes. Every ``full_every``-th save of a
tensor is self-contained, which bounds the chain a restore has to read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe.codecs._delta import FramedDeltaCodec
from crashsafe.codecs._frame import FrameReader, FrameWriter
from crashsafe.codecs._lossless import pack, unpack
from crashsafe.codecs.base import Reference, check_int
from crashsafe.codecs.registry import register_codec

__all__ = ["Incremental"]


@register_codec
@dataclass(frozen=True)
class Incremental(FramedDeltaCodec[None]):
    """Lossless XOR delta against the previous save; ``level`` is the zstd level."""

    codec_id = "incremental"
    magic = b"CSXR"
    full_every: int = 20
    level: int = 1

    def _check_parameters(self) -> None:
        check_int("incremental", "level", self.level, -7, 22)

    def _full_level(self) -> int:
        return self.level

    def _format(self, dtype: np.dtype[Any]) -> None:
        return None  # any dtype: the change is in bytes

    def _encode_change(
        self, array: np.ndarray[Any, Any], reference: Reference, fmt: None, out: FrameWriter
    ) -> None:
        out.blob(pack(array, self.level, against=reference.array))
        np.copyto(reference.array, array)

    def _decode_change(self, src: FrameReader, reference: Reference, fmt: None) -> None:
        unpack(src.blob(), reference.array, xor=True, what="incremental")
