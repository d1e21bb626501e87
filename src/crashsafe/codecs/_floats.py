"""Floating-point formats the lossy codecs accept, and exact conversions to a compute type.

Arithmetic runs in float32 (float16, bfloat16, float32) or float64 (float64). bfloat16 is stored as
uint16 bits (see ``format/dtypes.py``); lossy codecs only ever see float tensors, so a uint16 array
given to them *is* bfloat16. Encoder and decoder call the same functions in the same order, which
is what makes a decoded reconstruction equal the encoder's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe.errors import CodecError

__all__ = ["FloatFormat", "float_format", "format_by_code"]


@dataclass(frozen=True)
class FloatFormat:
    """One storage float type and its compute type."""

    code: int
    name: str
    storage: np.dtype[Any]
    compute: np.dtype[Any]
    bits: np.dtype[Any]  # unsigned integer as wide as ``compute``
    mantissa: int  # mantissa bits of ``compute``
    exp_max: int  # all-ones exponent field of ``compute`` (inf/nan)

    def to_compute(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """``x`` (storage) as compute values; may return ``x`` itself for float32/float64."""
        if self.name == "bfloat16":
            return (x.astype(np.uint32) << 16).view(np.float32)
        if self.storage == self.compute:
            return x
        return x.astype(self.compute)

    def from_compute(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Round compute values to storage (round to nearest even; NaN stays NaN)."""
        if self.name == "bfloat16":
            b = x.view(np.uint32)
            rounded = ((b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
            nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
            if nan.any():
                rounded[nan] = ((b[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
            return rounded
        if self.storage == self.compute:
            return x
        return x.astype(self.storage)

    def delta(self, new: np.ndarray[Any, Any], old: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """``new - old`` in compute precision."""
        out: np.ndarray[Any, Any]
        if self.storage == self.compute:
            out = np.subtract(new, old)
        else:
            out = np.subtract(self.to_compute(new), self.to_compute(old))
        return out

    def isfinite(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Finite-ness of storage values."""
        if self.name == "bfloat16":
            finite_bf16: np.ndarray[Any, Any] = np.not_equal(x & np.uint16(0x7F80), np.uint16(0x7F80))
            return finite_bf16
        finite: np.ndarray[Any, Any] = np.isfinite(x)
        return finite


_FORMATS = (
    FloatFormat(1, "float16", np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.uint32), 23, 255),
    FloatFormat(2, "bfloat16", np.dtype(np.uint16), np.dtype(np.float32), np.dtype(np.uint32), 23, 255),
    FloatFormat(3, "float32", np.dtype(np.float32), np.dtype(np.float32), np.dtype(np.uint32), 23, 255),
    FloatFormat(4, "float64", np.dtype(np.float64), np.dtype(np.float64), np.dtype(np.uint64), 52, 2047),
)


def float_format(dtype: np.dtype[Any], codec: str) -> FloatFormat:
    """The format of a storage dtype, or a CodecError naming what the codec accepts."""
    for fmt in _FORMATS:
        if fmt.storage == dtype:
            return fmt
    raise CodecError(
        f"the {codec} codec is lossy and takes float16, bfloat16, float32 or float64 tensors, not "
        f"{dtype}; store other tensors with a lossless codec (the manager does so automatically)"
    )


def format_by_code(code: int, what: str) -> FloatFormat:
    for fmt in _FORMATS:
        if fmt.code == code:
            return fmt
    raise CodecError(f"{what} payload names an unknown float format {code}")
