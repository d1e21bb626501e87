"""Fixtures for every test directory: a real S3 API on 127.0.0.1 (moto's ThreadedMotoServer), started
only by a test module that asks for it and stopped after that module, and a bucket per test; the
processes that test processes using torch are forked from (forks.py), started at their first use."""

from __future__ import annotations

import logging
import secrets
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from .forks import Zygotes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """The URL of a moto S3 server listening on loopback only, stopped after the module."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no request log on the test output
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_options(endpoint: str) -> dict[str, Any]:
    """storage_options for s3fs against ``endpoint``, passed to fsspec as they are."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket."""
    import s3fs

    name = f"ckpt-{secrets.token_hex(6)}"
    fs = s3fs.S3FileSystem(**s3_options(s3_endpoint))
    fs.call_s3("create_bucket", Bucket=name)
    return name


@pytest.fixture
def options(s3_endpoint: str) -> dict[str, Any]:
    return s3_options(s3_endpoint)


@pytest.fixture(scope="session")
def zygotes() -> Iterator[Zygotes]:
    """Processes that imported torch once, to fork test processes from (forks.py), for the session."""
    started = Zygotes()
    try:
        yield started
    finally:
        started.close()
