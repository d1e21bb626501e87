"""Joining and leaving a benchmark launch's job (gloo on 127.0.0.1), and gathering figures: what
every rank of bench/distributed and bench/memory_tier does, with as few imports as it needs."""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import Any

import torch.distributed as dist


def gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (on every rank)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def join() -> Any:
    """Join the job and return its store: rank 0 serves the rendezvous store on the socket the
    launcher bound to 127.0.0.1 (so nothing listens on other interfaces); gloo's sockets are on
    ``lo``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port, timeout = int(os.environ["MASTER_PORT"]), datetime.timedelta(seconds=300)
    if rank == 0:
        fd = int(os.environ["BENCH_STORE_FD"])
        store = dist.TCPStore("127.0.0.1", port, world, True, timeout, master_listen_fd=fd)  # type: ignore[attr-defined]
    else:
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return store


def leave(store: Any) -> None:
    """Leave the job together and exit at once: every rank destroys its groups, then waits on the
    store until all have, so rank 0 (the store's server) goes last; the interpreter's teardown is
    skipped, where gloo once aborted a rank whose peers had left ('terminate called without an
    active exception', SIGABRT, after every crashsafe manager was closed)."""
    dist.barrier()
    dist.destroy_process_group()
    world = int(os.environ["WORLD_SIZE"])
    store.add("left", 1)
    deadline = time.monotonic() + 60
    while store.add("left", 0) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    if int(os.environ["RANK"]) == 0:
        time.sleep(0.5)  # the others' last reads of the store return before its server goes
    sys.stdout.flush()
    os._exit(0)
