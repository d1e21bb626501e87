"""Background I/O that must not slow training: threads at a lower CPU priority, and an event loop
of their own for an async fsspec file system (fsspec's shared I/O thread serves every other user
of fsspec in the process, e.g. a data loader, and keeps its priority).

On Linux a thread's nice value is its own and the threads it starts inherit it; elsewhere setting
it would change the whole process, so there this does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading

__all__ = ["IOLoop", "lower_thread_priority"]


def lower_thread_priority(by: int) -> None:
    """Raise the calling thread's nice value by ``by`` (up to 19): it gets the cores only when
    the training threads leave them. The threads it starts from then on inherit that."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # best effort: a sandbox may refuse
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))


class IOLoop:
    """An asyncio event loop running in a thread of its own, started by (so as nice as) the
    calling thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and its thread (what still runs on it is dropped)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
