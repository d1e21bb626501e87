"""What crashsafe tells its user. Log lines go to the ``crashsafe`` logger (one line per resume, per
fallback past a damaged step, per failure that is retried; nothing otherwise), or, inside
:func:`through`, to a framework's logger (the Lightning and Hugging Face integrations log where
their frameworks do). Warnings (:func:`warn`) point at the user's line that led to them."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator, MutableMapping
from contextvars import ContextVar
from typing import Any

__all__ = ["logger", "through", "warn"]

Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]

_OWN = logging.getLogger("crashsafe")
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
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


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first caller outside crashsafe (the user's line, however
    deep inside crashsafe the warning arose), so no caller counts stack levels."""
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
