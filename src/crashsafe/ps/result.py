"""What a parameter-server run measured: the model, throughput, bytes, and every recovery."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

__all__ = ["Recovery", "RunResult"]


@dataclass
class Recovery:
    """One failure and how the job got over it.

    ``kind``: ``"replica"`` (FreeLauncher rebuild, no rollback), ``"worker"`` (only workers were
    relaunched), ``"checkpoint"`` (rollback of every
    server and worker to a checkpoint), ``"restart"`` (from scratch). ``seconds`` runs from the
    failure until the job again reached the progress it had then. ``recomputed_clocks`` are clocks
    the whole job ran a second time; ``discarded_updates`` are applied block updates thrown away;
    ``replayed_pushes`` are retained worker pushes a rebuilt server re-applied;
    ``replace_seconds`` is the part of ``seconds`` until every dead actor had a live replacement (a
    standby server taking over the dead one's shard, or Ray relaunching a dead worker), the same
    mechanism for every recovery method; known for servers, and for workers killed by injection.
    """

    clock: int
    servers: list[int]
    workers: list[int]
    kind: str
    seconds: float = float("nan")
    recomputed_clocks: int = 0
    discarded_updates: int = 0
    replayed_pushes: int = 0
    message: str = ""
    replace_seconds: float = float("nan")


@dataclass
class RunResult:
    """Outcome of :meth:`crashsafe.ps.PSJob.run`. Bytes are payload bytes of numpy arrays."""

    params: dict[str, NDArray[np.float32]]
    clocks: int
    seconds: float
    updates_pushed: int
    updates_applied: int
    pull_bytes: int = 0
    push_bytes: int = 0
    ft_pull_bytes: int = 0
    replica_bytes: int = 0
    version_bytes: int = 0
    worker_reruns: int = 0
    losses: list[float] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def clocks_per_second(self) -> float:
        return self.clocks / self.seconds if self.seconds > 0 else float("inf")

    @property
    def updates_lost(self) -> int:
        """Block updates workers pushed (each counted once) that the final model does not include."""
        return self.updates_pushed - self.updates_applied

    @property
    def recomputed_clocks(self) -> int:
        return sum(r.recomputed_clocks for r in self.recoveries)

    @property
    def replication_bytes_per_clock(self) -> float:
        """Bytes FreeLauncher adds per clock: replica pushes, state and versions in pulls, version tables."""
        return (self.replica_bytes + self.ft_pull_bytes + self.version_bytes) / max(self.clocks, 1)
