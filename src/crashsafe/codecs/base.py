"""What a codec is: an immutable value that turns one array into bytes and back.

A codec's JSON config (``{"id": ..., **params}``) is recorded per payload in the manifest, so a
checkpoint decodes with nothing but itself. Two codec classes may share an id only if each decodes
the other's output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

__all__ = ["BytesLike", "Codec"]

BytesLike = bytes | bytearray | memoryview


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

    def stored_nbytes(self, raw_nbytes: int) -> int | None:
        """The exact encoded size for ``raw_nbytes`` of input, if the codec fixes it (else None).

        Lets verification catch a manifest whose shape and payload size disagree without decoding.
        """
        return None

    def get_config(self) -> dict[str, Any]:
        """JSON config: ``id`` plus the constructor parameters."""
        params = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return {"id": self.codec_id, **params}
