"""The checkpoints a restore run reads, and each way of reading one back into the live model.

Every method ends with the same live state: the saved values in the live model's parameters (so
each is timed from files to live memory). The limit reads crashsafe's own data file with preadv
straight into the parameters, at the offsets its manifest gives: no checksum, no decoding, no
Python per byte; nothing that reads these bytes into these tensors can be faster on one thread.
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

import crashsafe as cs

HERE = Path(__file__).parent.parent
WORK = HERE / ".work" / "restore"
RESULTS = HERE / "results"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TENSORS = 8  # "a few tensors": the state is a model of 8 equal fp32 parameters

Row = dict[str, float]


def make_model(total: int, seed: int) -> torch.nn.Module:
    """A model of TENSORS fp32 parameters holding ``total`` bytes of normal values (like weights)."""
    gen = torch.Generator().manual_seed(seed)
    each = total // TENSORS // 4
    params = {
        f"w{i}": torch.nn.Parameter(torch.randn(each // 1024, 1024, generator=gen)) for i in range(TENSORS)
    }
    return torch.nn.ParameterDict(params)


def live_arrays(model: torch.nn.Module) -> list[np.ndarray[Any, Any]]:
    """The live parameters' memory as writable uint8 arrays (what the limit reads into)."""
    return [p.detach().reshape(-1).view(torch.uint8).numpy() for p in model.parameters()]


class Files:
    """The same state saved in every format, and the files each method reads (to drop from cache)."""

    def __init__(self, model: torch.nn.Module) -> None:
        shutil.rmtree(WORK, ignore_errors=True)
        WORK.mkdir(parents=True)
        self.raw = WORK / "crashsafe-raw"
        self.zstd = WORK / "crashsafe-zstd"
        self.pt = WORK / "state.pt"
        self.st = WORK / "state.safetensors"
        self.dcp = WORK / "dcp"
        state = {"model": model}
        for directory, codec in ((self.raw, "raw"), (self.zstd, "zstd")):
            with cs.CheckpointManager(directory, codec=codec, async_save=False) as mgr:
                mgr.save(1, state)  # an older step to fall back to, as a job that saves regularly has
                mgr.save(2, state)
        sd = model.state_dict()
        torch.save(sd, self.pt)
        from safetensors.torch import save_file

        save_file(dict(sd), str(self.st))
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": sd}, checkpoint_id=str(self.dcp))
        os.sync()
        self.layout = _layout(self.raw)
        self.zstd_frames = _zstd_frames(self.zstd)
        self.scratch = [np.ones(p.numel() * 4, dtype=np.uint8) for p in model.parameters()]  # pre-faulted

    def of(self, method: str) -> list[Path]:
        """The files ``method`` reads."""
        base = {"torch": [self.pt], "safetensors": [self.st], "dcp": [self.dcp], "zstd": [self.zstd]}
        for key, paths in base.items():
            if key in method:
                return _files([_step_dir(p) if p.name.startswith("crashsafe") else p for p in paths])
        return _files([_step_dir(self.raw)])


def _files(paths: list[Path]) -> list[Path]:
    out = []
    for path in paths:
        out += [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    return out


def _step_dir(directory: Path) -> Path:
    return max(p for p in directory.iterdir() if p.name.startswith("step_"))


def _layout(directory: Path) -> list[tuple[Path, int, int]]:
    """(data file, offset, nbytes) of every payload of the newest step, in manifest order."""
    step = _step_dir(directory)
    manifest = json.loads((step / "manifest.json").read_text())
    return [(step / p["file"], p["offset"], p["nbytes"]) for p in manifest["payloads"]]


def _zstd_frames(directory: Path) -> list[bytes]:
    """The stored zstd frames of the zstd checkpoint (for the decompression ceiling)."""
    frames = []
    for path, offset, nbytes in _layout(directory):
        with open(path, "rb") as f:
            f.seek(offset)
            frames.append(f.read(nbytes))
    return frames


def drop_cache(paths: list[Path]) -> None:
    """Evict these files' pages from the page cache (they are clean: written and synced)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(16 * MiB):
                pass


# ----------------------------------------------------------------------------- methods


def crashsafe_restore(
    files: Files, model: torch.nn.Module, codec: str = "raw", step: int | None = None
) -> None:
    """``restore()``: the newest of the two steps, read straight into the live model (the older one
    is there to fall back to). With ``step=2`` named, there is none: the step is verified first."""
    directory = files.raw if codec == "raw" else files.zstd
    with cs.CheckpointManager(directory, read_only=True) as mgr:
        assert mgr.restore({"model": model}, step=step) == 2


def mmap_floor(files: Files, model: torch.nn.Module, verify: bool = False) -> None:
    """The stored bytes copied out of the mapped data file into the live parameters, 2 MiB at a time,
    one payload per core at a time, no checksum: the fastest way to get them there found here. With
    ``verify``, each chunk's xxh3 folded in after it lands: the ceiling of a verified restore."""
    arrays = live_arrays(model)
    regions = {}
    for path in {p for p, _, _ in files.layout}:
        with open(path, "rb") as f:
            regions[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def one(i: int) -> None:
        path, offset, nbytes = files.layout[i]
        src = np.frombuffer(regions[path], dtype=np.uint8, count=nbytes, offset=offset)
        digest = xxhash.xxh3_64()
        for start in range(0, nbytes, 2 * MiB):
            chunk = arrays[i][start : start + 2 * MiB]
            np.copyto(chunk, src[start : start + 2 * MiB])
            if verify:
                digest.update(chunk.data)
        del src

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(one, range(len(arrays))))


def limit(files: Files, model: torch.nn.Module, threads: int = 1) -> None:
    """preadv of the stored bytes straight into the live parameters (``threads`` at once)."""
    arrays = live_arrays(model)
    fds = {path: os.open(path, os.O_RDONLY) for path in {p for p, _, _ in files.layout}}

    def read(i: int) -> None:
        path, offset, nbytes = files.layout[i]
        view = memoryview(arrays[i])
        assert len(view) == nbytes
        pos = 0
        while pos < nbytes:
            pos += os.preadv(fds[path], [view[pos:]], offset + pos)

    try:
        if threads == 1:
            for i in range(len(arrays)):
                read(i)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(read, range(len(arrays))))
    finally:
        for fd in fds.values():
            os.close(fd)


def torch_load(files: Files, model: torch.nn.Module, mmap: bool) -> None:
    model.load_state_dict(torch.load(files.pt, mmap=mmap, weights_only=True))


def safetensors_load(files: Files, model: torch.nn.Module) -> None:
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(files.st)))


def dcp_load(files: Files, model: torch.nn.Module) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": model.state_dict()}, checkpoint_id=str(files.dcp))  # in place


def zstd_ceiling(files: Files, model: torch.nn.Module) -> None:
    """Decompressing the stored zstd frames (already in memory) into pre-faulted buffers, one frame
    per core at a time: what any restore of these frames must spend here, reading and unshuffling
    aside. (Its output is shuffled bytes, so it leaves the model alone.)"""

    def one(i: int) -> None:
        out = files.scratch[i]
        with zstandard.ZstdDecompressor().stream_reader(files.zstd_frames[i]) as reader:
            view, got = memoryview(out), 0
            while got < len(view):
                got += reader.readinto(view[got:])

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(one, range(len(files.zstd_frames))))


def zstd_decode(files: Files, model: torch.nn.Module) -> None:
    """The zstd codec's own decode (decompress and unshuffle) of the stored frames, already in
    memory, into the live parameters, one frame per core at a time: no reading, no checksum."""
    arrays = live_arrays(model)
    codec = cs.codecs.Zstd()

    def one(i: int) -> None:
        codec.decode_into(files.zstd_frames[i], arrays[i].view(np.float32))

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(one, range(len(arrays))))


METHODS: dict[str, Callable[[Files, torch.nn.Module], None]] = {
    "limit: preadv into live (1 thread)": limit,
    "limit: preadv into live (2 threads)": lambda f, m: limit(f, m, threads=2),
    "floor: mmap + memcpy into live (2 threads)": mmap_floor,
    "ceiling: mmap + memcpy + xxh3 into live (2 threads)": lambda f, m: mmap_floor(f, m, verify=True),
    "crashsafe restore": crashsafe_restore,
    "crashsafe restore(step=2): verified, then read": lambda f, m: crashsafe_restore(f, m, step=2),
    "torch.load(mmap=True) + copy": lambda f, m: torch_load(f, m, mmap=True),
    "torch.load + copy": lambda f, m: torch_load(f, m, mmap=False),
    "dcp.load (in place)": dcp_load,
    "safetensors load_file + copy": safetensors_load,
    "crashsafe restore, zstd": lambda f, m: crashsafe_restore(f, m, "zstd"),
    "zstd decompression only (ceiling)": zstd_ceiling,
    "zstd decode only (decompress + unshuffle)": zstd_decode,
}


def spoil(model: torch.nn.Module) -> None:
    """Overwrite the first and last KiB of every parameter, so a method that does nothing fails."""
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            flat[:256] = -1.0
            flat[-256:] = -1.0


def check(model: torch.nn.Module, reference: torch.nn.Module, method: str) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        flat, ref = p.detach().view(-1), q.detach().view(-1)
        if not (torch.equal(flat[:256], ref[:256]) and torch.equal(flat[-256:], ref[-256:])):
            raise AssertionError(f"{method} did not restore {name}")


@contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def timed(method: str, files: Files, model: torch.nn.Module, cold: bool) -> float:
    """Seconds ``method`` takes from files to live parameters (page cache warm or dropped first)."""
    spoil(model)
    paths = files.of(method)
    if cold:
        drop_cache(paths)
    else:
        warm_cache(paths)
    gc.collect()
    with quiet():
        begin = time.perf_counter()
        METHODS[method](files, model)
        elapsed = time.perf_counter() - begin
    return elapsed


def interleaved(files: Files, model: torch.nn.Module, reference: torch.nn.Module, repeat: int, cold: bool,
                names: list[str]) -> dict[str, float]:  # fmt: skip
    """Best seconds of each method; each repeat runs every method once, in a rotated order."""
    best: dict[str, float] = {}
    for r in range(repeat):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            seconds = timed(name, files, model, cold)
            if "ceiling" not in name:
                check(model, reference, name)
            best[name] = min(seconds, best.get(name, seconds))
            print(f"   {'cold' if cold else 'warm'} {name:40s} {seconds * 1e3:9.1f} ms", flush=True)
    return best


def background_load() -> float:
    """The 1-minute load average (other jobs share this machine)."""
    return os.getloadavg()[0]
