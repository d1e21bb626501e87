"""Start (or join) Ray: a local instance bound to 127.0.0.1, or an existing cluster by address.

A local instance keeps every listener on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` plus
``_node_ip_address="127.0.0.1"``), keeps token authentication on with a per-process token held in
the environment (``RAY_AUTH_TOKEN``) so nothing is written to ``~/.ray``, and puts its session
files under ``temp_dir``. See DEVELOPERS.md. :func:`ray_messages_to` keeps what Ray itself tells
the driver (notices, reports on killed workers) off the terminal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

__all__ = ["LOOPBACK", "connect", "local_ray", "prepare_local_env", "ray_messages_to"]

LOOPBACK = "127.0.0.1"
# One token per process: Ray caches the token it loaded, so a second local instance started in the
# same process (after ray.shutdown) must be given the same one.
_TOKEN = secrets.token_hex(32)


def prepare_local_env() -> None:
    """Environment for a loopback-only local Ray whose auth token never touches the disk.

    Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when ``ray`` is first imported; if it already
    was, the constant it derived is switched off too (child processes inherit the variable).
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.__dict__["ENABLE_RAY_CLUSTER"] = False
    if not any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = _TOKEN  # Ray turns token mode on for new local clusters


def connect(address: str | None = None, *, num_cpus: int | None = None, temp_dir: str | None = None) -> bool:
    """Make sure Ray is initialized; return True if this call started a local instance.

    ``address`` joins an existing cluster (``"auto"`` or ``"host:port"``); without it a local
    instance is started on 127.0.0.1 with ``num_cpus`` and session files under ``temp_dir``
    (default: a fresh directory in the system temp dir).
    """
    if address is None:
        prepare_local_env()
    import ray

    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, log_to_driver=False)
        return False
    kwargs: dict[str, Any] = {}
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    ray.init(
        _node_ip_address=LOOPBACK,
        include_dashboard=False,
        _temp_dir=temp_dir or tempfile.mkdtemp(prefix="cs-ray-"),
        log_to_driver=False,
        configure_logging=False,
        **kwargs,
    )
    return True


@contextlib.contextmanager
def local_ray(num_cpus: int | None = None, temp_dir: str | None = None) -> Iterator[None]:
    """A local loopback Ray for the duration of the block (shut down afterwards)."""
    import ray

    started = connect(num_cpus=num_cpus, temp_dir=temp_dir)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


class _RayRecordsTo(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes the ``ray`` loggers' records to a stream; hands any other record to ``fallback``."""

    def __init__(self, stream: TextIO, fallback: logging.Handler | None) -> None:
        super().__init__(stream)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.fallback = fallback

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "ray" or record.name.startswith("ray."):
            super().emit(record)
        elif self.fallback is not None and record.levelno >= self.fallback.level:
            self.fallback.handle(record)


@contextlib.contextmanager
def ray_messages_to(log: str | Path) -> Iterator[None]:
    """Append what Ray itself tells this process to the file ``log`` instead of the terminal.

    Two kinds reach a driver. Records of the ``ray`` loggers (the notice that token authentication
    is on): ``ray.init(configure_logging=False)`` leaves them no handler, so they fall to Python's
    handler of last resort, which the block points at the file (other records pass through). And
    the errors Ray pushes to the driver, which a thread of Ray's prints to ``sys.stdout`` (a worker
    process that died, e.g. a server killed on purpose: "SYSTEM_ERROR ... OOM killer"): during the
    block ``sys.stdout`` is the file, so print through a stream taken before it.
    """
    import ray  # noqa: F401  (importing Ray gives the "ray" logger its handler, replaced below)

    logger = logging.getLogger("ray")
    with open(log, "a", encoding="utf-8") as out, contextlib.redirect_stdout(out):
        handler = _RayRecordsTo(out, logging.lastResort)
        saved = logger.handlers, logging.lastResort
        logger.handlers, logging.lastResort = [handler], handler
        try:
            yield
        finally:  # if ray.init cleared the handlers, it meant to: keep them cleared
            logger.handlers = saved[0] if logger.handlers else []
            logging.lastResort = saved[1]
