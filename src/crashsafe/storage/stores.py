"""Where a checkpoint location leads: a local directory, or an object store through fsspec."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from crashsafe.errors import CrashsafeError, InvalidArgumentError, StorageError
from crashsafe.storage.base import Store
from crashsafe.storage.local import LocalStore

__all__ = ["anchored", "check_location", "is_url", "open_store"]

_LOCAL_PROTOCOLS = ("file", "local")


def is_url(location: str | os.PathLike[str]) -> bool:
    """True for ``s3://bucket/run`` and any other ``protocol://`` location fsspec serves."""
    return "://" in os.fspath(location)


def anchored(location: str) -> str:
    """A relative local location made absolute against the current directory now; any other (an
    absolute path, a URL, an empty one for :func:`check_location` to refuse) as it is. A reader opens
    its location afresh at each read, so a later ``os.chdir`` must not lead it elsewhere."""
    if not location or is_url(location) or os.path.isabs(location):
        return location
    return os.path.abspath(location)


def check_location(location: str | os.PathLike[str]) -> None:
    """InvalidArgumentError for a location that names no directory of its own: an empty one (``""``,
    ``file://``: the current directory), the file system's root (``/``, ``file:///``) or a URL
    without a bucket or path (``s3://``, ``memory://``). A writer removes leftovers where it opens,
    and ``gc`` deletes steps: such a location could be anyone's files."""
    text = os.fspath(location)
    protocol, _, rest = text.partition("://") if is_url(text) else ("", "", text)
    path = rest.split("::", 1)[0]  # a chained URL (zip://x::file://...) names its own path first
    local = not protocol or protocol in _LOCAL_PROTOCOLS
    if not path.strip("/") and (not local or not path):
        what = "an empty location" if not path else "a store's root, not a location within it"
        raise InvalidArgumentError(
            f"{text!r} is {what}: it names no checkpoint directory of its own. Give the run's own "
            "directory, e.g. ckpt, /data/run1 or s3://bucket/run1"
        )
    if local and os.path.realpath(path) == os.path.realpath("/"):
        raise InvalidArgumentError(
            f"{text!r} is the root of the file system, not a checkpoint directory: crashsafe would lock, "
            "clean and delete there. Give the run's own directory, e.g. /data/run1"
        )


def open_store(
    location: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    create: bool = False,
    existing: bool = False,
) -> Store:
    """The store at ``location``: a plain path is a local directory (rename commits); a URL
    (``s3://``, ``gs://``, ``az://``, ``file://``, ``memory://``) is an fsspec store (manifest-last
    commits), with ``storage_options`` passed to fsspec as they are. A local directory must exist
    unless ``create``; with ``existing`` a URL's must too (NoCheckpointError): a typo, a missing
    bucket, is then not taken for an empty run. An empty or root-like location is refused
    (:func:`check_location`)."""
    check_location(location)
    if is_url(location):
        return _open_url(os.fspath(location), storage_options or {}, create, existing)
    if storage_options:
        where = os.fspath(location)
        raise InvalidArgumentError(
            f"storage_options are for URLs (s3://...), but {where!r} is a local path; leave them out"
        )
    return LocalStore(location, create=create)


def _open_url(url: str, options: Mapping[str, Any], create: bool, existing: bool) -> Store:
    """An fsspec store. Whatever a backend raises while it connects or opens (an FTP server that
    refuses, a zip:// without its archive) becomes a StorageError naming the location."""
    from crashsafe.storage.objectstore import FsspecStore

    try:
        store = FsspecStore(url, options, create=create)
        if existing:
            store.require_root()
    except CrashsafeError:
        raise
    except Exception as exc:  # a third-party backend's own error, of any type
        raise StorageError(
            f"cannot open {url}: {type(exc).__name__}: {exc}. Check the URL (protocol, host, port, path) "
            "and --storage-options; nothing was read or written"
        ) from exc
    return store
