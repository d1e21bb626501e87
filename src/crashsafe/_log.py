"""Where crashsafe's few log lines go: the ``crashsafe`` logger (one line per resume, per fallback
past a damaged step, per failure that is retried; nothing otherwise), or, inside :func:`through`,
a framework's logger (the Lightning and Hugging Face integrations log where their frameworks do)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, MutableMapping
from contextvars import ContextVar
from typing import Any

__all__ = ["logger", "through"]

Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]

_OWN = logging.getLogger("crashsafe")
_TARGET: ContextVar[Logger | None] = ContextVar("crashsafe_logger", default=None)


def logger() -> Logger:
    """The logger crashsafe's lines go to in this thread (and context) now."""
    return _TARGET.get() or _OWN


class _Prefixed(logging.LoggerAdapter[logging.Logger]):
    """A framework's logger whose lines from crashsafe say so."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"crashsafe: {msg}", kwargs


@contextlib.contextmanager
def through(target: logging.Logger) -> Iterator[None]:
    """Send crashsafe's lines to ``target`` (prefixed ``crashsafe:``) in this thread while inside."""
    token = _TARGET.set(_Prefixed(target, {}))
    try:
        yield
    finally:
        _TARGET.reset(token)
