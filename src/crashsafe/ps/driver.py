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
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from crashsafe.ps.cluster import connect
from crashsafe.ps.config import Failure, PSConfig
from crashsafe.ps.errors import DataLossError, DataLossWarning, PSConfigError
from crashsafe.ps.layout import BlockLayout
from crashsafe.ps.messages import nbytes
from crashsafe.ps.result import Recovery, RunResult
from crashsafe.ps.server import ServerShard
from crashsafe.ps.worker import PSWorker, server_unavailable
from crashsafe.ps.workloads import make_workload

__all__ = ["PSJob"]

ClockCallback = Callable[[int, RunResult], None]
# A dead server stays dead (a standby takes over its shard); a dead worker is relaunched by Ray.
_SERVER = {"num_cpus": 0, "max_restarts": 0, "max_task_retries": 0}
_WORKER = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 0}
_RESTART_TIMEOUT = 120.0


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
    local loopback instance is started and shut down by :meth:`close`. ``on_clock(clock, result)``
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
    ) -> None:
        self.cfg = config
        self.address, self.num_cpus, self.on_clock = address, num_cpus, on_clock
        self.servers: list[Any] = []
        self.spares: list[Any] = []
        self.workers: list[Any] = []
        self._own_ray = False

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> PSJob:
        """Start Ray if needed, then the server, standby and worker actors; returns once all are ready."""
        import ray

        self._own_ray = connect(self.address, num_cpus=self.num_cpus)
        config = self.cfg.to_dict()
        self._server_cls, worker_cls = ray.remote(ServerShard), ray.remote(PSWorker)
        self.servers = [
            self._server_cls.options(**_SERVER).remote(config, s) for s in range(self.cfg.servers)
        ]
        self._refill()
        self.workers = [worker_cls.options(**_WORKER).remote(config, w) for w in range(self.cfg.workers)]
        ray.get(
            [s.status.remote() for s in self.servers + self.spares]
            + [w.set_servers.remote(self.servers) for w in self.workers]
        )
        return self

    def close(self) -> None:
        """Stop the actors (closing the servers' checkpoint managers first) and Ray if we started it."""
        import ray

        if self.servers:
            try:
                ray.get([s.close.remote() for s in self.servers], timeout=60)
            except Exception as exc:  # a closing job must not mask the error that closed it
                warnings.warn(f"closing parameter servers: {exc}", RuntimeWarning, stacklevel=2)
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
        import ray

        if not self.servers:
            raise RuntimeError("call start() (or use the job as a context manager) before run()")
        cfg = config or self.cfg
        if (cfg.servers, cfg.workers) != (self.cfg.servers, self.cfg.workers):
            raise PSConfigError(
                f"this job has {self.cfg.servers} servers and {self.cfg.workers} workers; "
                "start a new PSJob for a different shape"
            )
        self._failures = sorted(failures, key=lambda f: f.clock)
        for f in self._failures:
            if f.phase == "before_apply" and cfg.consistency != "bsp":
                raise PSConfigError(
                    "phase 'before_apply' exists only under BSP (SSP applies pushes on arrival)"
                )
        self.cfg = cfg
        self._refill()
        ray.get([a.configure.remote(cfg.to_dict()) for a in self.servers + self.spares + self.workers])
        ray.get(
            [s.restore_checkpoint.remote(None) for s in self.servers]
            + [w.reset.remote() for w in self.workers]
        )
        self._result = RunResult(
            params={}, clocks=cfg.clocks, seconds=0.0, updates_pushed=0, updates_applied=0
        )
        self._pushed: dict[tuple[int, int], int] = {}
        self._computed: set[tuple[int, int]] = set()
        self._ended = [-1] * cfg.servers
        self._expected = [np.zeros(hi - lo, np.int32) for lo, hi in self._ranges()]
        self._completed = -1
        self._ack = -1
        self._pending: dict[int, list[Any]] = {}  # replica copies riding on each worker's next clock
        self._open: list[tuple[Recovery, float, int]] = []
        self._kill_time: float | None = None
        self._relaunch_seconds = float("nan")  # of the workers killed by the last injected failure
        self._relaunched: set[int] = set()
        self._clock_losses: dict[int, list[float]] = {}
        self._inflight: dict[Any, tuple[int, int]] = {}
        self._done: list[int] = []
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
                self._inflight.clear()
        self._result.seconds = time.perf_counter() - begin
        self._finish()
        return self._result

    def _ranges(self) -> list[tuple[int, int]]:
        """Each server's range of global block ids."""
        workload = make_workload(self.cfg.workload, self.cfg.seed, self.cfg.workload_options)
        return BlockLayout(workload.tables(), self.cfg.servers).ranges

    def _finish(self) -> None:
        import ray

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
        res = self._result
        res.params, res.updates_applied = params, applied
        res.updates_pushed = sum(self._pushed.values())
        res.losses = [float(np.mean(self._clock_losses[t])) for t in sorted(self._clock_losses)]
        res.metrics = workload.evaluate([params[t.name] for t in tables])

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
        import ray

        try:
            out = ray.get(ref)
        except Exception as exc:
            if not server_unavailable(exc):
                raise
            self._worker_lost(w)
            return True, False
        return self._record(w, clock, out), out["status"] == "ok"

    def _record(self, w: int, clock: int, out: dict[str, Any]) -> bool:
        """Book a worker's clock result; return True if a server looked unavailable."""
        if out["status"] != "ok":
            return True
        res = self._result
        if (w, clock) in self._computed:
            res.worker_reruns += 1
        self._computed.add((w, clock))
        self._pushed.setdefault((w, clock), out["updates"])
        self._clock_losses.setdefault(clock, []).append(out["loss"])
        res.pull_bytes += out["pull_bytes"]
        res.push_bytes += out["push_bytes"]
        res.ft_pull_bytes += out["ft_pull_bytes"]
        return bool(out["failed"])

    def _end_clock(self, clock: int) -> None:
        """End ``clock`` on every server that has not yet, queue replicas, acknowledge, checkpoint.

        The acknowledgement may precede delivery: until the replicas ride on each worker's next
        clock, the driver holds them, and a rebuild flushes them to the workers first.
        """
        import ray

        while True:
            todo = [s for s in range(self.cfg.servers) if self._ended[s] < clock]
            if not todo:
                break
            refs = {s: self.servers[s].end_clock.remote(clock) for s in todo}
            trouble = False
            for s, ref in refs.items():
                try:
                    out = ray.get(ref)
                except Exception as exc:
                    if not server_unavailable(exc):
                        raise
                    trouble = True
                    continue
                for w, copy in out["replicas"].items():  # they ride on w's next clock (or a flush)
                    self._pending.setdefault(w, []).append(copy)
                    self._result.replica_bytes += nbytes(copy)
                self._ended[s] = clock
                self._expected[s][out["changed"]] = out["counts"]
                self._result.version_bytes += int(out["changed"].nbytes + out["counts"].nbytes)
            if trouble:
                self._recover()
        self._completed = clock
        self._ack = clock - self.cfg.lag
        every = self.cfg.checkpoint_every
        if every is not None and (clock + 1) % every == 0:
            ray.get([s.save_checkpoint.remote(clock) for s in self.servers])
        self._close_recoveries()
        if self.on_clock is not None:
            self.on_clock(clock, self._result)

    def _clock_call(self, w: int, clock: int) -> Any:
        """Start ``clock`` on worker ``w``, handing it the replica copies pending for it."""
        return self.workers[w].run_clock.remote(clock, self._ack, self._pending.pop(w, []))

    def _flush_replicas(self) -> None:
        """Deliver every pending replica copy now (before a rebuild gathers the workers' copies)."""
        import ray

        for w in list(self._pending):
            try:
                ray.get(self.workers[w].replicate.remote(self._pending.pop(w)))
            except Exception as exc:
                if not server_unavailable(exc):
                    raise
                self._worker_lost(w)

    # -- SSP: workers run ahead of the slowest by at most `staleness` clocks -----------------------
    def _run_ssp(self, start: int) -> None:
        import ray

        cfg = self.cfg
        self._done = [start - 1] * cfg.workers
        while min(self._done) < cfg.clocks - 1:
            busy = {w for w, _ in self._inflight.values()}
            for w in range(cfg.workers):
                nxt = self._done[w] + 1
                if w not in busy and nxt < cfg.clocks and nxt <= min(self._done) + 1 + cfg.staleness:
                    self._inflight[self._clock_call(w, nxt)] = (w, nxt)
            ready, _ = ray.wait(list(self._inflight), num_returns=1)
            if self._collect(ready):
                self._recover()
            while min(self._done) > self._completed:
                clock = self._completed + 1
                self._end_clock(clock)
                self._inject(clock, "after_apply")

    def _collect(self, refs: list[Any]) -> bool:
        """Book finished SSP clocks; return True if a server looked unavailable."""

        trouble = False
        for ref in refs:
            w, clock = self._inflight.pop(ref)
            lost, ok = self._await_clock(w, clock, ref)
            trouble |= lost
            if ok:
                self._done[w] = clock
        return trouble

    # -- failures --------------------------------------------------------------------------------
    def _inject(self, clock: int, phase: str) -> None:
        """Kill the actors of the failures due now; return once they are dead (servers: the job
        finds out on its next call) or relaunched by Ray (workers)."""
        import ray

        for f in [f for f in self._failures if f.clock == clock and f.phase == phase]:
            self._failures.remove(f)
            targets = [(self.servers[s], ray.get(self.servers[s].status.remote())["pid"]) for s in f.servers]
            targets += [(self.workers[w], ray.get(self.workers[w].pid.remote())) for w in f.workers]
            self._kill_time = time.perf_counter()
            for actor, pid in targets:
                if f.how == "ray":
                    ray.kill(actor, no_restart=False)
                else:
                    os.kill(pid, signal.SIGKILL)
            for actor, _ in targets[: len(f.servers)]:
                _wait_dead(actor)
            for actor, pid in targets[len(f.servers) :]:
                _wait_relaunched(actor, pid)
            if f.workers:
                self._relaunch_seconds = time.perf_counter() - self._kill_time
            for w in f.workers:
                self._worker_lost(w)
            if f.workers:
                self._recover()

    def _worker_lost(self, w: int) -> None:
        """A worker died: wait for Ray to relaunch it; servers forget the copies it held."""
        import ray

        _wait_relaunched(self.workers[w], None)
        ray.get(self.workers[w].configure.remote(self.cfg.to_dict()))
        ray.get(self.workers[w].set_servers.remote(self.servers))
        self._pending.pop(w, None)  # the servers forget what this worker held or was about to hold
        self._relaunched.add(w)
        for s in self.servers:
            try:
                ray.get(s.forget_worker.remote(w))
            except Exception as exc:
                if not server_unavailable(exc):
                    raise

    # -- standby servers -------------------------------------------------------------------------
    def _refill(self) -> None:
        """Start standby servers until the pool holds ``spares`` (not waited for); stop any surplus."""
        import ray

        while len(self.spares) > self.cfg.spares:
            ray.kill(self.spares.pop(), no_restart=True)
        while len(self.spares) < self.cfg.spares:
            self.spares.append(self._server_cls.options(**_SERVER).remote(self.cfg.to_dict(), None))

    def _standby(self) -> Any:
        """A live standby from the pool, or (pool empty) a new server actor."""
        import ray

        while self.spares:
            actor = self.spares.pop(0)
            try:
                ray.get(actor.status.remote())
                return actor
            except Exception as exc:
                if not server_unavailable(exc):
                    raise
        return self._server_cls.options(**_SERVER).remote(self.cfg.to_dict(), None)

    def _take_over(self) -> tuple[list[int], list[int]]:
        """Give every dead server's shard to a standby and tell the workers.

        Returns the dead servers and every server that needs a rebuild (the dead ones, plus any
        that an earlier recovery left incomplete)."""
        import ray

        dead, bad = [], []
        for s, actor in enumerate(self.servers):
            try:
                if ray.get(actor.status.remote())["recovering"]:
                    bad.append(s)
            except Exception as exc:
                if not server_unavailable(exc):
                    raise
                dead.append(s)
        for s in dead:
            self.servers[s] = self._standby()
            ray.get(self.servers[s].take_over.remote(s, self.cfg.to_dict()))
        if dead:
            told = {w: worker.set_servers.remote(self.servers) for w, worker in enumerate(self.workers)}
            for w, ref in told.items():
                try:
                    ray.get(ref)
                except Exception as exc:
                    if not server_unavailable(exc):
                        raise
                    self._worker_lost(w)
        return dead, sorted(dead + bad)

    def _recover(self) -> None:
        """Find dead servers and bring their shards back on standbys: rebuild (FreeLauncher) or roll back."""
        import ray

        while self._inflight:  # SSP: let running clocks finish (or fail) before touching servers
            self._collect(list(self._inflight))
        self._flush_replicas()
        begin = self._kill_time if self._kill_time is not None else time.perf_counter()
        dead, bad = self._take_over()
        replace = time.perf_counter() - begin if dead else self._relaunch_seconds
        self._kill_time, self._relaunch_seconds = None, float("nan")
        workers, self._relaunched = sorted(self._relaunched), set()
        if not bad:
            if workers:
                self._open.append(
                    (
                        Recovery(self._completed + 1, [], workers, "worker", replace_seconds=replace),
                        begin,
                        self._completed,
                    )
                )
                self._close_recoveries()
            return
        if self.cfg.mode == "none":
            self._rollback(None, bad, workers, (begin, replace), "restart", "no fault tolerance: restarting")
        if self.cfg.mode == "checkpoint":
            self._rollback(self._checkpoint_step(), bad, workers, (begin, replace), "checkpoint", "")
        event = Recovery(self._completed + 1, bad, workers, "replica", replace_seconds=replace)
        missing: dict[int, NDArray[np.int64]] = {}
        for s in bad:
            reports = [self._report(w, s) for w in range(self.cfg.workers)]
            out = ray.get(self.servers[s].recover.remote(self._ended[s], self._expected[s], *reports))
            event.replayed_pushes += out["replayed"]
            if out["missing"].size:
                missing[s] = out["missing"]
        if missing:
            lost = "; ".join(
                f"server {s}: {len(b)} blocks (e.g. {b[:5].tolist()})" for s, b in missing.items()
            )
            msg = (
                f"data loss: every copy of some blocks' recovery point failed ({lost}); "
                f"replicas={self.cfg.replicas} tolerates {self.cfg.replicas - 1} simultaneous failures "
                "of copy holders"
            )
            if self.cfg.checkpoint_every is None:
                raise DataLossError(
                    msg + ". Set checkpoint_dir and checkpoint_every to fall back to a checkpoint, "
                    "or raise replicas."
                )
            step = self._checkpoint_step()
            msg += f"; rolling back every server and worker to checkpoint step {step}"
            warnings.warn(msg, DataLossWarning, stacklevel=2)
            self._rollback(step, bad, workers, (begin, replace), "checkpoint", msg)
        self._open.append((event, begin, self._completed))
        self._close_recoveries()

    def _report(self, w: int, s: int) -> dict[str, Any]:
        import ray

        while True:
            try:
                out: dict[str, Any] = ray.get(self.workers[w].report.remote(s))
                return out
            except Exception as exc:
                if not server_unavailable(exc):
                    raise
                self._worker_lost(w)

    def _checkpoint_step(self) -> int | None:
        """The newest step every shard committed, or None."""
        import ray

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
        import ray

        counts = ray.get([s.restore_checkpoint.remote(step) for s in self.servers])
        ray.get([w.reset.remote() for w in self.workers])
        resume = 0 if step is None else step + 1
        discarded = sum(n for (_, t), n in self._pushed.items() if t >= resume and t <= self._completed)
        event = Recovery(
            self._completed + 1,
            bad,
            workers,
            kind,
            recomputed_clocks=self._completed + 1 - resume,
            discarded_updates=discarded,
            message=message,
            replace_seconds=when[1],
        )
        self._open.append((event, when[0], self._completed))
        self._ended = [resume - 1] * self.cfg.servers
        self._expected = [np.array(c, np.int32) for c in counts]  # ray.get gives read-only arrays
        self._completed, self._ack, self._pending = resume - 1, resume - 1 - self.cfg.lag, {}
        raise _Rewind(resume)

    def _close_recoveries(self) -> None:
        """Stamp the recovery time once the job is back where it was when the failure hit; then
        refill the standby pool (starting a process is kept off the recovery's critical path)."""
        now = time.perf_counter()
        for item in list(self._open):
            event, begin, target = item
            if self._completed >= target:
                event.seconds = now - begin
                self._result.recoveries.append(event)
                self._open.remove(item)
        if not self._open:
            self._refill()


def _wait_dead(actor: Any) -> None:
    """Block until calls to the killed ``actor`` fail (Ray notices within milliseconds)."""
    import ray

    deadline = time.monotonic() + _RESTART_TIMEOUT
    while time.monotonic() < deadline:
        try:
            ray.get(actor.status.remote(), timeout=_RESTART_TIMEOUT)
        except Exception as exc:
            if not server_unavailable(exc):
                raise
            return
        time.sleep(0.005)
    raise TimeoutError(f"a killed server still answered after {_RESTART_TIMEOUT:.0f} s")


def _wait_relaunched(actor: Any, old_pid: int | None) -> None:
    """Block until worker ``actor`` answers again (from a new process if ``old_pid`` is given)."""
    import ray

    deadline = time.monotonic() + _RESTART_TIMEOUT
    while True:
        try:
            pid = ray.get(actor.pid.remote(), timeout=_RESTART_TIMEOUT)
            if old_pid is None or pid != old_pid:
                return
        except Exception as exc:
            if not server_unavailable(exc):
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"actor did not come back within {_RESTART_TIMEOUT:.0f} s after a failure")
        time.sleep(0.02)
