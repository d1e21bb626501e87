"""One rank of the memory tier benchmark's main launch: training steps without checkpoints, with a
memory save every step and with a persistent save every N steps, side by side; then restores of
one step from every source into a fresh model and optimizer.

Run by bench/memory_tier (one process per rank, gloo on 127.0.0.1) as ``python -m
bench.memory_tier.rank CONFIG.json``; rank 0 writes what every rank measured to the config's
``out`` (JSON).
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import crashsafe as cs
import crashsafe.storage.objectstore  # its file class, counted by count_reads
from bench.distributed import phases
from bench.distributed.group import gather, join, leave
from bench.distributed.grow import _evict
from bench.distributed.model import build
from bench.memory_tier.training import host_of, local_tensors, same, train_step
from bench.readcount import Reads, count_reads
from crashsafe.distributed.saving import CHUNK_BYTES as CHUNK
from crashsafe.format.chunks import hash_chunks
from crashsafe.storage.layout import step_name

CONFIGS = ["none", "memory", "persistent"]
SOURCES = ["memory", "peer", "disk", "disk, cold", "s3"]
STEP = 7  # the step the recovery part saves and restores

# where the memory saves' time goes, timed inside crashsafe (bench/distributed/phases.py)
PHASES: dict[tuple[str, str, str], str] = {
    ("crashsafe.manager", "CheckpointManager", "_wait_pending"): "waiting for the save in flight (the save "
    "call's, and the block's last wait)",
    ("crashsafe.manager", "", "take_snapshot"): "snapshot: copy into staging (in the save call)",
    ("crashsafe.memory_tier", "MemoryParts", "save"): "memory step, in the background (all of it)",
    ("crashsafe.memory_tier", "", "save_step"): "  own part: write + checksum + commit in /dev/shm",
    ("crashsafe.memory_tier", "MemoryParts", "replicate"): "  copies to and from the peers (gloo)",
    ("crashsafe.distributed.peers", "", "_in_memory"): "    the own part's messages, from its staged bytes",
    ("crashsafe.distributed.peers", "", "_take"): "    receive the peer's part (gloo; waits for the peer)",
    ("crashsafe.distributed.peers", "", "check_bytes"): "    checksum the bytes received",
    ("crashsafe.distributed.peers", "", "write_copy"): "    write + commit the copy in /dev/shm",
    (
        "crashsafe.distributed.group",
        "Coordinator",
        "all_gather",
    ): "    all_gathers (outcomes; a persistent save's too)",
    ("crashsafe.memory_tier", "MemoryParts", "retain"): "  retention (delete older steps)",
    ("crashsafe.manager", "", "save_step"): "persistent step (every Nth save), in the background",
}

ORDER = list(PHASES.values())


def _cpu() -> float:
    """CPU seconds this process (every thread: training, background save, gloo) used so far."""
    times = os.times()
    return times.user + times.system


def _floor(model: torch.nn.Module, optim: torch.optim.Optimizer, reps: int) -> list[float]:
    """The least a snapshot does: copy this rank's state into buffers allocated beforehand, all
    ranks at once, ``reps`` times."""
    tensors = local_tensors(model, optim)
    buffers = [torch.empty_like(t) for t in tensors]
    for b, t in zip(buffers, tensors, strict=True):
        b.copy_(t)  # touched once: kept buffers are
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for b, t in zip(buffers, tensors, strict=True):
            b.copy_(t)
        out.append(time.perf_counter() - t0)
    return out


def _two_copy_floor(
    model: torch.nn.Module, optim: torch.optim.Optimizer, reps: int, shm: Path
) -> tuple[list[float], float]:
    """The least a memory tier with a second copy does, all ranks at once, ``reps`` times, with the
    cheapest parts there are and none of crashsafe's: copy the rank's state straight into a file on
    the RAM disk whose pages exist already (the snapshot, no allocation, no staging buffer besides);
    checksum it (the format's chunked xxh3); send it from there to the rank's peer on the other host
    (gloo, the default group) while receiving the peer's part straight into a second such file;
    checksum what arrived. No commit protocol, no retention, no second group. Returns the wall time
    of each rep and the CPU seconds this process spent in all of them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = (rank + max(1, world // 2)) % world  # (host a's rank i pairs with host b's rank i)
    tensors = local_tensors(model, optim)
    sizes = gather(sum(t.numel() * t.element_size() for t in tensors))
    shm.mkdir(parents=True, exist_ok=True)
    files = []
    for name, size in (("own", sizes[rank]), ("copy", sizes[peer])):
        with open(shm / f"{name}-{rank}", "w+b") as f:
            f.truncate(size)
            files.append(mmap.mmap(f.fileno(), size))
    own, copy = (torch.frombuffer(m, dtype=torch.uint8) for m in files)
    own.fill_(1), copy.fill_(1)  # the pages exist from now on
    walls, cpu = [], 0.0
    for _ in range(reps):
        dist.barrier()
        c0, t0 = _cpu(), time.perf_counter()
        at = 0
        for t in tensors:
            flat = t.detach().reshape(-1).view(torch.uint8)
            own[at : at + flat.numel()].copy_(flat)
            at += flat.numel()
        hash_chunks(own.numpy(), CHUNK)
        pending = [dist.isend(own, peer), dist.irecv(copy, peer)]
        for request in pending:
            request.wait()
        hash_chunks(copy.numpy(), CHUNK)
        walls.append(time.perf_counter() - t0)
        cpu += _cpu() - c0
    del own, copy
    for m in files:
        m.close()
    shutil.rmtree(shm, ignore_errors=True)
    return walls, cpu


def run_steps(cfg: dict[str, Any], model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Blocks of training steps of each configuration, round after round (each round starts with
    the next one): no checkpoint (``block`` steps); a memory save every step (``memory_block``
    steps; every ``persist_every``th save would also be persistent); ``block`` steps with one
    plain persistent save in their middle (what a save every ``persist_every`` steps costs, once
    per that many steps). Each block ends with ``wait()``, timed in the block, so no save's work
    spills into another configuration's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    host, every = host_of(rank, world), cfg["persist_every"]
    tier = cs.MemoryTier(Path(cfg["shm"]) / "train" / host, persist_every=every, copies=2, keep_last=2,
                         host=host)  # fmt: skip
    work = Path(cfg["work"])
    mgrs = {
        "memory": cs.CheckpointManager(work / "train-memory", keep_last=2, memory=tier),
        "persistent": cs.CheckpointManager(work / "train-persistent", keep_last=2),
    }
    sizes = {"none": cfg["block"], "memory": cfg["memory_block"], "persistent": cfg["block"]}
    state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}
    seed = 0
    for _ in range(2):  # warm-up steps: first allocations of the training loop
        seed += 1
        train_step(model, optim, 1000 * seed + rank, cfg["batch"])
    first = {}
    for name, each in mgrs.items():  # a first save each (staging buffers, memory directories), untimed
        dist.barrier()
        t0 = time.perf_counter()
        each.save(0, state)
        first[name] = time.perf_counter() - t0
        each.wait()
    out: dict[str, Any] = {c: {"step": [], "stall": [], "block": [], "wait": [], "cpu": []} for c in CONFIGS}
    out["first_stall"] = {k: max(g[k] for g in gather(first)) for k in first}
    out["floor"], out["phases"], out["sizes"] = [], [], sizes
    out["two_copy_floor"], out["two_copy_cpu"] = [], []
    saves = dict.fromkeys(CONFIGS, 0)
    for r in range(cfg["rounds"]):
        for config in CONFIGS[r % 3 :] + CONFIGS[: r % 3]:
            mgr = mgrs.get(config)
            steps, stalls = [], []
            gc.collect()
            dist.barrier()
            phases.take()
            cpu, began = _cpu(), time.perf_counter()
            for i in range(sizes[config]):
                seed += 1
                t0 = time.perf_counter()
                train_step(model, optim, 1000 * seed + rank, cfg["batch"])
                t1 = time.perf_counter()
                if mgr is not None and (config == "memory" or i == sizes[config] // 2):
                    saves[config] += 1
                    state["step"] = saves[config]
                    mgr.save(saves[config], state)
                    stalls.append(time.perf_counter() - t1)
                steps.append(time.perf_counter() - t0)
            t_wait = time.perf_counter()
            if mgr is not None:
                mgr.wait()
            end = time.perf_counter()
            took = phases.take()
            mine = (
                steps,
                stalls,
                end - began,
                end - t_wait,
                _cpu() - cpu,
                {k: took.get(k, 0.0) for k in ORDER},
            )
            every_rank = gather(mine)
            done = out[config]
            done["step"].append([max(s) for s in zip(*(e[0] for e in every_rank), strict=True)])
            done["stall"].append([max(s) for s in zip(*(e[1] for e in every_rank), strict=True)])
            done["block"].append(max(e[2] for e in every_rank))
            done["wait"].append(max(e[3] for e in every_rank))
            done["cpu"].append(sum(e[4] for e in every_rank))
            if config == "memory":
                out["phases"].append([e[5] for e in every_rank])
            print(f"rank {rank}: round {r} {config}: {end - began:.2f} s", flush=True)
        floors = gather(_floor(model, optim, cfg["floor_reps"]))
        out["floor"] += [max(f) for f in zip(*floors, strict=True)]
        walls, cpu = _two_copy_floor(model, optim, cfg["floor_reps"], Path(cfg["shm"]) / "floor")
        every_rank = gather((walls, cpu))
        out["two_copy_floor"].append([max(w) for w in zip(*(e[0] for e in every_rank), strict=True)])
        out["two_copy_cpu"].append(sum(e[1] for e in every_rank) / cfg["floor_reps"])
    out["part_bytes"] = gather(sum(t.numel() * t.element_size() for t in local_tensors(model, optim)))
    for each in mgrs.values():
        each.close()
    return out


def _recover(
    cfg: dict[str, Any], source: str, memory: Path, persistent: str, reads: Reads
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One restart's restore of the newest step into a fresh model and optimizer, with a memory
    tier in ``memory`` and the persistent tier ``persistent``: times (opening the manager included),
    where it came from, the bytes read from each tier; and the restored tensors."""
    world, rank = dist.get_world_size(), dist.get_rank()
    host = host_of(rank, world)
    model, optim = build(cfg["kind"], cfg["total"], world, trained=False)
    state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}
    options = cfg["s3_options"] if persistent.startswith("s3://") else None
    gc.collect()
    dist.barrier()
    reads.take()
    t0 = time.perf_counter()
    tier = cs.MemoryTier(memory / host, persist_every=1, host=host)
    with cs.CheckpointManager(persistent, storage_options=options, keep_last=2, memory=tier) as mgr:
        opened = time.perf_counter() - t0
        mgr.restore(state)
        took = time.perf_counter() - t0
        found = mgr.recovery
    from_memory, from_persistent = reads.take_split(str(memory))
    assert found is not None
    got = {
        "open": opened, "time": took, "source": found.source, "seconds": found.seconds, "step": state["step"],
        "memory_bytes": from_memory, "persistent_bytes": from_persistent,
    }  # fmt: skip
    return got, local_tensors(model, optim)


def _read_floor(files: list[Path], nbytes: int) -> float:
    """Seconds to read the first ``nbytes`` of ``files`` (in order) into a kept buffer and checksum
    them (the format's chunked xxh3): the least a restore of that many bytes from there does."""
    buf = np.empty(min(nbytes, CHUNK), dtype=np.uint8)
    t0, left = time.perf_counter(), nbytes
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            at = 0
            while left > 0:
                got = os.preadv(fd, [buf[: min(left, CHUNK)]], at)
                if got == 0:
                    break
                hash_chunks(buf[:got], CHUNK)
                at, left = at + got, left - got
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def read_floors(root: Path, disk: Path, reps: int) -> dict[str, float]:
    """The least a restore of this rank's part does from each source, all ranks at once: read its
    bytes and checksum them, from its memory step on the RAM disk and from the persistent step's
    files with the page cache holding them (read once first); best of ``reps``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    own = root / host_of(rank, world) / f"rank_{rank}" / step_name(STEP) / "data.bin"
    nbytes = own.stat().st_size
    stored = sorted((disk / step_name(STEP)).glob("data*.bin"))
    files = stored[rank % len(stored) :] + stored[: rank % len(stored)]  # (a rank's share first)
    _read_floor(files, nbytes)
    best = {"memory": float("inf"), "disk": float("inf")}
    for _ in range(reps):
        for source, where in (("memory", [own]), ("disk", files)):
            dist.barrier()
            best[source] = min(best[source], _read_floor(where, nbytes))
    return best


def run_recovery(cfg: dict[str, Any], model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Save step STEP once to the memory tier (own copies and peers'), the local disk and S3; then,
    round after round, restore it from each source as a restarted job would, and check each
    restore bit for bit against the state saved."""
    world, rank = dist.get_world_size(), dist.get_rank()
    host = host_of(rank, world)
    root, empty = Path(cfg["shm"]) / "rec", Path(cfg["shm"]) / "empty"
    disk = str(Path(cfg["work"]) / "rec-disk")
    state: dict[str, Any] = {"model": model, "optim": optim, "step": STEP}
    tier = cs.MemoryTier(root / host, persist_every=1, host=host)
    with cs.CheckpointManager(disk, keep_last=2, memory=tier) as mgr:  # memory + disk at once
        mgr.save(STEP, state)
    if cfg["s3"]:
        with cs.CheckpointManager(cfg["s3"], storage_options=cfg["s3_options"], keep_last=2) as mgr:
            mgr.save(STEP, state)
    saved = local_tensors(model, optim)
    reads = count_reads()
    sources = [s for s in SOURCES if s != "s3" or cfg["s3"]]
    out: dict[str, Any] = {s: [] for s in sources}
    for r in range(cfg["recover_rounds"]):
        for source in sources[r % len(sources) :] + sources[: r % len(sources)]:
            memory, persistent = root, disk
            if source == "peer" and rank == world - 1:  # host b loses its memory: its ranks pull
                shutil.rmtree(root / "b")
            if source in ("disk", "disk, cold", "s3"):  # a memory tier that holds nothing
                memory = empty / f"{r}-{source.replace(', ', '-')}"
            if source == "disk, cold" and rank == 0:
                _evict(Path(disk))  # the step's files dropped from the page cache
            if source == "s3":
                persistent = cfg["s3"]
            dist.barrier()
            got, restored = _recover(cfg, source, memory, persistent, reads)
            got["bit_identical"] = same(restored, saved) and got["step"] == STEP
            del restored
            out[source].append(gather(got))
            if memory != root and rank == 0:
                shutil.rmtree(memory, ignore_errors=True)
            print(f"rank {rank}: restored from {source} ({got['source']}) in {got['time']:.3f} s", flush=True)
    return out


def main(config: str) -> None:
    cfg = json.loads(Path(config).read_text())
    warnings.simplefilter("ignore")  # FSDP's advice
    torch.set_num_threads(1)
    store = join()
    phases.install(PHASES)
    model, optim = build(cfg["kind"], cfg["total"], dist.get_world_size(), trained=True)
    result = {"steps": run_steps(cfg, model, optim), "recovery": run_recovery(cfg, model, optim)}
    result["read_floor"] = gather(read_floors(Path(cfg["shm"]) / "rec", Path(cfg["work"]) / "rec-disk", 3))
    if dist.get_rank() == 0:
        Path(cfg["out"]).write_text(json.dumps(result))
    leave(store)


if __name__ == "__main__":
    main(sys.argv[1])
