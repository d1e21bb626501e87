"""The file system a URL location is opened with: the store's own backend, one layer.

fsspec can layer file systems: a cache over another (``blockcache::``, ``simplecache::``,
``filecache::``), an archive read through another (``zip://run::file://a.zip``), a view of a
sub-directory (``dir://``), references. crashsafe opens none of them: a layer reaches local files
through fsspec's plain local file system, around crashsafe's safe one (links followed; a FIFO
manifest made ``verify`` wait forever), reaches S3 without its time-outs (which are set for an
``s3://`` URL), and a cache can serve a manifest that was replaced or deleted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from crashsafe.errors import StorageError
from crashsafe.storage.localfs import SafeLocalFileSystem

__all__ = ["open_fs"]


def open_fs(url: str, options: Mapping[str, Any], storage_options: Mapping[str, Any]) -> tuple[Any, str]:
    """The file system of ``url`` opened with ``options`` (``storage_options`` bounded), and the
    location's root in it. ``file://`` gets the safe local file system; a layered URL is refused
    before anything is opened."""
    protocol = url.partition("://")[0]
    if "::" in url or _layered(protocol):
        raise StorageError(
            f"cannot open {url}: crashsafe opens a store through its own backend only, not through a "
            "cache, an archive or a chained URL (blockcache::, simplecache::, filecache::, dir://, zip://, "
            "tar://, reference://): such a layer reaches local files around crashsafe's checks of links "
            "and FIFOs and S3 around its time-outs, and a cache can serve a stale manifest. Check the "
            "URL: give the store itself (file:///data/run, s3://bucket/run); nothing was read or written"
        )
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as exc:
        raise StorageError(f"cannot open {url}: {exc}. Install the fsspec backend it needs") from None
    if type(fs) is LocalFileSystem:  # file://: never through a link, never a FIFO
        fs = SafeLocalFileSystem(**storage_options)
        path = os.path.realpath(path)  # the root itself may be a link: the user chose it
    return fs, str(path).rstrip("/")


def _layered(protocol: str) -> bool:
    """Whether ``protocol``'s file system serves another one's files (a cache, an archive, a view)."""
    from fsspec.archive import AbstractArchiveFileSystem
    from fsspec.implementations.cached import CachingFileSystem
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.reference import ReferenceFileSystem

    try:
        backend = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return False  # unknown or not installed: opening it says so
    layers = (CachingFileSystem, AbstractArchiveFileSystem, DirFileSystem, ReferenceFileSystem)
    return issubclass(backend, layers)
