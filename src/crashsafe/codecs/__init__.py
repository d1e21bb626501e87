"""Codecs: immutable encoders per array, recorded by config in the manifest.

Lossless: :class:`Raw`, :class:`Zstd`, :class:`Incremental` (XOR delta chains). Lossy, for float
tensors only: :class:`LC` (LC-checkpoint), and the baselines :class:`Scar` and :class:`TopN`.
Delta codecs (:class:`DeltaCodec`) encode against a :class:`Reference` the manager keeps.
"""

from crashsafe.codecs.base import Codec, DeltaCodec, Reference
from crashsafe.codecs.incremental import Incremental
from crashsafe.codecs.lc import LC
from crashsafe.codecs.partial import Scar, TopN
from crashsafe.codecs.raw import Raw
from crashsafe.codecs.registry import codec_ids, get_codec, register_codec
from crashsafe.codecs.zstd import Zstd

__all__ = [
    "LC",
    "Codec",
    "DeltaCodec",
    "Incremental",
    "Raw",
    "Reference",
    "Scar",
    "TopN",
    "Zstd",
    "codec_ids",
    "get_codec",
    "register_codec",
]
