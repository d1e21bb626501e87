"""Distributed checkpoints: crashsafe async vs ``dcp.async_save`` vs ``dcp.save``, DDP and FSDP2.

The same states (an MLP's parameters + AdamW moments, 256 MiB and 1 GiB in total) as DDP replicas
and as FSDP2 shards (``fully_shard``), on 2 and 4 ranks (one process per rank, gloo on 127.0.0.1),
side by side in one run: training stall, time to durable commit, bytes written per rank, restore,
resharded restore (4 -> 2 and 2 -> 4) and peak extra memory per rank. Each launch runs every method
in the same processes, one after the other (bench/distributed/rank.py).

    python -m bench distributed [--quick] [--saves N]

``python -m bench.distributed.grow`` measures what a rank of a larger world reads (N ranks' FSDP2
checkpoint restored by M > N) and how long it takes, with this crashsafe or another (``--src``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.distributed.report import plot, report

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORK = HERE.parent / ".work" / "distributed"
RESULTS = HERE.parent / "results"
MiB = 1 << 20
METHODS = ["crashsafe", "crashsafe_sync", "dcp_async", "dcp_async_cached", "dcp", "raw"]
LAUNCH_TIMEOUT = 600.0
PR_SET_PDEATHSIG = 1
MEMORY_WAIT = 600.0  # seconds a launch waits for memory
RANK_OVERHEAD = 0.35 * (1 << 30)


def _store_socket() -> socket.socket:
    """The rendezvous store's listening socket, bound to 127.0.0.1 by the launcher and handed to
    rank 0 (``master_listen_fd``): torch's TCPStore would otherwise listen on every interface."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def rank_env(
    rank: int, world: int, listener: socket.socket, src: str | Path
) -> tuple[dict[str, str], tuple[int, ...]]:
    """The environment of one rank's process, and the descriptors it inherits: rank 0 gets the
    rendezvous store's listening socket (``BENCH_STORE_FD``), bound to 127.0.0.1 by the launcher."""
    path = ":".join(filter(None, [str(ROOT), str(src), os.environ.get("PYTHONPATH")]))  # (+ a device's)
    env = {
        **os.environ, "PYTHONPATH": path, "RANK": str(rank), "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(listener.getsockname()[1]),
        "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    if rank != 0:
        return env, ()
    env["BENCH_STORE_FD"] = str(listener.fileno())
    return env, (listener.fileno(),)


def _available() -> int:
    match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    return int(match.group(1)) * 1024 if match else 0


class LaunchFailed(RuntimeError):
    """A rank of a launch exited with an error or a signal, or the launch overran its timeout."""


def launch_once_more(world: int, cfg: dict[str, Any], name: str, **how: Any) -> dict[str, Any]:
    """:func:`launch` (``how``: its keywords), run a second time if the first fails (the machine is
    shared); a retried launch says so in its result and in the report. A second failure ends the
    benchmark."""
    try:
        return launch(world, cfg, name, **how)
    except LaunchFailed as first:
        print(f"   {first}\n   retrying {name} once", flush=True)
        for directory in cfg["dirs"].values():  # the failed launch's saves: a retry starts afresh
            shutil.rmtree(directory, ignore_errors=True)
        try:
            result = launch(world, cfg, name, **how)
        except LaunchFailed as second:
            raise SystemExit(str(second)) from None
        result["retried"] = str(first).splitlines()[0]
        return result


def _die_with_launcher() -> None:
    """In each rank, before exec: SIGKILL it if the launcher dies (killed, interrupted), so that no
    rank outlives a launch."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _wait_for_memory(world: int, cfg: dict[str, Any], name: str) -> None:
    """Wait (up to MEMORY_WAIT) until the launch's memory is available: the machine is shared, and
    an out-of-memory kill could hit another job. Per rank: the state, the staging copies of
    crashsafe and of DCP's cached and default stagers, DDP's buckets, and the interpreter."""
    per_rank = cfg["total"] / (1 if cfg["kind"] == "ddp" else world)
    need = world * (RANK_OVERHEAD + 4.0 * per_rank)
    deadline = time.monotonic() + MEMORY_WAIT
    while _available() < need:
        if time.monotonic() > deadline:
            raise SystemExit(
                f"launch {name} needs about {need / (1 << 30):.1f} GiB and the machine has "
                f"{_available() / (1 << 30):.1f} GiB available; run it when other jobs leave room"
            )
        print(f"   waiting for {need / (1 << 30):.1f} GiB of memory to be available", flush=True)
        time.sleep(10)


def launch(
    world: int,
    cfg: dict[str, Any],
    name: str,
    module: str = "bench.distributed.rank",
    src: Path = ROOT / "src",
    work: Path = WORK,
) -> dict[str, Any]:
    """Run one job of ``world`` ranks (``python -m module CONFIG``, crashsafe from ``src``, its
    config, logs and result in ``work``) with ``cfg``; return rank 0's results and the machine's
    lowest available memory while it ran. Every rank is killed if any fails or the launch overruns."""
    cfg = {**cfg, "out": str(work / f"{name}.json")}
    _wait_for_memory(world, cfg, name)
    config = work / f"{name}.cfg.json"
    config.write_text(json.dumps(cfg))
    procs = []
    lowest = before = _available()
    with _store_socket() as listener:
        for rank in range(world):
            env, fds = rank_env(rank, world, listener, src)
            log = open(work / f"{name}.rank{rank}.log", "w")  # noqa: SIM115 - closed below
            cmd = [sys.executable, "-m", module, str(config)]
            proc = subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, pass_fds=fds,
                preexec_fn=_die_with_launcher,
            )  # fmt: skip
            procs.append((proc, log))
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    try:
        while any(p.poll() is None for p, _ in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p, _ in procs):
                break
            lowest = min(lowest, _available())
            time.sleep(0.2)
    finally:  # every rank still running is killed: a failed or overrun launch leaves nothing behind
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log.close()
    codes = [p.returncode for p, _ in procs]
    if any(codes):
        tail = (work / f"{name}.rank0.log").read_text()[-3000:]
        raise LaunchFailed(f"launch {name} failed (exit codes {codes}); rank 0's log ends:\n{tail}")
    result: dict[str, Any] = json.loads(Path(cfg["out"]).read_text())
    result["machine_mem"] = {"available_before": before, "lowest_available": lowest}
    return result


def bytes_per_rank(method: str, directory: Path, world: int) -> list[int]:
    """Bytes of the newest checkpoint on disk, by the rank that wrote them (the manifest or
    .metadata counts for rank 0, which writes it)."""
    steps = [p for p in directory.iterdir() if re.fullmatch(r"step_\d+", p.name)]
    newest = max(steps, key=lambda p: int(p.name[5:]))
    out = [0] * world
    for path in newest.rglob("*"):
        if not path.is_file():
            continue
        crashsafe = r"data-r(\d+)\.bin"
        patterns = {"crashsafe": crashsafe, "crashsafe_sync": crashsafe, "raw": r"rank(\d+)\.bin"}
        pattern = patterns.get(method, r"__(\d+)_\d+\.distcp")
        match = re.fullmatch(pattern, path.name)
        out[int(match.group(1)) if match else 0] += path.stat().st_size
    return out


def run_case(kind: str, size: int, worlds: list[int], saves: int, restores: int) -> dict[str, Any]:
    """Every launch of one (kind, size): saves and restores on each world, then resharded restores
    of each world's checkpoints on the other world."""
    total = size * MiB
    dirs = {w: {m: str(WORK / f"{kind}-{size}-w{w}-{m}") for m in METHODS} for w in worlds}
    restorable = {"crashsafe": "crashsafe", "dcp": "dcp"}  # dcp.load reads what either DCP save wrote
    case: dict[str, Any] = {}
    for i, world in enumerate(worlds):
        wanted = {m: (m, dirs[world][m]) for m in restorable}
        if i > 0:  # the previous world's checkpoints, resharded
            prev = worlds[i - 1]
            wanted |= {f"{m}<-{prev}": (m, dirs[prev][m]) for m in restorable}
        cfg = {
            "kind": kind, "total": total, "methods": METHODS, "dirs": dirs[world], "saves": saves,
            "restore_rounds": restores,
        }  # fmt: skip
        print(f"-- {kind} {size} MiB, {world} ranks", flush=True)
        result = launch_once_more(world, {**cfg, "restores": wanted}, f"{kind}-{size}-w{world}")
        result["bytes"] = {m: bytes_per_rank(m, Path(dirs[world][m]), world) for m in METHODS}
        case[f"w{world}"] = result
    if len(worlds) > 1:  # the last world's checkpoints, resharded onto the first
        first, last = worlds[0], worlds[-1]
        again = {f"{m}<-{last}": (m, dirs[last][m]) for m in restorable}
        cfg = {
            "kind": kind, "total": total, "methods": [], "dirs": {}, "saves": 0, "restores": again,
            "restore_rounds": restores,
        }  # fmt: skip
        print(f"-- {kind} {size} MiB, {first} ranks, restoring {last} ranks' checkpoints", flush=True)
        resharded = launch_once_more(first, cfg, f"{kind}-{size}-w{first}-reshard")
        case[f"w{first}"]["restores"] |= resharded["restores"]
        if "retried" in resharded:
            case[f"w{first}"]["retried_reshard"] = resharded["retried"]
    check_restores(case)
    for world_dirs in dirs.values():
        for d in world_dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    return case


def check_restores(case: dict[str, Any]) -> None:
    """Every restore must bring back exactly the state its method saved last (sum of all values)."""
    saved = {w: r["saves"] for w, r in case.items()}
    for world, result in case.items():
        for label, got in result["restores"].items():
            method, _, source = label.partition("<-")
            want = saved[f"w{source}" if source else world][method]["fingerprint"]
            for found in got["fingerprints"]:
                if abs(found - want) > 1e-9 * max(1.0, abs(want)):
                    raise SystemExit(f"{world} restore {label}: state sum {found} != saved {want}")


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    system = f"Linux {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}"
    return f"{os.cpu_count()} cores ({cpu}), {system}"


def write(out: Path, results: dict[str, Any], meta: dict[str, Any], figure: bool) -> str:
    """The report (markdown), its figure and the raw figures (JSON, with how they were made)."""
    text = report(results, meta["command"], meta["machine"], meta["elapsed"], meta["repeats"], meta["load"])
    text = text.replace("{when}", meta["when"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "distributed.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if figure:
        plot(results, out / "distributed.png")
        text += "\n![stall and durable commit](distributed.png)\n"
    (out / "distributed.md").write_text(text)
    return text


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench distributed")
    parser.add_argument("--quick", action="store_true", help="256 MiB on 2 ranks only (no resharding)")
    parser.add_argument("--saves", type=int, default=7, help="saves per method (the first warms up)")
    parser.add_argument("--restores", type=int, default=2, help="restores of each checkpoint (best kept)")
    parser.add_argument("--sizes", type=int, nargs="+", help="total state sizes in MiB (256 1024)")
    parser.add_argument("--worlds", type=int, nargs="+", help="rank counts (2 4); the first and last reshard")
    parser.add_argument("--kinds", nargs="+", choices=["ddp", "fsdp"], default=["ddp", "fsdp"])
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the report from bench/results/distributed.json"
    )
    args = parser.parse_args(argv)
    if args.report_only:  # the same figures, the report's text and figure made again
        saved = json.loads((RESULTS / "distributed.json").read_text())
        print(write(RESULTS, saved["results"], saved["meta"], figure=True))
        return
    sizes = args.sizes or ([256] if args.quick else [256, 1024])
    worlds = args.worlds or ([2] if args.quick else [2, 4])
    partial = args.quick or args.sizes or args.worlds or args.kinds != ["ddp", "fsdp"]
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    began, load_before = time.perf_counter(), os.getloadavg()
    results = {}
    for size in sizes:
        for kind in args.kinds:
            results[f"{kind} {size}"] = run_case(kind, size, worlds, args.saves, args.restores)
    elapsed = time.perf_counter() - began
    command = "make bench BENCH=distributed"
    if argv:
        command = ".venv/bin/python -m bench distributed " + " ".join(argv)
    load_after = os.getloadavg()
    load = (
        f"{'/'.join(f'{x:.2f}' for x in load_before)} at the start, "
        f"{'/'.join(f'{x:.2f}' for x in load_after)} at the end (1/5/15 min)"
    )
    meta = {
        "command": command.strip(), "machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M %Z"),
        "elapsed": elapsed, "repeats": [args.saves, args.restores], "load": load,
    }  # fmt: skip
    shutil.rmtree(WORK, ignore_errors=True)
    # a partial run (--quick, a subset) is a smoke test: kept beside the scratch space, never
    # over the committed results
    out = RESULTS if not partial else WORK.parent
    print(write(out, results, meta, figure=not partial))
    print(f"written to {out / 'distributed.md'}", flush=True)
