"""The memory tier (docs/memory.md): what a memory save every step costs a training step, how fast
a restart recovers from each source, and how many steps a failure loses.

DDP and FSDP2, 4 ranks (one process per rank, gloo on 127.0.0.1) pretended as 2 hosts of 2 ranks
(``MemoryTier(host=...)``), the distributed bench's state (bench/distributed/model.py: an MLP of
2048x2048 layers, parameters + AdamW moments, 256 MiB in total), memory directories under
/dev/shm (removed after), S3 on moto's ThreadedMotoServer (127.0.0.1). Per kind, one launch
(bench/memory_tier/rank.py) measures training steps with no checkpoint, with a memory save every
step (every 50th also persistent) and with a persistent save every 50 steps, block after block,
then restores one step from each source into a fresh model and optimizer; then the job of
bench/memory_tier/job.py is SIGKILLed at random instants and restarted (bench/memory_tier/kills.py).

    python -m bench memory_tier [--quick] [--kinds ddp fsdp] [--seed N] [--no-s3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from bench.distributed import launch_once_more, machine
from bench.memory_tier.kills import trials
from bench.memory_tier.report import plot, report
from bench.storage.server import BUCKET, moto_server

HERE = Path(__file__).resolve().parent
WORK = HERE.parent / ".work" / "memory_tier"
RESULTS = HERE.parent / "results"
MiB = 1 << 20

FULL = {
    "world": 4, "total": 256, "batch": 32, "rounds": 3, "block": 8, "memory_block": 4, "persist_every": 50,
    "floor_reps": 3, "recover_rounds": 3, "kills": 3, "sync_kills": 2, "kill_span": [1, 2], "today_kills": 2,
    "today_span": [1, 50],
}  # fmt: skip
QUICK = {
    "world": 2, "total": 48, "batch": 16, "rounds": 2, "block": 2, "memory_block": 2, "persist_every": 3,
    "floor_reps": 1, "recover_rounds": 1, "kills": 1, "sync_kills": 1, "kill_span": [1, 2], "today_kills": 1,
    "today_span": [1, 3],
}  # fmt: skip


def run_kind(
    kind: str, plan: dict[str, Any], shm: Path, s3_options: dict[str, Any], seed: int, scratch: Path
) -> dict[str, Any]:
    """Every measurement of one kind (ddp, fsdp), its files in ``scratch`` and ``shm``, deleted after."""
    work, mem = scratch / kind, shm / kind
    work.mkdir(parents=True)
    taken = ("batch", "block", "memory_block", "rounds", "persist_every", "floor_reps", "recover_rounds")
    cfg = {
        **{k: plan[k] for k in taken}, "kind": kind, "total": plan["total"] * MiB, "shm": str(mem),
        "work": str(work), "s3": f"s3://{BUCKET}/{kind}-{secrets.token_hex(4)}" if s3_options else "",
        "s3_options": s3_options,
        "dirs": {"work": str(work), "shm": str(mem)},
    }  # fmt: skip
    print(f"-- {kind}: training steps, then restores", flush=True)
    result = launch_once_more(plan["world"], cfg, kind, module="bench.memory_tier.rank", work=scratch)
    check(kind, result["recovery"])
    rng = random.Random(f"{seed}-{kind}")
    job = {"kind": kind, "total": plan["total"] * MiB, "batch": plan["batch"],
           "persist_every": plan["persist_every"]}  # fmt: skip
    memory, sync = {"mode": "memory", "sync": False}, {"mode": "memory", "sync": True}
    modes = {  # (what the report calls it, the job's settings, kills, steps between kills)
        "kills": ("memory save every step", memory, plan["kills"], plan["kill_span"]),
        "sync": ("the same, sync saves", sync, plan["sync_kills"], plan["kill_span"]),
        "today": (
            f"persistent save every {plan['persist_every']} steps", {"mode": "persistent", "sync": False},
            plan["today_kills"], plan["today_span"],
        ),
    }  # fmt: skip
    for key, (label, how, count, span) in modes.items():
        print(f"-- {kind}: kills, {label}", flush=True)
        settings = {**job, **how, "disk": str(work / f"kill-{key}"), "shm": str(mem / f"kill-{key}")}
        result[key] = trials(settings, plan["world"], count, tuple(span), rng, scratch, f"{kind}-kill-{key}")
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(mem, ignore_errors=True)
    return result


def check(kind: str, recovery: dict[str, list[list[dict[str, Any]]]]) -> None:
    """Every restore brought back the saved state bit for bit, from where it should have: the
    memory tier's own copies, peers' copies for the wiped host, never the persistent tier then."""
    for source, rounds in recovery.items():
        for ranks in rounds:
            for rank, got in enumerate(ranks):
                where = f"{kind}: restore from {source}, rank {rank}"
                if not got["bit_identical"]:
                    raise SystemExit(f"{where}: the state restored differs from the state saved")
                want = {"memory": "memory", "peer": "peer" if rank >= len(ranks) // 2 else "memory"}
                expected = want.get(source, "persistent")
                if not got["source"].startswith(expected):
                    raise SystemExit(f"{where}: restored from {got['source']!r}, not {expected!r}")
                if source in want and got["persistent_bytes"]:
                    raise SystemExit(f"{where}: read {got['persistent_bytes']} bytes of the persistent tier")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench memory_tier")
    parser.add_argument("--quick", action="store_true", help="a 48 MiB state on 2 ranks, a few steps")
    parser.add_argument("--kinds", nargs="+", choices=["ddp", "fsdp"], default=["ddp", "fsdp"])
    parser.add_argument("--seed", type=int, default=1, help="seed of the kills' ranks and instants")
    parser.add_argument("--out", type=Path, help="the report (default: bench/results/memory_tier.md)")
    parser.add_argument("--work", type=Path, default=WORK, help="scratch space (checkpoints, logs), emptied")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from its JSON")
    parser.add_argument("--no-s3", action="store_true", help="no restore from S3 (a machine without moto)")
    parser.add_argument(
        "--shm", type=Path, default=Path("/dev/shm"), help="where the memory tiers go (a RAM disk)"
    )
    parser.add_argument("--kills", type=int, help="SIGKILLs per mode and kind (default: the plan's)")
    args = parser.parse_args(argv)
    partial = args.quick or args.kinds != ["ddp", "fsdp"]
    out = args.out or (WORK.parent / "memory_tier.md" if partial else RESULTS / "memory_tier.md")
    if args.report_only:
        saved = json.loads(out.with_suffix(".json").read_text())
        print(write(out, saved["results"], saved["meta"]))
        return
    plan = QUICK if args.quick else FULL
    if args.kills is not None:
        plan = {**plan, "kills": args.kills, "sync_kills": args.kills, "today_kills": args.kills}
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    shm = args.shm / f"crashsafe-bench-{os.getpid()}-{secrets.token_hex(4)}"
    began, load_before = time.perf_counter(), os.getloadavg()
    results = {}
    try:
        with contextlib.nullcontext({}) if args.no_s3 else moto_server() as options:
            for kind in args.kinds:
                results[kind] = run_kind(kind, plan, shm, options, args.seed, args.work)
    finally:  # (the scratch space, with the ranks' logs, is kept if the run failed)
        shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(args.work, ignore_errors=True)
    command = "make bench BENCH=memory_tier"
    if argv:
        command = ".venv/bin/python -m bench memory_tier " + " ".join(argv)
    load = (
        "/".join(f"{x:.2f}" for x in load_before)
        + " at the start, "
        + "/".join(f"{x:.2f}" for x in os.getloadavg())
        + " at the end (1/5/15 min)"
    )
    meta = {
        "command": command, "machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M %Z"),
        "elapsed": time.perf_counter() - began, "load": load, "plan": plan, "seed": args.seed,
        "cores": os.cpu_count(), "s3": not args.no_s3, "shm": shm_description(args.shm),
    }  # fmt: skip
    print(write(out, results, meta))
    print(f"written to {out}", flush=True)


def shm_description(where: Path) -> str:
    """``where`` and its mount's file system type and options (from /proc/self/mounts): "tmpfs" with
    or without ``huge=``, which decides the page size of the memory tier's files."""
    best = ("", "?", "?")
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, kind, options, *_ = line.split()
            if where.resolve().is_relative_to(point) and len(point) >= len(best[0]):
                best = (point, kind, options)
    huge = [o for o in best[2].split(",") if o.startswith("huge=")]
    return f"{best[1]} ({where}{', ' + huge[0] if huge else ', 4 KiB pages' if best[1] == 'tmpfs' else ''})"


def write(out: Path, results: dict[str, Any], meta: dict[str, Any]) -> str:
    """The report (markdown), its figure and the raw figures (JSON, with how they were made)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    text = report(results, meta)
    plot(results, out.with_suffix(".png"), meta["plan"]["persist_every"])
    text += f"\n![step time and recovery]({out.with_suffix('.png').name})\n"
    out.write_text(text)
    return text
