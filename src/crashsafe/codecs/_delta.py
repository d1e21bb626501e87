"""The frame every built-in delta codec writes; a codec supplies only how it encodes the change.

A payload is ``magic, u8 version, u8 kind (0 full, 1 delta)``, then for codecs of float tensors a
``u8`` float format, then either the whole array (byte-shuffled zstd: self-contained) or the
codec's change against the reference. The header, the full payload, the checks that a reference
fits its array and the errors a reader sees are written here once, for every codec alike.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from crashsafe.codecs._floats import FloatFormat, float_format, format_by_code
from crashsafe.codecs._frame import FrameReader, FrameWriter
from crashsafe.codecs._lossless import pack, unpack
from crashsafe.codecs.base import BytesLike, DeltaCodec, Reference, check_int, empty_output
from crashsafe.errors import CodecError

__all__ = ["FloatDeltaCodec", "FramedDeltaCodec"]

VERSION = 1
FULL, DELTA = 0, 1

FormatT = TypeVar("FormatT", FloatFormat, None)


class FramedDeltaCodec(DeltaCodec, Generic[FormatT]):
    """A :class:`DeltaCodec` in the shared frame; subclasses write and read only the change.

    ``FormatT`` is what the header records about the element type: a :class:`FloatFormat` for
    codecs that compute in floats, ``None`` for codecs that take any dtype.
    """

    magic: ClassVar[bytes]

    def __post_init__(self) -> None:
        self._check_parameters()
        check_int(self.codec_id, "full_every", self.full_every, 1)

    def _check_parameters(self) -> None:
        """Raise ValueError for an invalid codec-specific parameter (``full_every`` is checked here)."""

    def _full_level(self) -> int:
        """The zstd level of a full payload."""
        return 1

    @abstractmethod
    def _format(self, dtype: np.dtype[Any]) -> FormatT:
        """What the header records about ``dtype``; raises CodecError for a dtype the codec refuses."""

    @abstractmethod
    def _encode_change(
        self, array: np.ndarray[Any, Any], reference: Reference, fmt: FormatT, out: FrameWriter
    ) -> None:
        """Write the change from ``reference`` to ``array`` into ``out``, and update ``reference``
        in place to exactly what :meth:`_decode_change` will make of it."""

    @abstractmethod
    def _decode_change(self, src: FrameReader, reference: Reference, fmt: FormatT) -> None:
        """Apply the change read from ``src`` to ``reference`` in place; CodecError if it is damaged."""

    def encode_delta(
        self, array: np.ndarray[Any, Any], reference: Reference | None
    ) -> tuple[BytesLike, Reference]:
        fmt = self._format(array.dtype)
        out = FrameWriter(self.magic)
        out.u8(VERSION)
        out.u8(FULL if reference is None else DELTA)
        if fmt is not None:
            out.u8(fmt.code)
        if reference is None:
            out.blob(pack(array, self._full_level()))
            return out.getvalue(), Reference(np.array(array, copy=True))
        if reference.array.shape != array.shape or reference.array.dtype != array.dtype:
            raise CodecError(
                f"{self.codec_id} reference is {reference.array.dtype}{reference.array.shape}, the "
                f"array {array.dtype}{array.shape}; start a new chain with a full payload"
            )
        self._encode_change(array, reference, fmt, out)
        return out.getvalue(), reference

    def decode_delta(
        self, data: BytesLike, dtype: np.dtype[Any], shape: tuple[int, ...], reference: Reference | None
    ) -> Reference:
        return self._decode_frame(data, dtype, shape, reference, None)

    def decode_into(self, data: BytesLike, out: np.ndarray[Any, Any]) -> None:
        self._decode_frame(data, out.dtype, out.shape, None, out)  # a full payload, unpacked in place

    def _decode_frame(
        self,
        data: BytesLike,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        reference: Reference | None,
        into: np.ndarray[Any, Any] | None,
    ) -> Reference:
        what = self.codec_id
        fmt = self._format(dtype)
        src = FrameReader(data, self.magic, what)
        src.expect(VERSION, src.u8(), "version")
        kind = src.u8()
        if fmt is not None and format_by_code(src.u8(), what) is not fmt:
            raise CodecError(f"{what} payload holds another float type than the manifest's {dtype}")
        if kind == FULL:
            if reference is not None:
                raise CodecError(f"{what} payload is a full checkpoint but the manifest names a base step")
            out = empty_output(dtype, shape, what) if into is None else into
            unpack(src.blob(), out, xor=False, what=what)
            src.done()
            return Reference(out)
        if kind != DELTA:
            raise CodecError(f"{what} payload has unknown kind {kind}")
        if reference is None:
            raise CodecError(
                f"{what} payload is a delta against an earlier step; read it through its chain "
                "(CheckpointManager.load or crashsafe.chain.read_step)"
            )
        if reference.array.shape != tuple(shape) or reference.array.dtype != dtype:
            raise CodecError(f"{what} delta does not fit the reconstruction of its base step")
        self._decode_change(src, reference, fmt)
        src.done()
        return reference


class FloatDeltaCodec(FramedDeltaCodec[FloatFormat]):
    """A framed delta codec for float tensors only (it computes in floats, so it is lossy); the
    header records the float type, which a decoder checks against the manifest's dtype."""

    lossy = True

    def _format(self, dtype: np.dtype[Any]) -> FloatFormat:
        return float_format(dtype, self.codec_id)
