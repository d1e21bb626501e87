"""Codecs: pure, immutable encoders per array, recorded by config in the manifest."""

from crashsafe.codecs.base import Codec
from crashsafe.codecs.raw import Raw
from crashsafe.codecs.registry import codec_ids, get_codec, register_codec
from crashsafe.codecs.zstd import Zstd

__all__ = ["Codec", "Raw", "Zstd", "codec_ids", "get_codec", "register_codec"]
