"""How long any call to an object store may take: each request's connect and read time-outs, and
how many times a call is tried in all (rule 18 of docs/design.md: every remote call is bounded).

For S3 the bounds are botocore's own options in ``storage_options["config_kwargs"]``:
``connect_timeout`` and ``read_timeout`` (seconds, default 5 and 15, as s3fs), and ``retries``
(``{"total_max_attempts": n}``, or ``{"max_attempts": n}`` retries after the first try: n + 1;
default 5 tries). crashsafe retries itself, by exception type and status
(:mod:`crashsafe.storage.retry`), so the retry loops of botocore and s3fs are turned off: tried
inside each of crashsafe's attempts they multiplied the wait (a store that accepts connections and
never answers held ``crashsafe ls`` for over 25 minutes; a refused one failed after 38 s).

A read time-out bounds only the wait for the *next* bytes: an endpoint that trickles one byte a
second never trips it. So each attempt has a deadline too, crashsafe's own options in
``config_kwargs`` (taken out before botocore sees them): ``attempt_timeout`` (seconds; default
3 × (connect_timeout + read_timeout)) plus the attempt's bytes at ``min_throughput`` (bytes per
second; default 128 KiB/s), so a multi-GB payload gets its time while a trickle fails.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fsspec.exceptions import FSTimeoutError

from crashsafe.errors import StorageError
from crashsafe.storage.retry import ATTEMPTS, is_transient, with_retries

__all__ = ["Bounds", "bounded", "bounded_s3_options", "endpoint_of", "make_client", "within"]

CONNECT_TIMEOUT = 5.0  # seconds to open a connection (s3fs's default)
READ_TIMEOUT = 15.0  # seconds to wait for the next bytes of an answer (s3fs's default)
ATTEMPT_FACTOR = 3  # an attempt's deadline before its bytes: this many (connect + read) time-outs
MIN_THROUGHPUT = 128 << 10  # bytes per second an attempt's transfer must average (1 Mbit/s)
_OURS = ("attempt_timeout", "min_throughput")  # crashsafe's options in config_kwargs, not botocore's
_AWS = "the AWS endpoint"


@dataclass(frozen=True)
class Bounds:
    """Tries of each call in all, each request's time-outs, and each attempt's deadline: a base
    plus its bytes at ``min_throughput`` (None: the backend's own, no deadline)."""

    attempts: int = ATTEMPTS
    connect_timeout: float | None = None
    read_timeout: float | None = None
    attempt_timeout: float | None = None
    min_throughput: float = MIN_THROUGHPUT

    def deadline(self, nbytes: int = 0) -> float | None:
        """Seconds one attempt moving about ``nbytes`` (sent or received) may take in all."""
        if self.attempt_timeout is None:
            return None
        return self.attempt_timeout + max(0, nbytes) / self.min_throughput


def _seconds(config: Mapping[str, Any], name: str, default: float, unit: str = "seconds") -> float:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise StorageError(
            f"storage_options config_kwargs.{name} must be a positive number of {unit}, got {value!r}: "
            "every request to the store needs a bound (docs/storage.md)"
        )
    return float(value)


def _attempts(retries: Any) -> int:
    if retries is None:
        return ATTEMPTS
    if not isinstance(retries, Mapping):
        raise StorageError(f"storage_options config_kwargs.retries must be a dict, got {retries!r}")
    total = retries.get("total_max_attempts") is not None
    name, least = ("total_max_attempts", 1) if total else ("max_attempts", 0)
    value = retries.get(name)
    if value is None:
        return ATTEMPTS
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= 100:
        raise StorageError(
            f"storage_options config_kwargs.retries.{name} must be a whole number from {least} to 100, "
            f"got {value!r}"
        )
    return value if total else value + 1  # max_attempts counts the retries after the first try


def bounded_s3_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], Bounds]:
    """``options`` for s3fs with the time-outs made explicit and botocore's own retries off, and
    the bounds crashsafe applies (it tries each call ``attempts`` times in all)."""
    config = options.get("config_kwargs") or {}
    if not isinstance(config, Mapping):
        raise StorageError(f"storage_options config_kwargs must be a dict, got {config!r}")
    connect = _seconds(config, "connect_timeout", CONNECT_TIMEOUT)
    read = _seconds(config, "read_timeout", READ_TIMEOUT)
    bounds = Bounds(
        _attempts(config.get("retries")),
        connect,
        read,
        _seconds(config, "attempt_timeout", ATTEMPT_FACTOR * (connect + read)),
        _seconds(config, "min_throughput", MIN_THROUGHPUT, "bytes per second"),
    )
    retries = {k: v for k, v in (config.get("retries") or {}).items() if k == "mode"}
    config = {
        **{k: v for k, v in config.items() if k not in _OURS},
        "connect_timeout": bounds.connect_timeout,
        "read_timeout": bounds.read_timeout,
        "retries": {**retries, "total_max_attempts": 1},  # one request per attempt of ours
    }
    return {**options, "config_kwargs": config}, bounds


def within(call: Callable[..., Any], deadline: float | None) -> Callable[..., Any]:
    """``call`` (a blocking method of an async fsspec file system) made to give up after ``deadline``
    seconds: fsspec then cancels its coroutine on the loop (the connection goes), and the attempt
    fails with a TimeoutError (transient: retried). None: ``call`` as it is."""
    if deadline is None:
        return call

    @functools.wraps(call)
    def bounded_call(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, timeout=deadline, **kwargs)
        except FSTimeoutError:
            raise TimeoutError(
                f"no complete answer within the attempt's deadline of {round(deadline, 1):g} s "
                "(storage_options config_kwargs attempt_timeout, plus its bytes at min_throughput)"
            ) from None

    return bounded_call


def make_client(fs: Any, bounds: Bounds, where: str) -> None:
    """Make the S3 client of ``fs`` (an s3fs file system), its tries within an attempt's deadline of
    their own: outside a request's (its 0.2-0.5 s of CPU used one up on a loaded machine), yet bounded,
    since its credential lookup (a credential_process, a container or instance metadata endpoint, whose
    time-outs do not bound a trickle) may never end. Options botocore refuses name what to check."""
    what = f"making the S3 client and finding its credentials ({where})"
    try:
        with_retries(within(fs.connect, bounds.deadline()), what, bounds.attempts)
    except StorageError as exc:
        if exc.__cause__ is None or is_transient(exc.__cause__):
            raise  # (its message says to try again later)
        raise StorageError(
            f"{exc}. Check storage_options: key and secret (or profile), client_kwargs endpoint_url and "
            "region_name, config_kwargs (docs/storage.md); nothing was read or written"
        ) from exc.__cause__


def endpoint_of(options: Mapping[str, Any]) -> str:
    """The endpoint an S3 client with ``options`` talks to, for messages."""
    client = options.get("client_kwargs")
    found = client.get("endpoint_url") if isinstance(client, Mapping) else None
    found = found or options.get("endpoint_url")
    return str(found) if found else _AWS


def bounded(url: str, options: Mapping[str, Any]) -> tuple[dict[str, Any], Bounds, str]:
    """The options to open ``url`` with, its bounds, and how messages name it (an S3 location with
    its endpoint). Only S3's are filled in; other backends keep their own time-outs (docs/storage.md)."""
    if url.partition("://")[0].lower() not in ("s3", "s3a"):
        return dict(options), Bounds(), url
    found, bounds = bounded_s3_options(options)
    return found, bounds, f"{url} at {endpoint_of(options)}"
