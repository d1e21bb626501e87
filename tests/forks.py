"""Test processes that use torch, forked from a process that imported it once (zygote.py) instead of
each importing it again: 2 s of CPU a process, 4 s of a 4-rank launch on 2 cores. Each is still its
own process, started by fork as multiprocessing's forkserver starts one (the integration tests'
forkserver does so for Lightning), with its own pid, environment, working directory, stdout,
stderr, exit code and signals; crashsafe is imported in it, never in the zygote. Rank r of every
launch forks from zygote r (started at its first use), so the ranks of one launch differ in their
string hashes (PYTHONHASHSEED) as processes started apart do; OMP_NUM_THREADS, which torch reads
when it is imported, picks a zygote started with the same."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


class Zygote:
    """One zygote.py process, and the exit codes of the children it forked."""

    def __init__(self, env: dict[str, str]) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="zygote-")
        path = os.path.join(self._dir.name, "socket")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "zygote.py"), path], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready", "the zygote did not start"
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(path)
        self._changed = threading.Condition()
        self._forked: list[int] = []
        self._codes: dict[int, int] = {}
        self._spawning = threading.Lock()
        self._listener = threading.Thread(target=self._listen, daemon=True)
        self._listener.start()

    def _listen(self) -> None:
        while message := self._conn.recv(1 << 16):
            answer = json.loads(message)
            with self._changed:
                if "pid" in answer:
                    self._forked.append(answer["pid"])
                else:
                    self._codes[answer["exit"]] = answer["code"]
                self._changed.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int) -> int:
        """The pid of a new child running ``python *argv`` with ``env`` in this working directory, its
        stdout and stderr on these file descriptors (closed here: the child has its own)."""
        with self._spawning, self._changed:
            try:
                request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
                socket.send_fds(self._conn, [request], [stdout, stderr])
            finally:
                os.close(stdout)
                os.close(stderr)
            if not self._changed.wait_for(lambda: self._forked, timeout=60):
                raise RuntimeError("the zygote did not fork within 60 s")
            return self._forked.pop()

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """The exit code of child ``pid`` (minus the signal that ended it), or None after ``timeout``."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._codes, timeout=timeout)
            return self._codes.get(pid)

    def stop(self) -> None:
        """Tell the zygote to end (its children go on)."""
        self._conn.shutdown(socket.SHUT_RDWR)  # the zygote, and the listening thread, see the end

    def close(self) -> None:
        self.stop()
        self._listener.join(30)
        self._conn.close()
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            assert self.proc.stdout is not None
            self.proc.stdout.close()
            self._dir.cleanup()


class Zygotes:
    """Zygote r for the ranks r of every launch (and OMP_NUM_THREADS, which torch reads when it is
    imported), each started at its first use."""

    def __init__(self) -> None:
        self._started: dict[tuple[int, str | None], Zygote] = {}

    def of(self, rank: int, threads: str | None) -> Zygote:
        if (rank, threads) not in self._started:
            env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
            self._started[rank, threads] = Zygote(
                env if threads is None else {**env, "OMP_NUM_THREADS": threads}
            )
        return self._started[rank, threads]

    def close(self) -> None:
        for zygote in self._started.values():
            zygote.stop()  # (all at once: each takes a while to end)
        for zygote in self._started.values():
            zygote.close()


class Forked:
    """``python *argv`` with ``env``, forked by zygote ``rank``, used as a ``subprocess.Popen`` with a
    piped text stdout; its stderr goes to the file descriptor ``stderr`` (a log)."""

    def __init__(
        self, zygotes: Zygotes, rank: int, argv: list[str], env: dict[str, str], stderr: int
    ) -> None:
        self._zygote = zygote = zygotes.of(rank, env.get("OMP_NUM_THREADS"))
        read, write = os.pipe()
        self.pid = zygote.spawn(argv, env, write, os.dup(stderr))
        self.stdout: Any = open(read)  # noqa: SIM115 - closed by its reader, as a Popen's
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"rank (pid {self.pid})", timeout or 0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Everything the child wrote to stdout, once it has ended (its stderr goes to a log)."""
        began, out = time.monotonic(), []
        reader = threading.Thread(target=lambda: out.append(self.stdout.read()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            raise subprocess.TimeoutExpired(f"rank (pid {self.pid})", timeout or 0)
        self.stdout.close()
        self.wait(None if timeout is None else max(0.0, timeout - (time.monotonic() - began)))
        return out[0], None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (not yet reaped: the pid is still this child's)
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
