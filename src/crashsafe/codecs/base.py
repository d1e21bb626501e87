"""What a codec is: an immutable value that turns one array into bytes and back.

A codec's JSON config (``{"id": ..., **params}``) is recorded per payload in the manifest, so a
checkpoint decodes with nothing but itself (and, for a :class:`DeltaCodec`, the base steps its
manifest names). Two codec classes may share an id only if each decodes the other's output.
"""

from __future__ import annotations

import math
import reprlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from crashsafe.errors import CodecError

__all__ = [
    "BytesLike",
    "Codec",
    "DeltaCodec",
    "Reference",
    "check_bool",
    "check_choice",
    "check_int",
    "empty_output",
]

BytesLike = bytes | bytearray | memoryview
INT64_MAX = 2**63 - 1  # every int in a manifest, codec parameters included, is an int64


class Codec(ABC):
    """Base class of every codec. Subclasses are frozen dataclasses with JSON-able fields."""

    codec_id: ClassVar[str]
    lossy: ClassVar[bool] = False

    @abstractmethod
    def encode(self, array: np.ndarray[Any, Any]) -> BytesLike:
        """Encode a C-contiguous array (in its storage dtype) into bytes."""

    @abstractmethod
    def decode(self, data: BytesLike, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        """Decode bytes back into a writable array of ``dtype`` and ``shape``."""

    def decode_into(self, data: BytesLike, out: np.ndarray[Any, Any]) -> None:
        """Decode bytes into ``out`` (C-contiguous, the declared dtype and shape), e.g. the memory of
        the live tensor a restore fills. This default decodes, then copies; codecs that can write
        their output in place override it (restore then holds no second copy)."""
        np.copyto(out, self.decode(data, out.dtype, out.shape), casting="no")

    def stored_nbytes(self, raw_nbytes: int) -> int | None:
        """The exact encoded size for ``raw_nbytes`` of input, if the codec fixes it (else None).

        Lets verification catch a manifest whose shape and payload size disagree without decoding.
        """
        return None

    def get_config(self) -> dict[str, Any]:
        """JSON config: ``id`` plus the constructor parameters."""
        params = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return {"id": self.codec_id, **params}


@dataclass(eq=False)
class Reference:
    """What a delta codec encodes against: the reconstruction of the previous save, plus memo.

    ``array`` holds exactly what decoding the chain so far yields (storage dtype and shape);
    ``memo`` is codec-private state that both sides evolve identically (e.g. a cached Huffman
    table). Codecs update a reference in place, so whoever keeps one owns it exclusively.
    """

    array: np.ndarray[Any, Any]
    memo: object = None


class DeltaCodec(Codec):
    """A codec that may encode an array as a delta against a :class:`Reference`.

    The codec value stays immutable and stateless; the caller (the manager, or a chain reader)
    keeps the reference. ``encode_delta(a, None)`` writes a self-contained *full* payload, so
    :meth:`encode`/:meth:`decode` work on full payloads like any codec. ``full_every`` bounds a
    chain: every ``full_every``-th save of a path is full. The built-in delta codecs share one
    payload frame and differ only in how they code the change (``codecs/_delta.py``).
    """

    full_every: int

    @abstractmethod
    def encode_delta(
        self, array: np.ndarray[Any, Any], reference: Reference | None
    ) -> tuple[BytesLike, Reference]:
        """Encode ``array`` against ``reference`` (None: a full payload).

        Returns the payload and the new reference, which equals bit for bit what
        :meth:`decode_delta` returns for that payload and the same input reference. The input
        reference may be updated in place and returned; ``array`` is never kept.
        """

    @abstractmethod
    def decode_delta(
        self, data: BytesLike, dtype: np.dtype[Any], shape: tuple[int, ...], reference: Reference | None
    ) -> Reference:
        """Decode a payload (against ``reference`` if it is a delta); may update it in place."""

    def encode(self, array: np.ndarray[Any, Any]) -> BytesLike:
        return self.encode_delta(array, None)[0]

    def decode(self, data: BytesLike, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        return self.decode_delta(data, dtype, shape, None).array


def empty_output(dtype: np.dtype[Any], shape: tuple[int, ...], what: str) -> np.ndarray[Any, Any]:
    """The one array a decode allocates: exactly the declared ``dtype`` and ``shape``, never a size
    read from the payload; CodecError (not MemoryError) when it cannot be allocated."""
    try:
        return np.empty(shape, dtype=dtype)
    except (MemoryError, ValueError):  # ValueError: more than numpy can address
        nbytes = math.prod(shape) * dtype.itemsize
        raise CodecError(
            f"{what} payload declares {nbytes} bytes ({dtype} {list(shape)}), which cannot be allocated: "
            "the manifest is damaged or forged, or this machine lacks the memory"
        ) from None


def check_int(codec: str, name: str, value: object, low: int, high: int = INT64_MAX) -> None:
    """Raise ValueError unless ``value`` is an int in ``[low, high]`` (a bool or 3.0 is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{codec} {name} must be an int in [{low}, {high}], got {reprlib.repr(value)}")


def check_bool(codec: str, name: str, value: object) -> None:
    """Raise ValueError unless ``value`` is a bool (1 is not)."""
    if not isinstance(value, bool):
        raise ValueError(f"{codec} {name} must be a bool, got {reprlib.repr(value)}")


def check_choice(codec: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise ValueError unless ``value`` is one of the strings ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{codec} {name} must be one of {choices}, got {reprlib.repr(value)}")
