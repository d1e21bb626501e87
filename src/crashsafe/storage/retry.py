"""Retries with backoff for what an object store gets wrong for a moment: 5xx answers, throttling,
timeouts, dropped or refused connections. Anything else fails at once; after the limit the error
is a StorageError that says nothing was committed.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from typing import TypeVar

from crashsafe.errors import CrashsafeError, StorageError

__all__ = ["ATTEMPTS", "is_transient", "with_retries"]

ATTEMPTS = 4  # with backoff 0.2 s, 0.4 s, 0.8 s between; the backend retries inside each (s3fs, botocore)
_FIRST_DELAY = 0.2
_MAX_DELAY = 5.0
_T = TypeVar("_T")
_MARKERS = (
    "500", "502", "503", "504", "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout",
    "Throttl", "timed out", "Timeout", "Connection reset", "Connection refused", "Connection aborted",
    "Server disconnected", "ConnectionClosed", "EndpointConnectionError", "IncompleteRead",
    "ServerDisconnected", "ClientConnector", "ClientOSError", "Broken pipe",
)  # fmt: skip
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EAGAIN,
        errno.EBUSY,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ENETUNREACH,
        errno.EHOSTUNREACH,
        errno.ENETDOWN,
    }
)  # fmt: skip  (s3fs maps 503 ServiceUnavailable and SlowDown to EBUSY)


def is_transient(exc: BaseException) -> bool:
    """Whether trying again later may succeed."""
    if isinstance(exc, (_PERMANENT, CrashsafeError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in _MARKERS)


def with_retries(op: Callable[[], _T], what: str, attempts: int = ATTEMPTS) -> _T:
    """``op()``, tried up to ``attempts`` times while it fails transiently.

    FileNotFoundError and FileExistsError pass through (callers give them meaning); any other
    failure becomes a StorageError naming ``what`` and the next step.
    """
    for attempt in range(attempts):
        try:
            return op()
        except (FileNotFoundError, FileExistsError, CrashsafeError):
            raise
        except Exception as exc:
            if is_transient(exc) and attempt < attempts - 1:
                time.sleep(min(_MAX_DELAY, _FIRST_DELAY * 2**attempt) * random.uniform(0.5, 1.0))
                continue
            if is_transient(exc):
                raise StorageError(
                    f"{what} failed {attempts} times ({type(exc).__name__}: {exc}); the store is unreachable "
                    "or overloaded. Nothing was committed; try again later"
                ) from exc
            raise StorageError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
    raise AssertionError("unreachable")
