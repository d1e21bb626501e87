"""A parameter-server shard: a key range of blocks, its optimizer state, and FreeLauncher's books.

Per block the shard keeps its version (bumped by every applied batch), which workers hold a
complete copy (values and optimizer state) at which version (``holder``: copies that came with a
pull; ``replica``: copies pushed by replication), and, per worker, the last clock of that
worker's updates it includes (``applied``). At the end of each clock it makes sure the block's
*recovery point* -- its version at the end of the clock ``lag`` clocks back -- has k copies at
that version or newer (its own counts as one), pushing the current version to the replica stores
of just enough workers when it has not. A pull carries the optimizer state only for blocks short
of copies, so workers that already pull a block make most of those pushes unnecessary. Workers
keep their updates until the recovery point covers them, so a standby shard that takes over a
dead one rebuilds it from the newest copies and replays the retained updates with no rollback.

The class is plain Python (unit-testable); the driver runs it as a Ray actor.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from numpy.typing import NDArray

from crashsafe.ps import optim
from crashsafe.ps.config import PSConfig
from crashsafe.ps.errors import ServerRecoveringError
from crashsafe.ps.layout import BlockLayout, ranges_index
from crashsafe.ps.messages import APPLIED, COUNT, VER, Copy, Push, encode_copy, pack_meta, push_blocks
from crashsafe.ps.workloads import make_workload

__all__ = ["ServerShard"]

Ints = NDArray[np.int64]
F32 = NDArray[np.float32]


class ServerShard:
    """Server ``server_id`` of a job, starting from the initial values; ``None`` makes a standby.

    A standby holds no shard and refuses traffic; :meth:`take_over` makes it the owner of a dead
    server's key range, to be rebuilt (:meth:`recover`) or restored (:meth:`restore_checkpoint`).
    """

    def __init__(self, config: dict[str, Any], server_id: int | None) -> None:
        self.id = server_id
        self._config: dict[str, Any] | None = None
        self._manager: Any = None
        self.recovering = False
        self.configure(config)

    def configure(self, config: dict[str, Any]) -> None:
        """Adopt a job configuration (a no-op if unchanged); the shard starts from its initial values."""
        if config == self._config:
            return
        self.close()
        self._config = config
        self.cfg = PSConfig(**config)
        workload = make_workload(self.cfg.workload, self.cfg.seed, self.cfg.workload_options)
        self.layout = BlockLayout(workload.tables(), self.cfg.servers)
        self.workers = self.cfg.workers
        self.opt, self.lr = self.cfg.optimizer, self.cfg.lr or optim.DEFAULT_LR[self.cfg.optimizer]
        self.state_names = optim.STATE_NAMES[self.opt]
        self.scale = np.float32(1.0 / self.workers)
        self._init = workload.init_params()
        if self.id is not None:
            self.lo, self.hi = self.layout.ranges[self.id]
            self.nb = self.hi - self.lo
            self._fresh()

    def take_over(self, server_id: int, config: dict[str, Any]) -> None:
        """Become server ``server_id`` (a standby replacing a dead one); refuse traffic until rebuilt."""
        self.close()
        self.id, self._config = server_id, None
        self.configure(config)
        self.recovering = True

    def _fresh(self) -> None:
        """Initial values (regenerable from the seed: version 0 needs no copy) and empty books."""
        self.slabs: list[F32] = []
        self.bases = []
        for ti in range(len(self.layout.tables)):
            r0, r1 = self.layout.rows_in(ti, self.lo, self.hi)
            self.bases.append(r0)
            self.slabs.append(self._init[ti][r0:r1].copy())
        self.state = {
            n: [optim.init_state(self.opt, s.shape)[n] for s in self.slabs] for n in self.state_names
        }
        nb, nw = self.nb, self.workers
        self.version = np.zeros(nb, np.int64)
        self.applied = np.full((nb, nw), -1, np.int64)
        self.n_applied = np.zeros(nb, np.int64)
        self.holder = np.full((nb, nw), -1, np.int64)
        self.replica = np.full((nb, nw), -1, np.int64)
        self.ends: list[Ints] = []  # versions at the last `lag` clock ends, oldest first
        self.reported = np.zeros(nb, np.int64)  # update counts as the driver last heard them
        self.buffer: dict[int, dict[int, Push]] = {}

    # -- data path -------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.id is None:
            raise ServerRecoveringError("a standby server holds no shard; promote it with take_over()")
        if self.recovering:
            raise ServerRecoveringError(f"server {self.id} took over a dead shard and is rebuilding; retry")

    def pull(self, worker: int, blocks: Ints) -> Copy:
        """Values of ``blocks`` (global ids, ascending); with FreeLauncher also the state and
        metadata of the blocks this pull makes the worker a complete copy of: ``full`` (default:
        all of ``blocks``).

        Without optimizer state a complete copy costs only its metadata, so every pulled block is
        one. Otherwise only blocks short of k copies of the next end of clock's recovery point
        carry their state (which is 1 to 4 times the size of the values): a copy stays valid for
        ``lag`` clock ends, so a block pulled every clock ships its state once every ``lag`` clocks,
        to k - 1 workers, instead of to every worker every clock.
        """
        self._check()
        local = blocks - self.lo
        reply: Copy = {"blocks": blocks, "v": self.layout.gather(self.slabs, self.bases, blocks)}
        if self.cfg.ft:
            full = blocks
            if self.state_names:
                full = blocks[self._short(local, self._point())]
                if full.size == 0:
                    return reply  # no block needs a complete copy from this pull: values only
                reply["full"] = full
            self.holder[full - self.lo, worker] = self.version[full - self.lo]
            reply.update(self._copy_meta(full))
        return reply

    def _copy_meta(self, blocks: Ints) -> Copy:
        """Optimizer state and metadata of ``blocks`` (what makes a pulled copy a replica)."""
        local = blocks - self.lo
        # Under BSP whole clocks are applied in order, so the newest clock stands for all workers.
        applied = self.applied[local]
        if self.cfg.consistency == "bsp":
            applied = applied.max(axis=1, keepdims=True)
        out: Copy = {"meta": pack_meta(self.version[local], self.n_applied[local], applied)}
        if self.state_names:
            out["s"] = np.stack(
                [self.layout.gather(self.state[n], self.bases, blocks) for n in self.state_names]
            )
        return out

    def push(self, push: Push) -> int:
        """Accept a worker's update: buffered until the clock ends (BSP) or applied now (SSP)."""
        self._check()
        if self.cfg.consistency == "bsp":
            self.buffer.setdefault(push["t"], {}).setdefault(push["w"], push)
        else:
            self._apply([self._unapplied(push)])
        return 0

    def _unapplied(self, push: Push) -> Push:
        """The part of ``push`` whose blocks do not include it yet (drops duplicates on resend)."""
        w, t = push["w"], push["t"]
        rows, grads = [], []
        for ti, (r, g) in enumerate(zip(push["rows"], push["grads"], strict=True)):
            keep = self.applied[self.layout.blocks_of_rows(ti, r) - self.lo, w] < t
            rows.append(r[keep])
            grads.append(g[keep])
        return {"w": w, "t": t, "rows": rows, "grads": grads}

    def _apply(self, pushes: list[Push]) -> None:
        """One optimizer step with the sum of ``pushes`` (summed in list order), versions + 1."""
        for ti, table in enumerate(self.layout.tables):
            parts = [(p["rows"][ti], p["grads"][ti]) for p in pushes if p["rows"][ti].size]
            if not parts:
                continue
            union = np.unique(np.concatenate([r for r, _ in parts]))
            acc = np.zeros((union.size, table.dim), np.float32)
            for r, g in parts:
                acc[np.searchsorted(union, r)] += g
            acc *= self.scale
            optim.step(
                self.opt,
                self.lr,
                self.slabs[ti],
                {n: self.state[n][ti] for n in self.state_names},
                union - self.bases[ti],
                acc,
            )
        touched = []
        for p in pushes:
            local = push_blocks(p, self.layout.blocks_of_rows) - self.lo
            self.applied[local, p["w"]] = p["t"]
            self.n_applied[local] += 1
            touched.append(local)
        if touched:
            self.version[np.unique(np.concatenate(touched))] += 1

    # -- end of clock: apply (BSP), then replicate what lacks copies -----------------------------
    def end_clock(self, clock: int) -> dict[str, Any]:
        """Close ``clock``: apply its updates in worker order (BSP), then top up copies to k.

        A block's recovery point is its version at the end of clock ``clock - lag``: every copy at
        that version or newer is a valid base for a rebuild (later updates are still retained by
        workers). Blocks with fewer than k-1 such copies get their current version pushed to just
        enough workers. Returns each block's count of applied updates (the driver's record of what
        a rebuild must reach) and, per worker, the replica copies to store; once they are stored,
        updates of clocks up to ``clock - lag`` are safe and workers may drop them.
        """
        self._check()
        if self.cfg.consistency == "bsp":
            batch = self.buffer.pop(clock, {})
            self._apply([self._unapplied(batch[w]) for w in sorted(batch)])
        replicas: dict[int, bytes] = {}
        if self.cfg.ft:
            replicas = self._replicate()
        self.ends = [*self.ends, self.version.copy()][-self.cfg.lag :]
        changed = np.flatnonzero(self.n_applied != self.reported) if self.cfg.ft else np.zeros(0, np.int64)
        self.reported[changed] = self.n_applied[changed]
        return {
            "changed": changed.astype(np.int32),
            "counts": self.n_applied[changed].astype(np.int32),
            "replicas": replicas,
        }

    def holds(self, versions: Ints, local: Ints | slice = slice(None)) -> NDArray[np.bool_]:
        """Which workers hold a complete copy of blocks ``local`` at ``versions`` or newer."""
        at = versions[:, None]
        held: NDArray[np.bool_] = (self.holder[local] >= at) | (self.replica[local] >= at)
        return held

    def copies(self, versions: Ints) -> Ints:
        """Worker copies of each block at ``versions`` or newer."""
        counted: Ints = self.holds(versions).sum(axis=1)
        return counted

    def _point(self) -> Ints:
        """Each block's recovery point at the next end of clock: its version ``lag`` clock ends back."""
        return self.ends[0] if len(self.ends) == self.cfg.lag else np.zeros(self.nb, np.int64)

    def _short(self, local: Ints, point: Ints) -> NDArray[np.bool_]:
        """Which of blocks ``local`` lack k - 1 worker copies of ``point`` (version 0 needs none:
        it is regenerated from the seed)."""
        at = point[local]
        short: NDArray[np.bool_] = (at > 0) & (self.holds(at, local).sum(axis=1) < self.cfg.replicas - 1)
        return short

    def _replicate(self) -> dict[int, bytes]:
        """Top up blocks short of copies; per worker, its replica copy (:func:`encode_copy`)."""
        need = self.cfg.replicas - 1
        if need == 0:
            return {}
        point = self._point()
        held = self.holds(point)
        have = held.sum(axis=1)
        short = np.flatnonzero((point > 0) & (have < need))  # as _short(), over every block
        if short.size == 0:
            return {}
        # Per short block, the first workers without a valid copy in an order rotated by block id,
        # which spreads the replica stores' load evenly.
        score = (np.arange(self.workers)[None, :] - short[:, None]) % self.workers
        score[held[short]] = self.workers
        rank = np.argsort(np.argsort(score, axis=1, kind="stable"), axis=1)
        pick = rank < (need - have[short])[:, None]
        rows, cols = np.nonzero(pick)
        self.replica[short[rows], cols] = self.version[short[rows]]
        return {w: encode_copy(copy) for w, copy in self._split_copy(short + self.lo, pick).items()}

    def _split_copy(self, blocks: Ints, pick: NDArray[np.bool_]) -> dict[int, Copy]:
        """Per worker ``w``, the complete copy of the ``blocks`` with ``pick[:, w]`` set; each block
        is gathered once, however many workers it goes to."""
        whole: Copy = {"v": self.layout.gather(self.slabs, self.bases, blocks), **self._copy_meta(blocks)}
        sizes = self.layout.block_elems(blocks)
        out: dict[int, Copy] = {}
        for w in np.flatnonzero(pick.any(axis=0)).tolist():
            mine = pick[:, w]
            elems = np.repeat(mine, sizes)
            out[w] = {"blocks": blocks[mine], "v": whole["v"][elems], "meta": whole["meta"][mine]}
            if "s" in whole:
                out[w]["s"] = whole["s"][:, elems]
        return out

    # -- failures --------------------------------------------------------------------------------
    def forget_worker(self, worker: int) -> None:
        """A worker was relaunched empty: it holds no copy any more."""
        self.holder[:, worker] = -1
        self.replica[:, worker] = -1

    def status(self) -> dict[str, Any]:
        """Which shard this is (None: a standby), whether it needs rebuilding, and its process id."""
        return {"id": self.id, "recovering": self.recovering, "pid": os.getpid()}

    def recover(self, ended: int, expected: NDArray[np.int32], *reports: dict[str, Any]) -> dict[str, Any]:
        """Rebuild from workers' copies and replay their retained updates; no rollback.

        ``ended``: the last clock whose :meth:`end_clock` completed here before the failure;
        ``expected``: the update counts it returned. Blocks that cannot reach them (a copy or a
        retained update is gone: more copies failed than k tolerates) are reported as missing and
        the shard stays in recovery.
        """
        self._fresh()
        best = np.zeros(self.nb, np.int64)
        for rep in reports:
            for kind, book in (("pulled", self.holder), ("replica", self.replica)):
                copy = rep[kind]
                book[copy["blocks"] - self.lo, rep["w"]] = copy["meta"][:, VER]
                best = self._adopt(copy, best)
        pushes = {(p["w"], p["t"]): p for rep in reports for p in rep["retained"]}
        replayed = 0
        if self.cfg.consistency == "bsp":
            for t in sorted({t for _, t in pushes}):
                batch = [pushes[(w, tt)] for (w, tt) in sorted(pushes, key=lambda k: k[0]) if tt == t]
                if t <= ended:
                    parts = [self._unapplied(p) for p in batch]
                    self._apply(parts)
                    replayed += sum(1 for p in parts if any(r.size for r in p["rows"]))
                else:
                    self.buffer[t] = {p["w"]: p for p in batch}
        else:
            for key in sorted(pushes, key=lambda k: (k[1], k[0])):
                part = self._unapplied(pushes[key])
                if any(r.size for r in part["rows"]):
                    self._apply([part])
                    replayed += 1
        counts = expected.astype(np.int64)
        missing = np.flatnonzero(self.n_applied < counts) + self.lo
        if self.cfg.consistency == "bsp" and np.any(self.n_applied > counts):
            raise AssertionError(f"server {self.id}: replay applied more updates than were recorded")
        self.ends = [self.version.copy()] * self.cfg.lag  # the rebuilt state is the new recovery point
        self.reported = counts.copy()
        self.recovering = missing.size > 0
        return {"missing": missing, "replayed": replayed, "copies_used": int(np.count_nonzero(best))}

    def _adopt(self, copy: Copy, best: Ints) -> Ints:
        """Take every block of ``copy`` that is newer than what we have."""
        local, meta = copy["blocks"] - self.lo, copy["meta"]
        newer = meta[:, VER] > self.version[local]
        if not newer.any():
            return best
        sizes = self.layout.block_elems(copy["blocks"])
        elems = ranges_index((np.cumsum(sizes) - sizes)[newer], sizes[newer])
        blocks, take = copy["blocks"][newer], local[newer]
        self.layout.scatter(copy["v"][elems], self.slabs, self.bases, blocks)
        for j, n in enumerate(self.state_names):
            self.layout.scatter(copy["s"][j, elems], self.state[n], self.bases, blocks)
        self.version[take] = meta[newer, VER]
        self.n_applied[take] = meta[newer, COUNT]
        self.applied[take] = meta[newer, APPLIED:]
        best[take] = meta[newer, VER]
        return best

    # -- checkpoint baseline and restart from scratch --------------------------------------------
    def _open_manager(self) -> Any:
        if self._manager is None:
            from crashsafe.manager import CheckpointManager

            if self.id is None:
                raise ServerRecoveringError("a standby server has no shard checkpoints; take_over() first")

            self._manager = CheckpointManager(self.cfg.shard_dir(self.id), keep_last=2)
        return self._manager

    def save_checkpoint(self, clock: int) -> None:
        """Snapshot the shard as step ``clock`` (persisted in the background)."""
        self._check()
        names = self.layout.names
        shard = {
            "values": dict(zip(names, self.slabs, strict=True)),
            "state": {n: dict(zip(names, self.state[n], strict=True)) for n in self.state_names},
            "version": self.version,
            "applied": self.applied,
            "n_applied": self.n_applied,
        }
        self._open_manager().save(clock, {"shard": shard})

    def checkpoint_steps(self) -> list[int]:
        """Committed checkpoint steps of this shard (waits for the one in flight)."""
        manager = self._open_manager()
        manager.wait()
        steps: list[int] = manager.steps()
        return steps

    def restore_checkpoint(self, step: int | None) -> NDArray[np.int32]:
        """Roll back to checkpoint ``step`` (``None``: the initial values); return the update counts."""
        self._fresh()
        if step is not None:
            shard = self._open_manager().load(step, numpy=True)["shard"]
            for ti, name in enumerate(self.layout.names):
                self.slabs[ti][...] = shard["values"][name]
                for n in self.state_names:
                    self.state[n][ti][...] = shard["state"][n][name]
            self.version[...] = shard["version"]
            self.applied[...] = shard["applied"]
            self.n_applied[...] = shard["n_applied"]
            self.ends = [self.version.copy()] * self.cfg.lag  # restored values are not regenerable
        self.reported = self.n_applied.copy()
        if self.cfg.checkpoint_dir is not None:
            manager = self._open_manager()  # this run's future saves reuse the steps after ``step``
            manager.delete([old for old in manager.steps() if step is None or old > step])
        self.recovering = False
        return self.n_applied.astype(np.int32)

    def params(self) -> tuple[list[int], list[F32], int]:
        """Row bases, value slabs and the number of block updates applied (for the final model)."""
        return self.bases, self.slabs, int(self.n_applied.sum())

    def close(self) -> None:
        """Wait for the checkpoint in flight and release the checkpoint directory."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None
