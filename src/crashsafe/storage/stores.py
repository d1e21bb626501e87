"""Where a checkpoint location leads: a local directory, or an object store through fsspec."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from crashsafe.storage.base import Store
from crashsafe.storage.local import LocalStore

__all__ = ["is_url", "open_store"]


def is_url(location: str | os.PathLike[str]) -> bool:
    """True for ``s3://bucket/run`` and any other ``protocol://`` location fsspec serves."""
    return "://" in os.fspath(location)


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
    bucket, is then not taken for an empty run."""
    if is_url(location):
        from crashsafe.storage.objectstore import FsspecStore

        store = FsspecStore(os.fspath(location), storage_options or {}, create=create)
        if existing:
            store.require_root()
        return store
    if storage_options:
        where = os.fspath(location)
        raise ValueError(f"storage_options are for URLs (s3://...), but {where!r} is a local path")
    return LocalStore(location, create=create)
