"""Start (or join) Ray: a local instance bound to 127.0.0.1, or an existing cluster by address.

A local instance keeps every listener on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` plus
``_node_ip_address="127.0.0.1"``), keeps token authentication on with a per-process token held in
the environment (``RAY_AUTH_TOKEN``) so nothing is written to ``~/.ray``, and puts its session
files under ``temp_dir``. See DEVELOPERS.md.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

__all__ = ["LOOPBACK", "connect", "local_ray", "prepare_local_env"]

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
