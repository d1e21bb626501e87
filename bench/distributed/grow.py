"""Growing the world: a crashsafe FSDP2 checkpoint of N ranks restored by M > N ranks, the bytes
each rank reads from the disk and the time the restore takes.

    .venv/bin/python -m bench.distributed.grow [--sizes 256 1024] [--save-world 2] [--world 4] [--src DIR]

One launch of N ranks saves the distributed bench's state (bench/distributed/model.py: an MLP of
2048x2048 layers + AdamW, FSDP2) once; one launch of M ranks restores it into a fresh model and
optimizer (as a restarted job does), ``--repeat`` times from the disk (the step's files evicted
from the page cache with ``posix_fadvise(DONTNEED)`` just before), then as often from the page
cache; the best time of each, slowest rank. Bytes: what each rank read from the checkpoint's files,
counted where the store layer serves them (a mapped file's ``populate``, a stored file's
``read_into``; each byte once): what a rank on a host of its own fetches from shared storage; and
the bytes all ranks had the disk read (``read_bytes`` of /proc/self/io, readahead included: ranks
of one host share the page cache, so a byte two ranks read comes from the disk once). ``--src``
runs another crashsafe (its ``src`` directory, e.g. a worktree of an older commit) for both
launches, to compare. Scratch space: bench/.work/grow (removed at the end).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from bench.readcount import Reads, count_reads

MiB = 1 << 20


def _read_bytes() -> int:
    """Bytes this process (all its threads) had the kernel read from storage so far."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"])


def _evict(directory: Path) -> None:
    """Drop every file of every step in ``directory`` from the page cache (they are clean: synced)."""
    for path in directory.glob("step_*/*"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _restore(cfg: dict[str, Any], cold: bool, reads: Reads) -> dict[str, Any]:
    """One restore of the newest step into a fresh model and optimizer, measured on every rank."""
    import torch.distributed as dist

    import crashsafe as cs
    from bench.distributed.model import build, fingerprint
    from bench.distributed.rank import _gather

    model, optim = build("fsdp", cfg["total"], dist.get_world_size(), trained=False)
    gc.collect()
    if cold and dist.get_rank() == 0:
        _evict(Path(cfg["dir"]))
    dist.barrier()
    reads.take()
    disk, began = _read_bytes(), time.perf_counter()
    with cs.CheckpointManager(cfg["dir"], read_only=True) as reader:
        reader.restore({"model": model, "optim": optim, "step": 0})
    elapsed, disk = time.perf_counter() - began, _read_bytes() - disk
    every = _gather((elapsed, reads.take(), disk))
    return {
        "time": max(e[0] for e in every), "read": [e[1] for e in every], "disk": sum(e[2] for e in every),
        "fingerprint": fingerprint(model, optim),
    }  # fmt: skip


def rank_main(config: str) -> None:
    """One rank of a launch: save the state once, or restore it twice (cold, then warm)."""
    import torch
    import torch.distributed as dist

    import crashsafe as cs
    from bench.distributed.model import build, fingerprint
    from bench.distributed.rank import _join, _leave

    cfg = json.loads(Path(config).read_text())
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    store = _join()
    if cfg["phase"] == "save":
        model, optim = build("fsdp", cfg["total"], dist.get_world_size(), trained=True)
        with cs.CheckpointManager(cfg["dir"]) as mgr:
            mgr.save(1, {"model": model, "optim": optim, "step": 1})
        result: dict[str, Any] = {"fingerprint": fingerprint(model, optim)}
    else:
        reads = count_reads()
        rounds = range(cfg["repeat"])
        result = {run: [_restore(cfg, run == "cold", reads) for _ in rounds] for run in ("cold", "warm")}
    if dist.get_rank() == 0:
        Path(cfg["out"]).write_text(json.dumps(result))
    _leave(store)


def main(argv: list[str]) -> None:
    from bench.distributed import ROOT, WORK, launch
    from bench.distributed.model import WIDTH, layers_for

    parser = argparse.ArgumentParser(prog="python -m bench.distributed.grow")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256], help="total state sizes in MiB")
    parser.add_argument("--save-world", type=int, default=2, help="ranks that save")
    parser.add_argument("--world", type=int, default=4, help="ranks that restore")
    parser.add_argument("--src", type=Path, default=ROOT / "src", help="the crashsafe to run (its src dir)")
    parser.add_argument("--repeat", type=int, default=3, help="restores from the disk, and from the cache")
    args = parser.parse_args(argv)
    scratch = WORK.parent / "grow"
    WORK.mkdir(parents=True, exist_ok=True)
    print(f"crashsafe from {args.src.resolve()}; saved by {args.save_world} ranks, restored by {args.world}")
    print("| state | restore from disk | from page cache | read per rank (MiB) | all ranks from disk (MiB) |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        where = str(scratch / f"fsdp-{size}")
        cfg = {"kind": "fsdp", "total": size * MiB, "dir": where, "repeat": args.repeat}
        shutil.rmtree(cfg["dir"], ignore_errors=True)
        module = "bench.distributed.grow"
        saved = launch(args.save_world, {**cfg, "phase": "save"}, f"grow-{size}-save", module, args.src)
        got = launch(args.world, {**cfg, "phase": "restore"}, f"grow-{size}-restore", module, args.src)
        for run in ("cold", "warm"):
            for found in (r["fingerprint"] for r in got[run]):
                want = saved["fingerprint"]
                if abs(found - want) > 1e-9 * max(1.0, abs(want)):
                    raise SystemExit(f"{size} MiB, {run} restore: state sum {found} != saved {want}")
        cold, warm = (min(got[run], key=lambda r: r["time"]) for run in ("cold", "warm"))
        read = [n / MiB for n in cold["read"]]
        state = layers_for(size * MiB) * 3 * 4 * (WIDTH * WIDTH + WIDTH) / MiB  # what it holds
        print(
            f"| {state:.0f} MiB, {state / args.world:.0f} per rank | {cold['time'] * 1e3:.0f} ms | "
            f"{warm['time'] * 1e3:.0f} ms | {min(read):.1f}-{max(read):.1f} | {cold['disk'] / MiB:.1f} |",
            flush=True,
        )
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        rank_main(sys.argv[1])
    else:
        main(sys.argv[1:])
