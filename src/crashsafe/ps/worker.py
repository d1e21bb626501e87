"""A parameter-server worker: pull the blocks a minibatch touches, compute, push per server.

With FreeLauncher on, the complete copies (values, optimizer state, version) that come with its
pulls double as replicas and are kept apart from the cache the minibatch reads (later pulls
that carry only values must not overwrite them); a replica store holds the copies servers push
to it; and every update is kept until the driver says the servers' recovery points cover it. A
relaunched worker starts empty and rejoins at the clock it was running. The driver tells it
which actor serves each shard (:meth:`PSWorker.set_servers`), and again after a standby takes
over a dead server.

The class is plain Python; the driver runs it as a Ray actor.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from numpy.typing import NDArray

from crashsafe.ps import optim
from crashsafe.ps.calls import LOST, get_or_lost
from crashsafe.ps.config import PSConfig
from crashsafe.ps.layout import BlockLayout, ranges_index
from crashsafe.ps.messages import APPLIED, COUNT, VER, Copy, Push, decode_copy, nbytes, pack_meta
from crashsafe.ps.workloads import make_workload

__all__ = ["BlockStore", "PSWorker", "install_pull"]

Ints = NDArray[np.int64]
F32 = NDArray[np.float32]
_BATCH = 32  # replica copies a worker keeps as received before installing them together


class BlockStore:
    """Full-size local tables plus, per block, the clock a copy arrived and (``meta``) the version,
    metadata and optimizer state of the complete copy held.

    ``values``: tables to share with another store instead of owning zeroed ones (see
    :meth:`PSWorker.reset`); :meth:`install` then leaves the values to that store.
    """

    def __init__(
        self,
        layout: BlockLayout,
        optimizer: str,
        workers: int,
        meta: bool,
        values: list[F32] | None = None,
    ) -> None:
        self.layout = layout
        self.meta = meta
        if values is None:
            values = [np.zeros((t.rows, t.dim), np.float32) for t in layout.tables]
        self.values = values
        self.names = optim.STATE_NAMES[optimizer] if meta else ()
        self.state = {n: [np.zeros_like(v) for v in self.values] for n in self.names}
        self.bases = [0] * len(layout.tables)
        nb = layout.n_blocks
        self.ver = np.full(nb, -1, np.int64)
        self.clock = np.full(nb, np.iinfo(np.int64).min // 2, np.int64)
        self.applied = np.full((nb, workers), -1, np.int64)
        self.n = np.zeros(nb, np.int64)
        self.workers = workers
        self._received: list[Copy] = []

    def receive(self, copy: Copy) -> None:
        """Take a complete copy in, installing it later together with others (:meth:`flush`).

        For replica stores: their copies are read only by :meth:`export`, and a worker gets a few
        small ones every clock, which cost more to install one by one than in one batch."""
        self._received.append(copy)
        if len(self._received) >= _BATCH:
            self.flush()

    def flush(self) -> None:
        """Install the copies :meth:`receive` took in as one: per block, the last one received."""
        copies, self._received = self._received, []
        if len(copies) <= 1:
            for copy in copies:
                self.install(copy, 0)
            return
        blocks = np.concatenate([c["blocks"] for c in copies])
        sizes = self.layout.block_elems(blocks)
        last = blocks.size - 1 - np.unique(blocks[::-1], return_index=True)[1]  # by block id
        elems = ranges_index((np.cumsum(sizes) - sizes)[last], sizes[last])
        merged: Copy = {
            "blocks": blocks[last],
            "v": np.concatenate([c["v"] for c in copies])[elems],
            "meta": np.concatenate([c["meta"] for c in copies])[last],
        }
        if self.names:
            merged["s"] = np.concatenate([c["s"] for c in copies], axis=1)[:, elems]
        self.install(merged, 0)

    def install(self, copy: Copy, clock: int, values: bool = True) -> None:
        """Store a copy received at ``clock``: values only, or (``meta`` stores) a complete copy;
        ``values=False`` skips the values (already installed in the tables this store shares)."""
        blocks = copy["blocks"]
        if values:
            self.layout.scatter(copy["v"], self.values, self.bases, blocks)
        self.clock[blocks] = clock
        if self.meta:
            meta = copy["meta"]
            self.ver[blocks] = meta[:, VER]
            self.n[blocks] = meta[:, COUNT]
            self.applied[blocks] = meta[:, APPLIED:]
            for j, n in enumerate(self.names):
                self.layout.scatter(copy["s"][j], self.state[n], self.bases, blocks)

    def export(self, lo: int, hi: int) -> Copy:
        """The copies held for global blocks ``[lo, hi)``."""
        self.flush()
        blocks = (np.flatnonzero(self.ver[lo:hi] >= 0) + lo).astype(np.int64)
        copy: Copy = {
            "blocks": blocks,
            "v": self.layout.gather(self.values, self.bases, blocks),
            "meta": pack_meta(self.ver[blocks], self.n[blocks], self.applied[blocks]),
        }
        if self.names:
            copy["s"] = np.stack([self.layout.gather(self.state[n], self.bases, blocks) for n in self.names])
        return copy


def install_pull(copy: Copy, clock: int, cache: BlockStore, pulled: BlockStore) -> None:
    """Put a pull's values in ``cache`` and the complete copies it carries (``full``, by default
    every block when it has ``meta``) in ``pulled``; a ``pulled`` store sharing the cache's tables
    takes only the metadata."""
    cache.install(copy, clock)
    if "full" in copy:
        values = cache.layout.gather(cache.values, cache.bases, copy["full"])
        pulled.install({**copy, "blocks": copy["full"], "v": values}, clock)
    elif "meta" in copy:
        pulled.install(copy, clock, values=pulled.values is not cache.values)


class PSWorker:
    """Worker ``worker_id``; the driver hands it the server actors (:meth:`set_servers`)."""

    def __init__(self, config: dict[str, Any], worker_id: int) -> None:
        self.id = worker_id
        self.servers: list[Any] = []
        self._config: dict[str, Any] | None = None
        self.configure(config)

    def configure(self, config: dict[str, Any]) -> None:
        """Adopt a job configuration (a no-op if unchanged): reload data, drop every copy."""
        if config == self._config:
            return
        self._config = config
        self.cfg = PSConfig(**config)
        self.workload = make_workload(self.cfg.workload, self.cfg.seed, self.cfg.workload_options)
        self.workload.load(self.id, self.cfg.workers)
        self.layout = BlockLayout(self.workload.tables(), self.cfg.servers)
        self.reset()

    def reset(self) -> None:
        """Drop every copy and retained update (rollback, or a fresh relaunch)."""
        cfg = self.cfg
        self.cache = BlockStore(self.layout, cfg.optimizer, cfg.workers, False)
        # Without optimizer state every pull is a complete copy of every block it brings, so the
        # copies from pulls are exactly the cache's values: share them instead of writing twice.
        shared = self.cache.values if cfg.ft and not optim.STATE_NAMES[cfg.optimizer] else None
        self.pulled = BlockStore(self.layout, cfg.optimizer, cfg.workers, cfg.ft, shared)
        self.replicas = BlockStore(self.layout, cfg.optimizer, cfg.workers, cfg.ft)
        self.retained: dict[int, dict[int, Push]] = {}

    def set_servers(self, servers: list[Any]) -> None:
        """The actor serving each shard, in shard order (after a take-over, the new ones)."""
        self.servers = servers

    def pid(self) -> int:
        """Process id (for fault injection)."""
        return os.getpid()

    def run_clock(self, clock: int, ack: int, replicas: list[bytes] | None = None) -> dict[str, Any]:
        """Store ``replicas``, then pull, compute and push one minibatch; updates of clocks <= ``ack``
        are safe to drop (their recovery points have k copies, counting ``replicas``).

        Returns ``status`` ``"pull_failed"`` (nothing computed; run the clock again after the
        servers recover) or ``"ok"``, with the servers a push failed on (their recovery replays it).
        """
        self.replicate(replicas or [])
        for t in [t for t in self.retained if t <= ack]:
            del self.retained[t]
        batch = self.workload.batch(self.id, clock, self.cfg.batch_size)
        rows = self.workload.rows(batch)
        need = np.unique(np.concatenate([self.layout.blocks_of_rows(ti, r) for ti, r in enumerate(rows)]))
        stale = need[self.cache.clock[need] < clock - self.cfg.read_staleness]
        owner = self.layout.server_of[stale]
        calls = {
            s: self.servers[s].pull.remote(self.id, stale[owner == s]) for s in np.unique(owner).tolist()
        }
        failed, pulled, extra = [], 0, 0
        for s, ref in calls.items():
            copy = get_or_lost(ref)
            if copy is LOST:
                failed.append(s)
                continue
            install_pull(copy, clock, self.cache, self.pulled)
            size = nbytes(copy)
            pulled += size
            extra += size - int(copy["v"].nbytes) - int(copy["blocks"].nbytes)
        if failed:
            return {"status": "pull_failed", "failed": failed}
        grads, loss = self.workload.grad(batch, self.cache.values)
        pushes = self._split(clock, rows, grads)
        if self.cfg.ft:
            self.retained[clock] = pushes
        refs = {s: self.servers[s].push.remote(p) for s, p in pushes.items()}
        failed += [s for s, ref in refs.items() if get_or_lost(ref) is LOST]
        updates = sum(int(np.unique(self.layout.blocks_of_rows(ti, r)).size) for ti, r in enumerate(rows))
        return {
            "status": "ok",
            "failed": failed,
            "loss": loss,
            "updates": updates,
            "pull_bytes": pulled,
            "ft_pull_bytes": extra,
            "push_bytes": nbytes(pushes),
        }

    def _split(self, clock: int, rows: list[Ints], grads: list[F32]) -> dict[int, Push]:
        """One push per server, holding the gradient rows of its key range."""
        owners = [self.layout.server_of[self.layout.blocks_of_rows(ti, r)] for ti, r in enumerate(rows)]
        pushes = {}
        for s in np.unique(np.concatenate(owners)).tolist():
            pushes[s] = {
                "w": self.id,
                "t": clock,
                "rows": [r[o == s] for r, o in zip(rows, owners, strict=True)],
                "grads": [g[o == s] for g, o in zip(grads, owners, strict=True)],
            }
        return pushes

    def replicate(self, copies: list[bytes]) -> None:
        """Store copies servers pushed to this worker's replica store (:func:`encode_copy` form)."""
        for copy in copies:
            self.replicas.receive(decode_copy(copy))

    def report(self, server: int) -> dict[str, Any]:
        """Everything this worker holds for ``server``'s key range: copies and retained updates."""
        lo, hi = self.layout.ranges[server]
        return {
            "w": self.id,
            "pulled": self.pulled.export(lo, hi),
            "replica": self.replicas.export(lo, hi),
            "retained": [
                self.retained[t][server] for t in sorted(self.retained) if server in self.retained[t]
            ],
        }
