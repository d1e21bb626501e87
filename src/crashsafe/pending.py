"""Work in flight on one background thread: a manager's save (at most one, its error raised at the
next call and its measured cost kept), and the Lightning plugin's saves and removals.

:class:`Background` runs work in order on one thread, made when the first work arrives (a manager
that never saves starts none), and tells whether work waits behind the one running (the plugin
deletes only when nothing does). :class:`PendingSave` is a manager's save on it, or in the caller
for saves that write before they return.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from crashsafe.errors import CrashsafeError, SaveFailedError
from crashsafe.saving import SaveStats

__all__ = ["Background", "PendingSave"]

_T = TypeVar("_T")


class Background:
    """Work run in order on one thread named ``name``; finished work's errors are collected."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[Future[Any]] = []
        self._submitted = self._started = 0

    def submit(self, work: Callable[[], _T]) -> Future[_T]:
        """Run ``work`` after the work before it."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self._name)

        def run() -> _T:
            self._started += 1
            return work()

        self._submitted += 1
        future = self._executor.submit(run)
        self._futures.append(future)
        return future

    @property
    def running(self) -> bool:
        """Whether the thread is there (it is made at the first work, and gone after :meth:`close`)."""
        return self._executor is not None

    @property
    def waiting(self) -> bool:
        """Whether work waits behind the work running now."""
        return self._submitted > self._started

    def finished(self, *, wait: bool) -> list[BaseException]:
        """Forget the finished work (with ``wait``: all of it, once it finished); its errors, in order."""
        done = list(self._futures) if wait else [f for f in self._futures if f.done()]
        self._futures = [f for f in self._futures if f not in done]
        return [exc for f in done if (exc := f.exception()) is not None]

    def close(self) -> None:
        """Stop the thread, after the work it was given."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class PendingSave:
    """One save at a time, on a :class:`Background` thread when ``background``; :attr:`stats` holds
    the cost of each one that committed, oldest first."""

    def __init__(self, background: bool) -> None:
        self.background = background
        self.stats: list[SaveStats] = []
        self._thread = Background("crashsafe-persist")
        self._future: Future[SaveStats] | None = None
        self._step: int | None = None

    def start(self, step: int, persist: Callable[[], SaveStats], began: float) -> float:
        """Persist ``step``: in the background (returns 0), or here and now (returns the seconds the
        caller waited on top of its stall, which that save's stats count as its stall)."""
        if not self.background:
            stats = persist()
            blocked = time.perf_counter() - began
            self.stats.append(dataclasses.replace(stats, stall=blocked))
            return blocked - stats.stall
        self._future, self._step = self._thread.submit(persist), step
        return 0.0

    @property
    def done(self) -> bool:
        """True when no save is running (one that ended may still have to be waited for)."""
        return self._future is None or self._future.done()

    def wait(self) -> None:
        """Until the save in flight is committed; raise its error (a SaveFailedError for one that
        is not crashsafe's own)."""
        future, step = self._future, self._step
        if future is None:
            return
        self._future = self._step = None
        self._thread.finished(wait=True)
        try:
            self.stats.append(future.result())
        except CrashsafeError:
            raise
        except Exception as exc:
            raise SaveFailedError(
                f"saving step {step} in the background failed: {exc!r}. Committed checkpoints are intact."
            ) from exc

    def close(self) -> None:
        """Stop the background thread (after the save in flight ended)."""
        self._thread.close()
