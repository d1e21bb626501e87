"""Part 2: the training stall of a two-tier manager (local + s3:// mirror) vs local only, in a
real training loop of bench/core.py's MLP + Adam."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import crashsafe as cs
from bench.core import make_state, state_bytes
from bench.storage.common import WORK, MiB, Row
from bench.storage.server import BUCKET, s3, wipe


def train_steps(state: dict[str, Any], x: torch.Tensor, steps: int) -> None:
    model, optim = state["model"], state["optim"]
    for _ in range(steps):
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


# the same S3 traffic as a mirror's (upload, then read back), from another process: what the
# cores alone cost the loop, without sharing this process's GIL
_TRAFFIC = """
import json, sys, threading, s3fs
options, prefix, nbytes = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
fs = s3fs.S3FileSystem(**options)
blob, part = bytes(nbytes), 64 << 20
objects = {f"{prefix}/{i:05d}": blob[i : i + part] for i in range(0, nbytes, part)}
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("ready", flush=True)
while not stop.is_set():
    fs.pipe(objects, batch_size=4)
    fs.cat(list(objects), batch_size=8)
fs.rm(prefix, recursive=True)
"""


def bench_loop(
    state: dict[str, Any],
    options: dict[str, Any] | None,
    tag: str,
    saves: int,
    between: int,
    traffic: bool = False,
) -> Row:
    """Save every ``between`` steps (async, the default). stall = how long ``save`` blocks the loop,
    split into waiting for the previous save's commit (``mgr.wait()``, called just before) and the
    rest (the copy into staging and bookkeeping); compute = the training steps between saves."""
    directory = WORK / f"tiers-{tag}"
    shutil.rmtree(directory, ignore_errors=True)
    mirror = None if options is None or traffic else f"s3://{BUCKET}/tier-{tag}"
    mgr = cs.CheckpointManager(
        directory,
        keep_last=2,
        mirror=mirror,
        storage_options=options if mirror else None,
        mirror_keep_last=2 if mirror else None,
    )
    x = torch.randn(32, state["model"][0].in_features)
    side = None
    if traffic:
        side = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _TRAFFIC,
                json.dumps(options),
                f"{BUCKET}/traffic-{tag}",
                str(state_bytes(state)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert side.stdout is not None and side.stdout.readline().strip() == "ready"
    stalls, waits, computes = [], [], []
    for i in range(saves):
        t0 = time.perf_counter()
        train_steps(state, x, between)
        computes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mgr.wait()
        t1 = time.perf_counter()
        mgr.save((i + 1) * between, state)
        stalls.append(time.perf_counter() - t0)
        waits.append(t1 - t0)
    if side is not None:
        assert side.stdin is not None
        side.stdin.close()
        side.wait()
    t0 = time.perf_counter()
    mgr.wait()
    drain = time.perf_counter() - t0
    t0 = time.perf_counter()
    mirrored = mgr.wait_mirror()
    lag = time.perf_counter() - t0
    mgr.close()
    assert mirrored
    if mirror is not None:
        fs = s3(options)
        assert fs.ls(f"{BUCKET}/tier-{tag}"), "nothing mirrored"
        wipe(fs, f"tier-{tag}")
    shutil.rmtree(directory, ignore_errors=True)
    steady = slice(1, None)  # the first save allocates and pre-faults the staging buffers
    return {
        "stall": statistics.median(stalls[steady]),
        "stall_max": max(stalls[steady]),
        "wait": statistics.median(waits[steady]),
        "copy": statistics.median(s - w for s, w in zip(stalls[steady], waits[steady], strict=True)),
        "first": stalls[0],
        "compute": statistics.median(computes[steady]),
        "drain": drain,
        "lag": lag,
    }


LOCAL, MIRROR = "local only", "local + mirror s3://"
TRAFFIC = "local only + the same S3 traffic from another process"


def run(
    options: dict[str, Any], size: int, repeat: int, saves: int, between: int
) -> tuple[int, dict[str, Row]]:
    """Both setups alternately (order flipped each repeat); the best of each figure, and the
    spread of each setup's stall over the repeats (the noise)."""
    state = make_state(size)
    print(
        f"-- two tiers: {state_bytes(state) / MiB:.0f} MiB, {saves} saves every {between} steps", flush=True
    )
    train_steps(state, torch.randn(32, state["model"][0].in_features), 1)  # warm up
    methods: dict[str, Callable[[str], Row]] = {
        LOCAL: lambda tag: bench_loop(state, None, f"local-{tag}", saves, between),
        MIRROR: lambda tag: bench_loop(state, options, f"mirror-{tag}", saves, between),
        TRAFFIC: lambda tag: bench_loop(state, options, f"traffic-{tag}", saves, between, traffic=True),
    }
    samples: dict[str, list[float]] = {name: [] for name in methods}
    rows: dict[str, Row] = {}
    names = list(methods)
    for r in range(repeat):
        for name in names if r % 2 == 0 else names[::-1]:
            row = methods[name](str(r))
            samples[name].append(row["stall"])
            best = rows.get(name)
            rows[name] = row if best is None else {k: min(v, best[k]) for k, v in row.items()}
            print(f"   {name:22s} " + " ".join(f"{k}={v:.3f}" for k, v in row.items()), flush=True)
    for name in names:
        rows[name]["stall_spread"] = max(samples[name]) / min(samples[name])
    return state_bytes(state), rows
