"""One rank of a distributed benchmark launch: save with every method, then restore checkpoints.

Run by bench/distributed (one process per rank, gloo on 127.0.0.1) as ``python -m
bench.distributed.rank CONFIG.json``. The methods' saves are interleaved (round after round), so a
noisy machine slows them alike; every figure is measured on each rank between barriers and
gathered on rank 0, which writes them to the config's ``out`` (JSON).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import shutil
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import crashsafe as cs
from bench.core import fsync_path
from bench.distributed import phases
from bench.distributed.group import gather as _gather
from bench.distributed.group import join as _join
from bench.distributed.group import leave as _leave
from bench.distributed.model import build, fingerprint, nudge

_BEGAN = time.perf_counter()


def _log(text: str) -> None:
    print(f"[{time.perf_counter() - _BEGAN:6.1f} s] rank {dist.get_rank()}: {text}", flush=True)


def _status(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert match is not None
    return int(match.group(1)) * 1024


_LIBC = ctypes.CDLL("libc.so.6")


class PeakMemory:
    """Peak extra memory of a block: anonymous memory (RssAnon, sampled every 2 ms on a thread),
    the measure that counts, and the kernel's RSS high-water mark (VmHWM, reset at the start),
    which also counts the pages of mapped checkpoint files (page cache, reclaimable). Freed heap
    memory is given back first (malloc_trim), so an earlier method's freed buffers, reused, do
    not hide what this one allocates."""

    def __enter__(self) -> PeakMemory:
        gc.collect()
        _LIBC.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        self.start, self.anon_start = _status("VmRSS"), _status("RssAnon")
        self.anon_peak, self.extra, self.anon = self.anon_start, 0, 0
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.002):
            self.anon_peak = max(self.anon_peak, _status("RssAnon"))

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._sampler.join()
        self.anon_peak = max(self.anon_peak, _status("RssAnon"))
        self.extra = _status("VmHWM") - self.start
        self.anon = self.anon_peak - self.anon_start


def dcp_payload(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP saves: the state dicts as DCP's own helpers give them (sharded for FSDP2)."""
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def share(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[memoryview]:
    """This rank's share of the state's bytes, as a deduplicating writer would write them: its
    local shards (FSDP2), or 1/world of the replicated state (DDP)."""
    tensors = list(model.state_dict().values())
    tensors += [t for slots in optim.state_dict()["state"].values() for t in slots.values()]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    views = [memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()) for t in local]
    if any(t is not u for t, u in zip(tensors, local, strict=True)):
        return views
    left = sum(len(v) for v in views) // dist.get_world_size()
    out = []
    for view in views:
        out.append(view[:left])
        left -= len(out[-1])
    return [v for v in out if len(v)]


def write_raw(blobs: list[memoryview], target: Path) -> None:
    """The ceiling of a persist: this rank's share written sequentially to one file, fsynced."""
    target.mkdir(parents=True, exist_ok=True)
    fd = os.open(target / f"rank{dist.get_rank()}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for blob in blobs:
            pos = 0
            while pos < len(blob):
                pos += os.write(fd, blob[pos : pos + (8 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)


def save_once(
    method: str,
    mgrs: dict[str, cs.CheckpointManager],
    stager: DefaultStager,
    state: dict[str, Any],
    target: Path,
) -> tuple[float, float]:
    """One save on this rank: (training stall, time until durably committed)."""
    blobs = share(state["model"], state["optim"]) if method == "raw" else []
    t0 = time.perf_counter()
    if method == "raw":
        write_raw(blobs, target)
        dist.barrier()  # every rank's file is durable before the directory is
        if dist.get_rank() == 0:
            fsync_path(target)
            fsync_path(target.parent)
        t1 = time.perf_counter()
    elif method in mgrs:  # crashsafe async, or sync (no copy: writes from the live tensors)
        mgrs[method].save(state["step"], state)
        t1 = time.perf_counter()
        mgrs[method].wait()  # every rank: committed (rank 0 renamed and fsynced), the outcome heard
    else:
        payload = dcp_payload(state["model"], state["optim"])
        if method in ("dcp_async", "dcp_async_cached"):
            # by default async_save stages into fresh memory each time; one DefaultStager kept
            # across saves reuses its staged storages (FileSystemWriter(cache_staged_state_dict=
            # True) would too, but pins its memory: CUDA only)
            options = {"async_stager": stager} if method == "dcp_async_cached" else {}
            future = dcp_async_save(payload, checkpoint_id=str(target), **options)
            assert isinstance(future, Future)
            t1 = time.perf_counter()
            future.result()
        else:
            dcp_save(payload, checkpoint_id=str(target))
        if dist.get_rank() == 0:  # DCP fsyncs its files and .metadata, not the directory entries
            fsync_path(target)
            fsync_path(target.parent)
        dist.barrier()  # the directory fsync is rank 0's; every rank's figure waits for it
        if method == "dcp":
            t1 = time.perf_counter()
    return t1 - t0, time.perf_counter() - t0


def drop_older(method: str, mgrs: dict[str, cs.CheckpointManager], dirs: dict[str, Path], step: int) -> float:
    """Delete ``step`` of ``method`` (keep the newest only), outside the save's timing for every
    method; crashsafe's crash-safe delete (collective, on rank 0) is timed: what ``keep_last=1``
    would add to its background commit."""
    t0 = time.perf_counter()
    if method in mgrs:
        mgrs[method].delete([step])
    elif dist.get_rank() == 0:
        shutil.rmtree(dirs[method] / f"step_{step}")
    return time.perf_counter() - t0


def run_saves(cfg: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """``cfg["saves"]`` rounds, each saving once with every method; per save the slowest rank's
    stall and durable time (the job waits for its slowest rank), and each rank's peak extra memory
    in the method's first save (which allocates what the method keeps or needs)."""
    methods, dirs = cfg["methods"], {m: Path(d) for m, d in cfg["dirs"].items()}
    out: dict[str, Any] = {m: {"stall": [], "durable": [], "drop": []} for m in methods}
    out["crashsafe"]["phases"] = []
    # no retention in the manager: older steps of every method are deleted between saves, untimed
    mgrs = {
        "crashsafe": cs.CheckpointManager(dirs["crashsafe"], keep_last=None),
        "crashsafe_sync": cs.CheckpointManager(dirs["crashsafe_sync"], keep_last=None, async_save=False),
    }
    stager = DefaultStager(StagingOptions(False, False, False, False))  # async_save's own, kept
    for i in range(1, cfg["saves"] + 1):
        k = (i - 1) % len(methods)
        for method in methods[k:] + methods[:k]:  # each round starts with another method
            nudge(state["model"], state["optim"])
            state["step"] = i
            gc.collect()
            dist.barrier()
            phases.take()
            with PeakMemory() as mem:
                stall, durable = save_once(method, mgrs, stager, state, dirs[method] / f"step_{i}")
            every = _gather((stall, durable, mem.anon, phases.take(), mem.extra))
            if method == "crashsafe":
                out[method]["phases"].append([e[3] for e in every])
            out[method]["stall"].append(max(e[0] for e in every))
            out[method]["durable"].append(max(e[1] for e in every))
            if i == 1:
                out[method]["mem"] = [e[2] for e in every]
                out[method]["mem_rss"] = [e[4] for e in every]
            if i == cfg["saves"] and method != "raw":
                out[method]["fingerprint"] = fingerprint(state["model"], state["optim"])
            if i > 1:
                out[method]["drop"].append(max(_gather(drop_older(method, mgrs, dirs, i - 1))))
            _log(f"save {i} {method}: stall {stall:.3f} durable {durable:.3f} (this rank)")
    for mgr in mgrs.values():
        mgr.close()
    stager.close()
    return out


def restore_once(method: str, directory: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Restore the newest checkpoint in ``directory`` into a fresh model and optimizer (as a
    restarted job does): the slowest rank's time (and of it, opening the manager: its own gloo
    group), each rank's peak extra memory, the fingerprint."""
    model, optim = build(cfg["kind"], cfg["total"], dist.get_world_size(), trained=False)
    gc.collect()
    dist.barrier()
    opened = 0.0
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        if method == "crashsafe":
            with cs.CheckpointManager(directory, read_only=True) as reader:
                opened = time.perf_counter() - t0
                reader.restore({"model": model, "optim": optim, "step": 0})
        else:
            newest = max(directory.glob("step_*"), key=lambda p: int(p.name[5:]))
            payload = dcp_payload(model, optim)
            dcp_load(payload, checkpoint_id=str(newest))
            set_state_dict(model, optim, model_state_dict=payload["model"], optim_state_dict=payload["optim"])
        elapsed = time.perf_counter() - t0
    every = _gather((elapsed, mem.anon, opened, mem.extra))
    found = fingerprint(model, optim)
    return {
        "time": max(e[0] for e in every),
        "mem": [e[1] for e in every],
        "mem_rss": [e[3] for e in every],
        "open": max(e[2] for e in every),
        "fingerprint": found,
    }


def main(config: str) -> None:
    cfg = json.loads(Path(config).read_text())
    warnings.simplefilter("ignore")  # DCP's and FSDP's advice on every call
    torch.set_num_threads(1)
    store = _join()
    phases.install()
    result: dict[str, Any] = {"saves": {}, "restores": {}}
    if cfg["methods"]:
        model, optim = build(cfg["kind"], cfg["total"], dist.get_world_size(), trained=True)
        _log("built")
        result["saves"] = run_saves(cfg, {"model": model, "optim": optim, "step": 0})
        del model, optim
    for _ in range(cfg.get("restore_rounds", 1)):  # round after round, as the saves
        for label, (method, directory) in cfg["restores"].items():
            gc.collect()
            got = restore_once(method, Path(directory), cfg)
            done = result["restores"].setdefault(label, {**got, "times": [], "fingerprints": []})
            done["times"].append(got["time"])
            done["fingerprints"].append(got["fingerprint"])
            done["time"] = min(done["times"])
            _log(f"restored {label} in {got['time']:.3f} s")
    if dist.get_rank() == 0:
        Path(cfg["out"]).write_text(json.dumps(result))
    _leave(store)


if __name__ == "__main__":
    main(sys.argv[1])
