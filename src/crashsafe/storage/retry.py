"""Retries with backoff for what an object store gets wrong for a moment: 5xx answers, throttling,
time-outs, dropped or refused connections. What is transient is decided by the exception's type
and the HTTP status the store answered, never by message text (a ``ValueError`` that names a step
is no network trouble). Anything else fails at once; after the last attempt the error is a
StorageError naming the operation, the store and its endpoint; the caller says what it means for
the data (a read changes nothing; a save tells whether its step was committed).
"""

from __future__ import annotations

import errno
import functools
import http.client
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from crashsafe.errors import CrashsafeError, StorageError

__all__ = ["ATTEMPTS", "is_transient", "status_of", "with_retries"]

# tries of each call in all, with backoff 0.5 s, 1 s, 2 s, 4 s between (each times 0.5 to 1): a
# blip of a few seconds is ridden out, a store that refuses connections fails within 8 s
ATTEMPTS = 5
_FIRST_DELAY = 0.5
_MAX_DELAY = 5.0
_T = TypeVar("_T")
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
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# S3 answers 400 RequestTimeout when a request's body came too slowly: the error code is the status
_TRANSIENT_CODES = frozenset({"RequestTimeout"})
_CAUSES = 8  # links of an exception's __cause__ chain looked at (s3fs wraps botocore's error once)


@functools.cache
def _transient_types() -> tuple[type[BaseException], ...]:
    """Exception types of the network layers under fsspec that mean "try again": dropped, refused
    or timed-out connections, and answers cut short. A layer that is not installed adds none."""
    found: list[type[BaseException]] = [TimeoutError, ConnectionError, http.client.IncompleteRead]
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
        from botocore.parsers import ResponseParserError  # a throttled answer cut short

        found += [BotoConnectionError, HTTPClientError, ResponseParserError]
    except ImportError:
        pass
    try:
        from aiohttp import ClientConnectionError, ClientPayloadError

        found += [ClientConnectionError, ClientPayloadError]
    except ImportError:
        pass
    return tuple(found)


def _status(exc: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and error code a store answered with, where the exception carries them
    (botocore's ``response``, aiohttp's ``status``)."""
    response: Any = getattr(exc, "response", None)
    if isinstance(response, dict):
        meta, error = response.get("ResponseMetadata"), response.get("Error")
        status = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
        code = error.get("Code") if isinstance(error, dict) else None
        return (status if isinstance(status, int) else None), (code if isinstance(code, str) else None)
    status = getattr(exc, "status", None)
    return (status if isinstance(status, int) and not isinstance(status, bool) else None), None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the errors it was raised from (``__cause__``), nearest first."""
    found: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(found) < _CAUSES:
        found.append(seen)
        seen = seen.__cause__
    return found


def status_of(exc: BaseException) -> int | None:
    """The HTTP status a store answered with, found on ``exc`` or the errors it was raised from."""
    return next((status for e in _chain(exc) if (status := _status(e)[0]) is not None), None)


def is_transient(exc: BaseException) -> bool:
    """Whether trying again later may succeed: by the type of ``exc`` (or of the errors it was
    raised from) and the status the store answered, never by the message."""
    if isinstance(exc, (_PERMANENT, CrashsafeError)):
        return False
    for seen in _chain(exc):
        if isinstance(seen, _transient_types()):
            return True
        if isinstance(seen, OSError) and seen.errno in _TRANSIENT_ERRNOS:
            return True
        status, code = _status(seen)
        if status in _TRANSIENT_STATUS or code in _TRANSIENT_CODES:
            return True
    return False


def with_retries(op: Callable[[], _T], what: str, attempts: int = ATTEMPTS) -> _T:
    """``op()``, tried up to ``attempts`` times in all while it fails transiently.

    FileNotFoundError and FileExistsError pass through (callers give them meaning), unless raised
    from a network error: fsspec's HTTP file system says "not found" for a refused connection, and
    crashsafe said the location "does not exist". Any other failure becomes a StorageError naming
    ``what`` (the operation and where: the caller puts the store's location and endpoint in it).
    """
    for attempt in range(attempts):
        try:
            return op()
        except (FileExistsError, CrashsafeError):
            raise
        except FileNotFoundError as exc:
            if exc.__cause__ is None or not is_transient(exc.__cause__):
                raise
            failure: Exception = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        except Exception as exc:
            failure = exc
        transient = is_transient(failure)
        if transient and attempt < attempts - 1:
            time.sleep(min(_MAX_DELAY, _FIRST_DELAY * 2**attempt) * random.uniform(0.5, 1.0))
            continue
        if transient:
            times = "once" if attempts == 1 else f"{attempts} times"
            raise StorageError(
                f"{what} failed {times} ({type(failure).__name__}: {failure}): {_why(failure)}. Try again "
                "later; its time-outs and attempts are set in storage_options (docs/storage.md)"
            ) from failure
        raise StorageError(f"{what} failed: {type(failure).__name__}: {failure}") from failure
    raise AssertionError("unreachable")


def _why(exc: BaseException) -> str:
    """What a transient failure says of the store, for its message (botocore raises its own error
    while handling aiohttp's, which was raised from the refusal: both links are followed)."""
    seen: BaseException | None = exc
    for _ in range(_CAUSES):
        if seen is None or isinstance(seen, ConnectionRefusedError):
            break
        seen = seen.__cause__ or seen.__context__
    if isinstance(seen, ConnectionRefusedError):
        return "the endpoint refused the connection (nothing listens at that host and port, or a firewall)"
    return "the store does not answer, cannot be reached or is overloaded"
