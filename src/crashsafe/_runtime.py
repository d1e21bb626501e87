"""The thread pools crashsafe keeps for the whole process, in one place, and safe across ``fork``.

A child made by ``os.fork`` (multiprocessing's "fork" start method, DataLoader workers on Linux)
holds only the thread that forked: a pool made before the fork keeps its queue but has no worker
threads, so work handed to it there never runs and a save waits forever. Each pool here is made at
first use and dropped in a forked child (``os.register_at_fork``), which makes its own at its first
use; so is the lock that guards them (a thread of the parent may have held it at the fork).
"spawn" and "forkserver" children start a fresh interpreter and import crashsafe anew.

Pools and locks that belong to one object (a manager's background save, a store's uploads) live and
die with that object; a manager refuses to be used in a forked child (``manager.py``).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from crashsafe.errors import CrashsafeError

__all__ = ["forked", "pool", "refuse_forked"]

_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def pool(name: str, workers: int) -> ThreadPoolExecutor:
    """This process's pool ``name`` (e.g. "hash", "fsync") of ``workers`` threads named
    ``crashsafe-<name>``, made at its first use in this process."""
    with _lock:
        found = _pools.get(name)
        if found is None:
            found = _pools[name] = ThreadPoolExecutor(workers, thread_name_prefix=f"crashsafe-{name}")
        return found


def _forget_in_child() -> None:
    """In a forked child: the parent's pools have no threads here; drop them, never shut them down
    (that would wait for threads that do not exist), and take a lock no parent thread holds."""
    global _lock
    _lock = threading.Lock()
    _pools.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def forked(pid: int) -> bool:
    """Whether this process is a forked child of ``pid``, the process that made some object."""
    return os.getpid() != pid


def refuse_forked(pid: int, what: str) -> None:
    """Raise CrashsafeError in a forked child of ``pid``: ``what`` (a writer) belongs to that process."""
    if forked(pid):
        raise CrashsafeError(
            f"{what} was opened by process {pid}, and this process ({os.getpid()}) is a fork of it: it "
            "shares that writer's lock but none of its threads. Create one of its own in the child (for "
            "another directory), or start children with the 'spawn' or 'forkserver' method"
        )
