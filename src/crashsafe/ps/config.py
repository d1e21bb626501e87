"""Settings of one parameter-server job and of the failures injected into it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from crashsafe.ps.errors import PSConfigError

__all__ = ["Failure", "PSConfig"]

Mode = Literal["flr", "checkpoint", "none"]
Consistency = Literal["bsp", "ssp"]
Optimizer = Literal["sgd", "adagrad", "adam"]
WORKLOADS = ("sparse_lr", "mf", "digits")


@dataclass(frozen=True)
class PSConfig:
    """One training job: workload, cluster shape, consistency, optimizer and fault tolerance.

    ``mode``: ``"flr"`` (FreeLauncher replication; falls back to ``checkpoint_every`` checkpoints
    when more copies fail than ``replicas`` tolerates), ``"checkpoint"`` (periodic shard
    checkpoints, rollback of every worker), ``"none"`` (restart from scratch).
    ``replicas`` is k: every block keeps k copies of its recovery point, the server's included.
    ``recovery_lag`` L: a block's recovery point is its version at the end of the clock L clocks
    back, and workers keep L + 1 clocks of unacknowledged updates. A larger L needs fewer replica
    pushes (a block touched again, or pulled, within L clocks needs none) and more worker memory.
    Default 4 under BSP; ``2 * staleness + 2`` under SSP, the most a worker's cached copy can trail
    the slowest worker's clock.
    ``spares``: standby server actors kept running so that a dead server's shard is taken over at
    once, without waiting for a new process (every recovery method uses them); when more servers
    die at once than there are standbys, the rest wait for new actors. The pool is refilled once
    the job is back where it was.
    """

    workload: str = "sparse_lr"
    servers: int = 2
    workers: int = 4
    replicas: int = 2
    mode: Mode = "flr"
    consistency: Consistency = "bsp"
    staleness: int = 2
    optimizer: Optimizer = "adagrad"
    lr: float | None = None
    clocks: int = 100
    batch_size: int = 64
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    recovery_lag: int | None = None
    spares: int = 1
    workload_options: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise PSConfigError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOADS)}")
        for name in ("servers", "workers", "replicas", "clocks", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PSConfigError(f"{name} must be an int >= 1, got {value!r}")
        if self.mode not in ("flr", "checkpoint", "none"):
            raise PSConfigError(f"mode must be 'flr', 'checkpoint' or 'none', got {self.mode!r}")
        if self.consistency not in ("bsp", "ssp"):
            raise PSConfigError(f"consistency must be 'bsp' or 'ssp', got {self.consistency!r}")
        if self.optimizer not in ("sgd", "adagrad", "adam"):
            raise PSConfigError(f"optimizer must be 'sgd', 'adagrad' or 'adam', got {self.optimizer!r}")
        if self.consistency == "ssp" and self.staleness < 1:
            raise PSConfigError(f"SSP needs a staleness bound >= 1, got {self.staleness}; use BSP for 0")
        if self.mode == "flr" and self.replicas - 1 > self.workers:
            raise PSConfigError(
                f"replicas={self.replicas} needs {self.replicas - 1} worker copies besides the server's, "
                f"but there are only {self.workers} workers; lower --replicas or add workers"
            )
        if self.mode == "checkpoint" and (self.checkpoint_dir is None or self.checkpoint_every is None):
            raise PSConfigError("mode 'checkpoint' needs checkpoint_dir and checkpoint_every")
        if self.checkpoint_every is not None:
            if self.checkpoint_every < 1:
                raise PSConfigError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
            if self.checkpoint_dir is None:
                raise PSConfigError("checkpoint_every needs checkpoint_dir (where server shards are saved)")
        if isinstance(self.spares, bool) or not isinstance(self.spares, int) or self.spares < 0:
            raise PSConfigError(f"spares must be an int >= 0 (standby servers), got {self.spares!r}")
        if self.recovery_lag is not None and self.recovery_lag < 1:
            raise PSConfigError(f"recovery_lag must be >= 1, got {self.recovery_lag}")
        if self.lr is not None and not self.lr > 0:
            raise PSConfigError(f"lr must be > 0, got {self.lr}")

    @property
    def ft(self) -> bool:
        """True when workers keep copies, versions and unacknowledged updates (FreeLauncher)."""
        return self.mode == "flr"

    @property
    def read_staleness(self) -> int:
        """How many clocks old a cached block may be when read: 0 under BSP."""
        return self.staleness if self.consistency == "ssp" else 0

    @property
    def lag(self) -> int:
        """Clocks between a block's recovery point and the newest clock end (see ``recovery_lag``)."""
        if self.recovery_lag is not None:
            return self.recovery_lag
        return 2 * self.staleness + 2 if self.consistency == "ssp" else 4

    def shard_dir(self, server: int) -> Path:
        """Checkpoint directory of one server's shard."""
        if self.checkpoint_dir is None:
            raise PSConfigError("no checkpoint_dir configured")
        return Path(self.checkpoint_dir) / f"server{server}"

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form passed to actors (they rebuild the config from it)."""
        return asdict(self)


@dataclass(frozen=True)
class Failure:
    """Kill ``servers`` and/or ``workers`` at once after clock ``clock``.

    ``phase``: ``"after_apply"`` kills once the clock's updates are applied and acknowledged;
    ``"before_apply"`` (BSP only) kills after every worker pushed but before the server applied.
    ``how``: ``"ray"`` uses ``ray.kill(no_restart=False)``, ``"sigkill"`` SIGKILLs the process.
    """

    clock: int
    servers: tuple[int, ...] = ()
    workers: tuple[int, ...] = ()
    phase: Literal["after_apply", "before_apply"] = "after_apply"
    how: Literal["ray", "sigkill"] = "ray"

    def __post_init__(self) -> None:
        if not self.servers and not self.workers:
            raise PSConfigError("a Failure must name at least one server or worker to kill")
        if self.phase not in ("after_apply", "before_apply"):
            raise PSConfigError(f"phase must be 'after_apply' or 'before_apply', got {self.phase!r}")
        if self.how not in ("ray", "sigkill"):
            raise PSConfigError(f"how must be 'ray' or 'sigkill', got {self.how!r}")
