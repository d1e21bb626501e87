"""Storage benchmark: object stores, two tiers, and the fixed cost of a local durable commit.

Side by side in one run, methods interleaved, best of ``--repeat`` runs (the machine is shared and
noisy, so the results are ratios taken within the run):

1. Object store (:mod:`bench.storage.objectstore`): save and restore of a 512 MiB state to a real S3
   API on 127.0.0.1 (moto): crashsafe vs the raw s3fs ceiling vs DCP's FsspecWriter/FsspecReader.
2. Two tiers (:mod:`bench.storage.tiers`): the training stall of ``CheckpointManager(local,
   mirror="s3://...")`` vs local only, in a real training loop.
3. Fixed cost of a durable local commit (:mod:`bench.storage.commit`), 1 KiB to 2 GiB, a tiny GPT-2
   + AdamW and a KMeans-sized state: crashsafe vs torch.save / np.savez + fsync + rename + dir fsync.

    python -m bench storage [--quick] [--repeat N] [--only objectstore,tiers,commit]
"""

from __future__ import annotations

import argparse
import shutil
import time
from typing import Any

import torch

from bench.storage import commit, objectstore, report, tiers
from bench.storage.common import RESULTS, WORK, MiB
from bench.storage.server import moto_server

PARTS = "objectstore,tiers,commit"
# the mirror's server at the loop's priority, and niced (as a store on another machine takes none
# of this machine's cores)
TIER_SERVERS = {"moto, same priority": 0, "moto at nice 19": 19}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench storage")
    parser.add_argument("--quick", action="store_true", help="smaller states, one repeat (a smoke run)")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--only", default=PARTS, help=f"a comma-separated subset of {PARTS}")
    args = parser.parse_args(argv)
    repeat = args.repeat or (1 if args.quick else 3)
    parts = set(args.only.split(","))
    torch.set_num_threads(2)
    WORK.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    size = (64 if args.quick else 512) * MiB
    obj = None
    tier_rows: dict[str, Any] = {}
    tier_bytes = 0
    rows = found = floor = split = None
    if "objectstore" in parts:
        with moto_server() as options:
            obj = objectstore.run(options, size, repeat)
    if "tiers" in parts:
        for server, nice in TIER_SERVERS.items():
            with moto_server(nice) as options:
                print(f"-- server: {server}", flush=True)
                tier_size = (64 if args.quick else 128) * MiB  # each mirrored step is uploaded and read back
                saves = 3 if args.quick else 4
                tier_bytes, tier_rows[server] = tiers.run(options, tier_size, repeat, saves=saves, between=3)
    if "commit" in parts:
        print("-- durable local commit", flush=True)
        rows = commit.run(repeat, args.quick)
        print("-- syscall counts (strace)", flush=True)
        found = commit.count_syscalls()
        floor = commit.measure_floor()
        split = commit.phases()
    elapsed = time.perf_counter() - began
    shutil.rmtree(WORK, ignore_errors=True)
    command = "make bench BENCH=storage" + "".join(f" {a}" for a in argv)
    lines = report.header(command, elapsed, repeat)
    if obj is not None:
        lines += report.objectstore(*obj)
    if tier_rows:
        lines += report.tiers(tier_rows, tier_bytes)
    if rows is not None and floor is not None:
        lines += report.commit(rows, found, floor, split)
        report.plot(rows, RESULTS / "storage.png")
        lines += ["![durable commit](storage.png)", ""]
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines)
    (RESULTS / "storage.md").write_text(text)
    print(text)
