"""Codec registry: id -> class, and config -> codec value."""

from __future__ import annotations

import reprlib
from typing import Any

from crashsafe.codecs.base import Codec
from crashsafe.errors import CodecError

__all__ = ["codec_ids", "get_codec", "register_codec"]

_REGISTRY: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec], *, replace: bool = False) -> type[Codec]:
    """Register a codec class under its ``codec_id`` (usable as a decorator)."""
    if cls.codec_id in _REGISTRY and _REGISTRY[cls.codec_id] is not cls and not replace:
        raise CodecError(
            f"codec id {cls.codec_id!r} is already registered by "
            f"{_REGISTRY[cls.codec_id].__qualname__}; pass replace=True to override"
        )
    _REGISTRY[cls.codec_id] = cls
    return cls


def codec_ids() -> list[str]:
    """Ids of every registered codec."""
    return sorted(_REGISTRY)


def get_codec(config: str | dict[str, Any] | Codec) -> Codec:
    """A codec value from an id string, a JSON config, or a codec (returned as is)."""
    if isinstance(config, Codec):
        return config
    if isinstance(config, str):
        config = {"id": config}
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise CodecError(
            f"a codec is named by an id string or a config dict with 'id', not {reprlib.repr(config)}"
        )
    params = dict(config)
    cid = params.pop("id")
    cls = _REGISTRY.get(cid)
    if cls is None:
        raise CodecError(f"unknown codec {reprlib.repr(cid)}; known codecs: {', '.join(codec_ids())}")
    try:
        return cls(**params)
    except Exception as exc:  # any failure to build from a (possibly forged) config: names, keys, types
        raise CodecError(f"invalid parameters for codec {cid!r}: {exc}") from None
