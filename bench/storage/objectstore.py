"""Part 1: save and restore of one state to a real S3 API on 127.0.0.1, side by side: crashsafe vs
the raw s3fs ceiling (``fs.pipe``/``fs.cat`` of the same bytes) vs DCP's fsspec writer/reader."""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xxhash

import crashsafe as cs
from bench.core import flat_tensors, make_like, make_state, state_bytes
from bench.storage.common import MiB, Row, interleaved, same_model
from bench.storage.server import BUCKET, s3, wipe

# the raw ceiling: the state's bytes cut into objects of this many MiB, this many requests at once
RAW_WAYS = {"16 MiB objects, 8 at once": (16, 8), "64 MiB objects, all at once": (64, 64)}
VERIFIED_WAY = "16 MiB objects, 8 at once"
VERIFIED = f"s3fs cat + xxh3 + copy into warm memory, {VERIFIED_WAY}"
DCP_THREADS = 4  # FsspecWriter(thread_count=...): 4 files at once (faster here than the default 1)


def bench_crashsafe(state: dict[str, Any], fs: Any, options: dict[str, Any], tag: str) -> Row:
    """save: the manager is open (as the raw client is); restore: a new read-only manager, its
    opening (a new S3 client) timed apart, as the raw client is made before its timing too."""
    url = f"s3://{BUCKET}/cs-{tag}"
    mgr = cs.CheckpointManager(url, storage_options=options, async_save=False, keep_last=None)
    gc.collect()
    t0 = time.perf_counter()
    mgr.save(1, state)  # sync: returns once the step is committed (manifest written last)
    save = time.perf_counter() - t0
    mgr.close()
    target = make_like(state)
    gc.collect()
    t0 = time.perf_counter()
    reader = cs.CheckpointManager(url, storage_options=options, read_only=True)
    reader.steps()  # makes its S3 client (botocore loads its service model), as the raw one is made
    opened = time.perf_counter() - t0
    t0 = time.perf_counter()
    reader.restore(target)  # list, read the manifest, fetch and checksum every payload, load
    restore = time.perf_counter() - t0
    reader.close()
    same_model(state, target)
    wipe(fs, f"cs-{tag}")
    return {"save": save, "restore": restore, "open": opened}


def bench_raw(blob: bytes, fs: Any, way: str, tag: str) -> Row:
    mib, at_once = RAW_WAYS[way]
    size = mib * MiB
    objects = {
        f"{BUCKET}/raw-{tag}/{i:05d}": blob[start : start + size]
        for i, start in enumerate(range(0, len(blob), size))
    }
    gc.collect()
    t0 = time.perf_counter()
    fs.pipe(objects, batch_size=at_once)
    save = time.perf_counter() - t0
    fs.invalidate_cache()
    t0 = time.perf_counter()
    got = fs.cat(list(objects), batch_size=at_once)
    restore = time.perf_counter() - t0
    assert sum(len(v) for v in got.values()) == len(blob)
    del got, objects
    wipe(fs, f"raw-{tag}")
    return {"save": save, "restore": restore}


def bench_raw_verified(blob: bytes, fs: Any, tag: str) -> Row:
    """The ceiling of a verified restore: the fastest raw way, plus the work any restore into an
    existing model must do on top of the transfer, an xxh3 of each object and a copy into warm
    memory (no loading, no manifest)."""
    mib, at_once = RAW_WAYS[VERIFIED_WAY]
    size = mib * MiB
    keys = [f"{BUCKET}/rawv-{tag}/{i:05d}" for i in range(0, len(blob), size)]
    fs.pipe({key: blob[i * size : (i + 1) * size] for i, key in enumerate(keys)}, batch_size=at_once)
    into = np.ones(len(blob), dtype=np.uint8)  # pre-faulted, as a model's parameters are
    fs.invalidate_cache()
    gc.collect()
    t0 = time.perf_counter()
    got = fs.cat(keys, batch_size=at_once)
    digests = set()
    for i, key in enumerate(keys):
        digests.add(xxhash.xxh3_64_hexdigest(got[key]))
        into[i * size : i * size + len(got[key])] = np.frombuffer(got[key], dtype=np.uint8)
    restore = time.perf_counter() - t0
    assert digests and into.tobytes() == blob
    wipe(fs, f"rawv-{tag}")
    return {"restore": restore}


def bench_dcp(state: dict[str, Any], fs: Any, options: dict[str, Any], tag: str) -> Row:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    url = f"s3://{BUCKET}/dcp-{tag}"
    model_sd, optim_sd = get_state_dict(state["model"], state["optim"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single process, as intended
        gc.collect()
        t0 = time.perf_counter()
        writer = FsspecWriter(url, thread_count=DCP_THREADS, **options)
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)
        save = time.perf_counter() - t0
        target = make_like(state)
        gc.collect()
        t0 = time.perf_counter()
        t_model, t_optim = get_state_dict(target["model"], target["optim"])
        payload = {"model": t_model, "optim": t_optim}
        dcp.load(payload, storage_reader=FsspecReader(url, **options))
        set_state_dict(
            target["model"],
            target["optim"],
            model_state_dict=payload["model"],
            optim_state_dict=payload["optim"],
        )
        restore = time.perf_counter() - t0
    same_model(state, target)
    wipe(fs, f"dcp-{tag}")
    return {"save": save, "restore": restore}


def run(options: dict[str, Any], size: int, repeat: int) -> tuple[int, dict[str, Row]]:
    """Every method once per repeat, rotated; the best of each."""
    fs = s3(options)
    state = make_state(size)
    nbytes = state_bytes(state)
    blob = b"".join(
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in flat_tensors(state).values()
    )
    raw: dict[str, Callable[[str], Row]] = {
        f"s3fs pipe/cat, {way}": (lambda tag, w=way: bench_raw(blob, fs, w, tag)) for way in RAW_WAYS
    }
    methods: dict[str, Callable[[str], Row]] = {
        "crashsafe": lambda tag: bench_crashsafe(state, fs, options, tag),
        **raw,
        VERIFIED: lambda tag: bench_raw_verified(blob, fs, tag),
        f"DCP FsspecWriter/Reader ({DCP_THREADS} threads)": lambda tag: bench_dcp(state, fs, options, tag),
    }
    print(f"-- object store: state {nbytes / MiB:.0f} MiB", flush=True)
    return nbytes, interleaved(methods, repeat)
