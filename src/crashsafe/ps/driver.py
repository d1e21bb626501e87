"""The job driver: starts server and worker actors, runs BSP or SSP clocks, injects failures,
and recovers (FreeLauncher rebuild, checkpoint rollback, or restart from scratch).

Workers talk to servers directly (pull, push). The driver only sequences clocks, carries the
servers' replica pushes to workers, acknowledges updates, and coordinates recovery, so no actor
ever waits on another actor that may be waiting on it. It keeps a pool of standby server actors:
a dead server's shard is taken over at once by a standby (every recovery method goes through
this), and the pool is refilled in the background once the job is back where it was.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import ray
from numpy.typing import NDArray

from crashsafe._log import warn
from crashsafe.ps.books import RunBooks
from crashsafe.ps.calls import LOST, get_or_lost, wait_dead, wait_relaunched
from crashsafe.ps.cluster import connect
from crashsafe.ps.config import Failure, PSConfig
from crashsafe.ps.errors import DataLossError, DataLossWarning, PSConfigError
from crashsafe.ps.layout import BlockLayout
from crashsafe.ps.result import Recovery, RunResult
from crashsafe.ps.server import ServerShard
from crashsafe.ps.worker import PSWorker
from crashsafe.ps.workloads import make_workload

__all__ = ["PSJob"]

ClockCallback = Callable[[int, RunResult], None]
# A dead server stays dead (a standby takes over its shard); a dead worker is relaunched by Ray.
_ServerActor = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(ServerShard)
_WorkerActor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(PSWorker)


class _Rewind(Exception):
    """Unwinds the clock loop to ``clock`` after a rollback."""

    def __init__(self, clock: int) -> None:
        super().__init__(clock)
        self.clock = clock


class PSJob:
    """A parameter-server training job on Ray.

    >>> with PSJob(PSConfig(workload="digits", clocks=50)) as job:   # doctest: +SKIP
    ...     result = job.run(failures=[Failure(clock=20, servers=(0,))])

    ``address`` joins an existing Ray cluster; without it (and with Ray not yet initialized) a
    local loopback instance is started (session files under ``temp_dir``, by default a fresh
    ``cs-ray-*`` directory in the system temp dir) and shut down by :meth:`close`. ``on_clock(clock, result)``
    is called after every completed clock (for progress bars). ``servers`` holds the actor serving
    each shard, ``spares`` the standby server actors (``PSConfig.spares`` of them).
    """

    def __init__(
        self,
        config: PSConfig,
        *,
        address: str | None = None,
        num_cpus: int | None = None,
        on_clock: ClockCallback | None = None,
        temp_dir: str | None = None,
    ) -> None:
        self.cfg = config
        self.address, self.num_cpus, self.on_clock, self.temp_dir = address, num_cpus, on_clock, temp_dir
        self.servers: list[Any] = []
        self.spares: list[Any] = []
        self.workers: list[Any] = []
        self._own_ray = False
        self._books = RunBooks()  # replaced by every run

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> PSJob:
        """Start Ray if needed, then the server, standby and worker actors; returns once all are ready."""
        self._own_ray = connect(self.address, num_cpus=self.num_cpus, temp_dir=self.temp_dir)
        config = self.cfg.to_dict()
        self.servers = [_ServerActor.remote(config, s) for s in range(self.cfg.servers)]
        self._refill()
        self.workers = [_WorkerActor.remote(config, w) for w in range(self.cfg.workers)]
        ray.get(
            [s.status.remote() for s in self.servers + self.spares]
            + [w.set_servers.remote(self.servers) for w in self.workers]
        )
        return self

    def close(self) -> None:
        """Stop the actors (closing the servers' checkpoint managers first) and Ray if we started it."""
        if self.servers:
            try:
                ray.get([s.close.remote() for s in self.servers], timeout=60)
            except Exception as exc:  # a closing job must not mask the error that closed it
                warn(f"closing parameter servers: {exc}", RuntimeWarning)
        for actor in self.servers + self.spares + self.workers:
            ray.kill(actor, no_restart=True)
        self.servers, self.spares, self.workers = [], [], []
        if self._own_ray:
            ray.shutdown()
            self._own_ray = False

    def __enter__(self) -> PSJob:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the run ---------------------------------------------------------------------------------
    def run(self, failures: Iterable[Failure] = (), config: PSConfig | None = None) -> RunResult:
        """Train from scratch for ``clocks`` clocks, injecting ``failures``; return what was measured.

        ``config`` replaces the job's configuration for this and later runs (same number of
        servers and workers: the actors are reused, which saves starting processes).
        """
        if not self.servers:
            raise RuntimeError("call start() (or use the job as a context manager) before run()")
        cfg = config or self.cfg
        if (cfg.servers, cfg.workers) != (self.cfg.servers, self.cfg.workers):
            raise PSConfigError(
                f"this job has {self.cfg.servers} servers and {self.cfg.workers} workers; "
                "start a new PSJob for a different shape"
            )
        failures = list(failures)
        if cfg.consistency != "bsp" and any(f.phase == "before_apply" for f in failures):
            raise PSConfigError("phase 'before_apply' exists only under BSP (SSP applies pushes on arrival)")
        self.cfg = cfg
        self._refill()
        ray.get([a.configure.remote(cfg.to_dict()) for a in self.servers + self.spares + self.workers])
        ray.get(
            [s.restore_checkpoint.remote(None) for s in self.servers]
            + [w.reset.remote() for w in self.workers]
        )
        self._books = books = RunBooks.start(cfg.clocks, failures, self._ranges())
        begin = time.perf_counter()
        start = 0
        while True:
            try:
                if cfg.consistency == "bsp":
                    self._run_bsp(start)
                else:
                    self._run_ssp(start)
                break
            except _Rewind as rewind:
                start = rewind.clock
                books.inflight.clear()
        books.result.seconds = time.perf_counter() - begin
        self._finish()
        return books.result

    def _ranges(self) -> list[tuple[int, int]]:
        """Each server's range of global block ids."""
        workload = make_workload(self.cfg.workload, self.cfg.seed, self.cfg.workload_options)
        return BlockLayout(workload.tables(), self.cfg.servers).ranges

    def _finish(self) -> None:
        """Collect the model from the servers; total the run's books."""
        if self.cfg.checkpoint_dir is not None:  # saves in flight become durable, the directory free
            ray.get([s.close.remote() for s in self.servers])
        workload = make_workload(self.cfg.workload, self.cfg.seed, self.cfg.workload_options)
        tables = workload.tables()
        params = {t.name: np.zeros((t.rows, t.dim), np.float32) for t in tables}
        applied = 0
        for bases, slabs, n in ray.get([s.params.remote() for s in self.servers]):
            applied += n
            for t, base, slab in zip(tables, bases, slabs, strict=True):
                params[t.name][base : base + len(slab)] = slab
        res = self._books.result
        res.params, res.updates_applied = params, applied
        res.metrics = workload.evaluate([params[t.name] for t in tables])
        self._books.finish()

    # -- BSP: every clock is a barrier; servers apply at the end of it in worker order ------------
    def _run_bsp(self, start: int) -> None:
        for clock in range(start, self.cfg.clocks):
            self._work(clock, list(range(self.cfg.workers)))
            self._inject(clock, "before_apply")
            self._end_clock(clock)
            self._inject(clock, "after_apply")

    def _work(self, clock: int, workers: list[int]) -> None:
        """Run ``clock`` on ``workers`` until each has computed and pushed it."""

        pending = list(workers)
        while pending:
            refs = {w: self._clock_call(w, clock) for w in pending}
            trouble = False
            for w, ref in refs.items():
                lost, ok = self._await_clock(w, clock, ref)
                trouble |= lost
                if ok:
                    pending.remove(w)
            if trouble:
                self._recover()

    def _await_clock(self, w: int, clock: int, ref: Any) -> tuple[bool, bool]:
        """Wait for one worker's clock call: (a server or the worker looked lost, the clock succeeded)."""
        out = get_or_lost(ref)
        if out is LOST:
            self._worker_lost(w)
            return True, False
        return self._books.book_clock(w, clock, out), out["status"] == "ok"

    def _end_clock(self, clock: int) -> None:
        """End ``clock`` on every server that has not yet, queue replicas, acknowledge, checkpoint.

        The acknowledgement may precede delivery: until the replicas ride on each worker's next
        clock, the driver holds them, and a rebuild flushes them to the workers first.
        """
        books = self._books
        while todo := [s for s in range(self.cfg.servers) if books.ended[s] < clock]:
            refs = {s: self.servers[s].end_clock.remote(clock) for s in todo}  # all at once, then wait
            outs = {s: get_or_lost(ref) for s, ref in refs.items()}
            for s, out in outs.items():
                if out is not LOST:
                    books.book_end(s, clock, out)
            if any(out is LOST for out in outs.values()):
                self._recover()
        books.completed = clock
        books.ack = clock - self.cfg.lag
        every = self.cfg.checkpoint_every
        if every is not None and (clock + 1) % every == 0:
            ray.get([s.save_checkpoint.remote(clock) for s in self.servers])
        self._close_recoveries()
        if self.on_clock is not None:
            self.on_clock(clock, books.result)

    def _clock_call(self, w: int, clock: int) -> Any:
        """Start ``clock`` on worker ``w``, handing it the replica copies pending for it."""
        return self.workers[w].run_clock.remote(clock, self._books.ack, self._books.pending.pop(w, []))

    def _flush_replicas(self) -> None:
        """Deliver every pending replica copy now (before a rebuild gathers the workers' copies)."""
        pending = self._books.pending
        for w in list(pending):
            if get_or_lost(self.workers[w].replicate.remote(pending.pop(w))) is LOST:
                self._worker_lost(w)

    # -- SSP: workers run ahead of the slowest by at most `staleness` clocks -----------------------
    def _run_ssp(self, start: int) -> None:
        cfg, books = self.cfg, self._books
        books.done = [start - 1] * cfg.workers
        while min(books.done) < cfg.clocks - 1:
            busy = {w for w, _ in books.inflight.values()}
            for w in range(cfg.workers):
                nxt = books.done[w] + 1
                if w not in busy and nxt < cfg.clocks and nxt <= min(books.done) + 1 + cfg.staleness:
                    books.inflight[self._clock_call(w, nxt)] = (w, nxt)
            ready, _ = ray.wait(list(books.inflight), num_returns=1)
            if self._collect(ready):
                self._recover()
            while min(books.done) > books.completed:
                clock = books.completed + 1
                self._end_clock(clock)
                self._inject(clock, "after_apply")

    def _collect(self, refs: list[Any]) -> bool:
        """Book finished SSP clocks; return True if a server looked unavailable."""
        books = self._books
        trouble = False
        for ref in refs:
            w, clock = books.inflight.pop(ref)
            lost, ok = self._await_clock(w, clock, ref)
            trouble |= lost
            if ok:
                books.done[w] = clock
        return trouble

    # -- failures --------------------------------------------------------------------------------
    def _inject(self, clock: int, phase: str) -> None:
        """Kill the actors of the failures due now; return once they are dead (servers: the job
        finds out on its next call) or relaunched by Ray (workers)."""
        books = self._books
        for f in [f for f in books.failures if f.clock == clock and f.phase == phase]:
            books.failures.remove(f)
            targets = [(self.servers[s], ray.get(self.servers[s].status.remote())["pid"]) for s in f.servers]
            targets += [(self.workers[w], ray.get(self.workers[w].pid.remote())) for w in f.workers]
            books.kill_time = time.perf_counter()
            for actor, pid in targets:
                if f.how == "ray":
                    ray.kill(actor, no_restart=False)
                else:
                    os.kill(pid, signal.SIGKILL)
            for actor, _ in targets[: len(f.servers)]:
                wait_dead(actor)
            for actor, pid in targets[len(f.servers) :]:
                wait_relaunched(actor, pid)
            if f.workers:
                books.relaunch_seconds = time.perf_counter() - books.kill_time
            for w in f.workers:
                self._worker_lost(w)
            if f.workers:
                self._recover()

    def _worker_lost(self, w: int) -> None:
        """A worker died: wait for Ray to relaunch it; servers forget the copies it held."""
        wait_relaunched(self.workers[w], None)
        ray.get(self.workers[w].configure.remote(self.cfg.to_dict()))
        ray.get(self.workers[w].set_servers.remote(self.servers))
        self._books.pending.pop(w, None)  # the servers forget what this worker held or was about to hold
        self._books.relaunched.add(w)
        for s in self.servers:
            get_or_lost(s.forget_worker.remote(w))  # a dead server has nothing to forget

    # -- standby servers -------------------------------------------------------------------------
    def _new_server(self, shard: int | None) -> Any:
        """A new server actor for ``shard`` (None: a standby)."""
        return _ServerActor.remote(self.cfg.to_dict(), shard)

    def _refill(self) -> None:
        """Start standby servers until the pool holds ``spares`` (not waited for); stop any surplus."""
        while len(self.spares) > self.cfg.spares:
            ray.kill(self.spares.pop(), no_restart=True)
        while len(self.spares) < self.cfg.spares:
            self.spares.append(self._new_server(None))

    def _standby(self) -> Any:
        """A live standby from the pool, or (pool empty) a new server actor."""
        while self.spares:
            actor = self.spares.pop(0)
            if get_or_lost(actor.status.remote()) is not LOST:
                return actor
        return self._new_server(None)

    def _take_over(self) -> tuple[list[int], list[int]]:
        """Give every dead server's shard to a standby and tell the workers.

        Returns the dead servers and every server that needs a rebuild (the dead ones, plus any
        that an earlier recovery left incomplete)."""
        dead, bad = [], []
        for s, actor in enumerate(self.servers):
            status = get_or_lost(actor.status.remote())
            if status is LOST:
                dead.append(s)
            elif status["recovering"]:
                bad.append(s)
        for s in dead:
            self.servers[s] = self._standby()
            ray.get(self.servers[s].take_over.remote(s, self.cfg.to_dict()))
        if dead:
            told = {w: worker.set_servers.remote(self.servers) for w, worker in enumerate(self.workers)}
            for w, ref in told.items():
                if get_or_lost(ref) is LOST:
                    self._worker_lost(w)
        return dead, sorted(dead + bad)

    # -- recovery --------------------------------------------------------------------------------
    def _recover(self) -> None:
        """Find dead servers and bring their shards back on standbys: rebuild (FreeLauncher) or roll back."""
        books = self._books
        while books.inflight:  # SSP: let running clocks finish (or fail) before touching servers
            self._collect(list(books.inflight))
        self._flush_replicas()
        begin = books.kill_time if books.kill_time is not None else time.perf_counter()
        dead, bad = self._take_over()
        replace = time.perf_counter() - begin if dead else books.relaunch_seconds
        books.kill_time, books.relaunch_seconds = None, float("nan")
        workers, books.relaunched = sorted(books.relaunched), set()
        if not bad:
            if workers:
                books.open_recovery(
                    Recovery(books.completed + 1, [], workers, "worker", replace_seconds=replace), begin
                )
                self._close_recoveries()
            return
        when = (begin, replace)
        if self.cfg.mode == "none":
            self._rollback(None, bad, workers, when, "restart", "no fault tolerance: restarting")
        if self.cfg.mode == "checkpoint":
            self._rollback(self._checkpoint_step(), bad, workers, when, "checkpoint", "")
        event = Recovery(books.completed + 1, bad, workers, "replica", replace_seconds=replace)
        missing: dict[int, NDArray[np.int64]] = {}
        for s in bad:
            reports = [self._report(w, s) for w in range(self.cfg.workers)]
            out = ray.get(self.servers[s].recover.remote(books.ended[s], books.expected[s], *reports))
            event.replayed_pushes += out["replayed"]
            if out["missing"].size:
                missing[s] = out["missing"]
        if missing:
            self._data_lost(missing, bad, workers, when)
        books.open_recovery(event, begin)
        self._close_recoveries()

    def _data_lost(
        self,
        missing: dict[int, NDArray[np.int64]],
        bad: list[int],
        workers: list[int],
        when: tuple[float, float],
    ) -> None:
        """Blocks lost every copy: roll back to a checkpoint with a warning, or raise if there is none."""
        lost = "; ".join(f"server {s}: {len(b)} blocks (e.g. {b[:5].tolist()})" for s, b in missing.items())
        msg = (
            f"data loss: every copy of some blocks' recovery point failed ({lost}); "
            f"replicas={self.cfg.replicas} tolerates {self.cfg.replicas - 1} simultaneous failures "
            "of copy holders"
        )
        if self.cfg.checkpoint_every is None:
            raise DataLossError(
                msg
                + ". Set checkpoint_dir and checkpoint_every to fall back to a checkpoint, or raise replicas."
            )
        step = self._checkpoint_step()
        msg += f"; rolling back every server and worker to checkpoint step {step}"
        warn(msg, DataLossWarning)
        self._rollback(step, bad, workers, when, "checkpoint", msg)

    def _report(self, w: int, s: int) -> dict[str, Any]:
        """Worker ``w``'s copies and retained updates for server ``s`` (after relaunching it if lost)."""
        while (out := get_or_lost(self.workers[w].report.remote(s))) is LOST:
            self._worker_lost(w)
        report: dict[str, Any] = out
        return report

    def _checkpoint_step(self) -> int | None:
        """The newest step every shard committed, or None."""
        common: set[int] | None = None
        for steps in ray.get([s.checkpoint_steps.remote() for s in self.servers]):
            common = set(steps) if common is None else common & set(steps)
        return max(common) if common else None

    def _rollback(
        self,
        step: int | None,
        bad: list[int],
        workers: list[int],
        when: tuple[float, float],
        kind: str,
        message: str,
    ) -> None:
        """Every server back to checkpoint ``step`` (None: initial values), every worker emptied.

        ``when``: the failure's start time and how long replacing the dead actors took."""
        books = self._books
        counts = ray.get([s.restore_checkpoint.remote(step) for s in self.servers])
        ray.get([w.reset.remote() for w in self.workers])
        resume = 0 if step is None else step + 1
        event = Recovery(
            books.completed + 1,
            bad,
            workers,
            kind,
            recomputed_clocks=books.completed + 1 - resume,
            discarded_updates=books.discarded(resume),
            message=message,
            replace_seconds=when[1],
        )
        books.open_recovery(event, when[0])
        books.rewind(resume, counts, self.cfg.lag)
        raise _Rewind(resume)

    def _close_recoveries(self) -> None:
        """Stamp the recovery time once the job is back where it was when the failure hit; then
        refill the standby pool (starting a process is kept off the recovery's critical path)."""
        if self._books.close_recoveries(time.perf_counter()):
            self._refill()
