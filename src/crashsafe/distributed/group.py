"""How the processes of a manager talk: one process alone (:class:`Solo`: every exchange is a
no-op), or the ranks of a distributed job on a gloo group of their own, with a timeout
(:class:`Coordinator`). The manager, saving and reading run one code path over either, as DCP's
``_DistWrapper`` does.

Coordination (who writes what, every rank's payloads to the committing rank, the commit's outcome)
runs on a process group of its own, so that background persists never block or reorder the
training's collectives, and on gloo, so that it works beside any training backend. Every exchange
has a deadline: a rank that died or hangs makes the others fail with CoordinationError within the
timeout, never hang.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from crashsafe.errors import CoordinationError

__all__ = ["DEFAULT_TIMEOUT", "SOLO", "Coordination", "Coordinator", "Solo", "distributed_group"]

DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for the others at each exchange
_T = TypeVar("_T")


def distributed_group(process_group: Any) -> Any | None:
    """The process group a manager is collective over: the one given, else the default group when
    torch.distributed is initialized, else None (a single process)."""
    if process_group is not None:
        return process_group
    if "torch.distributed" not in sys.modules:  # nobody initialized it; importing it costs seconds
        return None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


class Solo:
    """The coordination of one process: it is rank 0 of 1 and the leader, hears only itself, and
    writes a step alone (not in parts)."""

    rank = 0
    world = 1
    leader = True
    shared = False  # a step is written whole by this process, as one part

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any, what: str) -> Any:
        return obj

    def broadcast_flag(self, flag: bool, what: str) -> bool:
        return flag

    def agree(self, fn: Callable[[], _T], what: str) -> _T:
        return fn()

    def close(self) -> None:
        pass


class Coordinator:
    """Object exchanges among the ranks of ``group`` on a gloo group of their own."""

    shared = True  # each rank writes its part of a step; rank 0 commits them all

    def __init__(self, group: Any, timeout: float = DEFAULT_TIMEOUT) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.timeout = timeout
        self.rank: int = dist.get_rank(group)
        self.world: int = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)
        self._global_ranks = ranks
        self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))

    @property
    def leader(self) -> bool:
        """Rank 0 of the group: it locks, commits, deletes and lists for everyone."""
        return self.rank == 0

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        out: list[Any] = [None] * self.world
        self._run(lambda: self._dist.all_gather_object(out, obj, group=self.group), what)
        return out

    def broadcast(self, obj: Any, what: str) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        self._run(
            lambda: self._dist.broadcast_object_list(box, src=self._global_ranks[0], group=self.group), what
        )
        return box[0]

    def broadcast_flag(self, flag: bool, what: str) -> bool:
        """Rank 0's ``flag`` on every rank: one byte in one collective (``broadcast`` pickles, in two)."""
        import torch

        box = torch.tensor([flag], dtype=torch.uint8)
        self._run(lambda: self._dist.broadcast(box, src=self._global_ranks[0], group=self.group), what)
        return bool(box.item())

    def agree(self, fn: Callable[[], _T], what: str) -> _T:
        """Run ``fn`` on rank 0 and give every rank its result, or raise its error on every rank."""
        result: Any = None
        if self.leader:
            try:
                result = ("ok", fn())
            except Exception as exc:  # every rank must hear of it, or the others would wait forever
                result = ("error", exc)
        outcome = self.broadcast(result, what)
        if outcome[0] == "error":
            error = outcome[1]
            raise error if isinstance(error, Exception) else CoordinationError(str(error))
        value: _T = outcome[1]
        return value

    def _run(self, op: Callable[[], Any], what: str) -> None:
        try:
            op()
        except RuntimeError as exc:
            raise CoordinationError(
                f"{what}: the ranks did not all answer within {self.timeout:.0f} s ({exc}). A rank died, "
                "hangs, or did not make the same manager call (every rank must call save, restore, "
                "steps, ... together). No step was half committed; restart the job (the next writer "
                "cleans up)"
            ) from None

    def close(self) -> None:
        """Leave the coordination group (a collective: every rank calls it). The ranks first meet,
        so no rank tears its connections down while a peer still uses them (gloo aborts the
        process, at exit, when a peer vanishes under a live pair)."""
        if self.group is not None:
            with contextlib.suppress(CoordinationError):  # a dead peer: leave anyway
                self._run(lambda: self._dist.barrier(group=self.group), "closing")
            self._dist.destroy_process_group(self.group)
            self.group = None


Coordination = Solo | Coordinator
SOLO = Solo()  # (it holds nothing: one serves every single-process manager)
