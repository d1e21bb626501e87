"""A real S3 API on 127.0.0.1 for the storage benchmark: moto's ThreadedMotoServer in a child
process (its request handling must not share the client's GIL, as a real store would not)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

BUCKET = "bench"

_SERVER = """
import logging, os, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
os.nice(int(sys.argv[2]))
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()
server.stop()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def moto_server(nice: int = 0) -> Iterator[dict[str, Any]]:
    """Start the server (at ``nice``: a positive value leaves the cores to this process first, as
    a store on another machine would); yield s3fs storage_options for it; stop it."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(port), str(nice)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", "moto did not start"
        options = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
            "skip_instance_cache": True,
        }
        s3(options).call_s3("create_bucket", Bucket=BUCKET)
        yield options
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3(options: dict[str, Any]) -> Any:
    """An s3fs file system for the server."""
    import s3fs

    return s3fs.S3FileSystem(**options)


def wipe(fs: Any, prefix: str) -> None:
    """Delete everything under ``bench/<prefix>``."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm(f"{BUCKET}/{prefix}", recursive=True)
    fs.invalidate_cache()
