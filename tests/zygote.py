"""A process that imports torch once and forks test processes from itself, so that each skips the
2 s of CPU that importing torch takes (forks.py starts it and asks for them).

Usage: zygote.py SOCKET. It serves one connection on the Unix socket SOCKET: each request (a JSON
object with the script's argv, environment and working directory, and two file descriptors for its
stdout and stderr) forks a child that runs the script as ``python SCRIPT ARGS`` would (``__main__``,
its directory then PYTHONPATH first on sys.path, PYTHONUNBUFFERED and PYTHONFAULTHANDLER honoured,
exit code from SystemExit, 1 on an uncaught exception, the interpreter's usual shutdown); the
answer is the child's pid, and
each child's exit is sent as it is reaped (its code, or minus the signal that ended it, as Popen).
Only torch and numpy are imported here, never crashsafe: crashsafe reads its fault-injection
environment (CRASHSAFE_KILL_AT) when it is imported, in each child. Single-threaded, so forking
is safe; torch starts no thread when it is imported.
"""

from __future__ import annotations

import faulthandler
import io
import json
import os
import runpy
import select
import socket
import sys
import traceback
from typing import Any

import numpy  # noqa: F401  (what every rank imports: torch, numpy)
import torch
import torch.distributed
import torch.distributed.device_mesh
import torch.distributed.fsdp  # noqa: F401


def _pythonpath() -> list[str]:
    """PYTHONPATH's directories, absolute, each once, as the interpreter puts them on sys.path."""
    found = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return list(dict.fromkeys(found))


# sys.path past the script's directory and PYTHONPATH: the interpreter's own (stdlib, site-packages)
_BASE = [p for p in sys.path[1:] if os.path.abspath(p) not in _pythonpath()]


def _run(request: dict[str, Any], out: int, err: int) -> int:
    """In the forked child: run the script with its own argv, environment, stdout and stderr."""
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            write_through=unbuffered, line_buffering=not unbuffered and name == "stderr",
            errors="backslashreplace" if name == "stderr" else "strict",
        )  # fmt: skip
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115 - as the interpreter's own
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    if "numpy.random" in sys.modules:  # seeded when imported, as in a process of its own (random is
        sys.modules["numpy.random"].seed()  # reseeded by fork itself)
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *_pythonpath(), *_BASE]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:
        shown = exc.__traceback__  # from the script's frame on, as the interpreter shows it
        while shown is not None and shown.tb_frame.f_code.co_filename != script:
            shown = shown.tb_next
        traceback.print_exception(type(exc), exc, shown or exc.__traceback__)
        return 1
    return 0


def _reap(conn: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            conn.send(json.dumps({"exit": pid, "code": code}).encode())


def main(path: str) -> int:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(1)
    print("ready", flush=True)
    conn, _ = server.accept()
    server.close()
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([conn], [], [], 0.05)
        _reap(conn, children)
        if not ready:
            continue
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        if not message:  # the tests are done
            return 0
        pid = os.fork()
        if pid == 0:
            conn.close()
            return _run(json.loads(message), *fds)  # the child ends as the script's process
        for fd in fds:
            os.close(fd)
        children.add(pid)
        conn.send(json.dumps({"pid": pid}).encode())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
