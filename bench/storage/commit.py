"""Part 3: the fixed cost of a durable local commit, 1 KiB to 2 GiB, a tiny GPT-2 + AdamW and a
KMeans-sized state: crashsafe's sync save vs torch.save (and np.savez) + fsync + rename +
directory fsync, with the fsyncs and renames of each counted (strace) and the floor of each
protocol measured with bare syscalls."""

from __future__ import annotations

import gc
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

import crashsafe as cs
from bench.storage.common import HERE, WORK, GiB, KiB, MiB, Row, size_name

# log-spaced, 16x apart, and 2 GiB once
SIZES = [KiB, 16 * KiB, 256 * KiB, 4 * MiB, 64 * MiB, GiB, 2 * GiB]
QUICK_SIZES = SIZES[:5]


class _Block(torch.nn.Module):
    def __init__(self, e: int) -> None:
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(e)
        self.c_attn = torch.nn.Linear(e, 3 * e)
        self.c_proj = torch.nn.Linear(e, e)
        self.ln_2 = torch.nn.LayerNorm(e)
        self.c_fc = torch.nn.Linear(e, 4 * e)
        self.mlp_proj = torch.nn.Linear(4 * e, e)


class TinyGPT2(torch.nn.Module):
    """The tensors of a tiny GPT-2 (GPT-2's vocabulary and positions, 3 blocks of width 3), built
    by hand so the bench needs no transformers; with AdamW: 160 tensors, 1.8 MB."""

    def __init__(self, vocab: int = 50257, positions: int = 1024, width: int = 3, blocks: int = 3) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(positions, width)
        self.h = torch.nn.ModuleList(_Block(width) for _ in range(blocks))
        self.ln_f = torch.nn.LayerNorm(width)


def tiny_gpt2_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT2()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sum((p.float() ** 2).sum() for p in model.parameters()).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return {"model": model, "optim": optim}


def kmeans_state() -> dict[str, Any]:
    """What crashsafe.workloads.kmeans saves per iteration (k=8 centers of digits' 64 features)."""
    rng = np.random.default_rng(0)
    return {"centers": rng.random((8, 64)), "iteration": 7, "shift": 0.25, "inertia": 1234.5, "done": False}


def plain(state: dict[str, Any]) -> dict[str, Any]:
    """The state as torch.save / np.savez take it: modules and optimizers as their state dicts."""
    return {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}


def counts(state: dict[str, Any]) -> tuple[int, int]:
    """(arrays, bytes) of a state."""
    arrays = [t for t in _leaves(plain(state)) if isinstance(t, (torch.Tensor, np.ndarray))]
    return len(arrays), sum(int(t.nbytes) for t in arrays)


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def _fsync_path(path: str | Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save(state: dict[str, Any], path: Path) -> None:
    torch.save(plain(state), path)


def _savez(state: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as f:
        np.savez(f, **{k: np.asarray(v) for k, v in state.items()})


class FileDurable:
    """``write`` into a temporary file, fsync it, rename it into place, fsync the directory
    (``durable=False``: write the file in place, nothing more — not crash-safe, for reference)."""

    def __init__(
        self, directory: Path, write: Callable[[dict[str, Any], Path], None], durable: bool = True
    ) -> None:
        self.directory, self.write, self.durable = directory, write, durable
        directory.mkdir(parents=True, exist_ok=True)
        self._last: Path | None = None
        self._old: Path | None = None

    def save(self, i: int, state: dict[str, Any]) -> float:
        final = self.directory / f"ckpt-{i}.bin"
        if not self.durable:
            t0 = time.perf_counter()
            self.write(state, final)
            took = time.perf_counter() - t0
        else:
            tmp = self.directory / f".tmp-{i}.bin"
            t0 = time.perf_counter()
            self.write(state, tmp)
            _fsync_path(tmp)
            os.rename(tmp, final)
            _fsync_path(self.directory, directory=True)
            took = time.perf_counter() - t0
        self._old, self._last = self._last, final
        return took

    def cleanup(self) -> None:
        """Delete the previous checkpoint (outside the timing, as crashsafe's old steps are)."""
        if self._old is not None:
            self._old.unlink()
            self._old = None

    def close(self) -> None:
        return None


class CrashsafeDurable:
    """crashsafe's sync save: returns once the step is committed and durable."""

    def __init__(self, directory: Path) -> None:
        self.mgr = cs.CheckpointManager(directory, async_save=False, keep_last=None)
        self._last: int | None = None
        self._old: int | None = None

    def save(self, i: int, state: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        self.mgr.save(i, state)
        took = time.perf_counter() - t0
        self._old, self._last = self._last, i
        return took

    def cleanup(self) -> None:
        """Delete the previous step (outside the timing, as the baseline's old files are)."""
        if self._old is not None:
            self.mgr.delete([self._old])
            self._old = None

    def close(self) -> None:
        self.mgr.close()


Method = CrashsafeDurable | FileDurable
TORCH, SAVEZ, SAVEZ_PLAIN = "torch.save", "np.savez", "np.savez (no fsync)"


def methods_for(label: str, base: Path) -> dict[str, Method]:
    out: dict[str, Method] = {
        "crashsafe": CrashsafeDurable(base / "cs"),
        TORCH: FileDurable(base / "torch", _torch_save),
    }
    if label == "KMeans":
        out[SAVEZ] = FileDurable(base / "savez", _savez)
        out[SAVEZ_PLAIN] = FileDurable(base / "savez-plain", _savez, durable=False)
    return out


def cases(quick: bool) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "tiny GPT-2 + AdamW", tiny_gpt2_state()
    yield "KMeans", kmeans_state()
    for size in QUICK_SIZES if quick else SIZES:
        yield size_name(size), {"w": torch.rand(size // 4)}


def plan(nbytes: int, quick: bool, repeat: int) -> tuple[int, int, bool]:
    """(saves per repeat, repeats, warm-up save) for a state of ``nbytes``."""
    if nbytes >= GiB:
        return 1, 1, False  # seconds per save: one save each is enough
    saves = 30 if nbytes <= 4 * MiB else 4
    return (max(3, saves // 3), 1, True) if quick else (saves, repeat, True)


def run(repeat: int, quick: bool) -> list[dict[str, Any]]:
    """Per case and repeat, the methods alternate save by save (the order flipped each repeat);
    the median of each repeat, then the best repeat."""
    out = []
    for label, state in cases(quick):
        arrays, nbytes = counts(state)
        saves, repeats, warm = plan(nbytes, quick, repeat)
        medians: dict[str, list[float]] = {}
        for r in range(repeats):
            base = WORK / "commit"
            shutil.rmtree(base, ignore_errors=True)
            methods = methods_for(label, base)
            names = list(methods) if r % 2 == 0 else list(methods)[::-1]
            times: dict[str, list[float]] = {name: [] for name in names}
            for i in range(saves + warm):
                for name in names:
                    took = methods[name].save(i, state)
                    methods[name].cleanup()
                    if i or not warm:
                        times[name].append(took)
            for name in names:
                medians.setdefault(name, []).append(statistics.median(times[name]))
                methods[name].close()
        row = {name: min(v) for name, v in medians.items()}
        print(
            f"   {label:20s} {arrays:4d} arrays {nbytes / MiB:10.3f} MiB  "
            + "  ".join(f"{name} {t * 1e3:9.2f} ms" for name, t in row.items()),
            flush=True,
        )
        out.append({"label": label, "arrays": arrays, "bytes": nbytes, "saves": saves * repeats, **row})
        del state
        gc.collect()
    shutil.rmtree(WORK / "commit", ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- syscall counts

_COUNTED = "fsync,fdatasync,sync_file_range,rename,renameat,renameat2,mkdir,mkdirat,open,openat,creat"
COUNT_FIELDS = ("fsync", "rename", "mkdir", "created files", "sync_file_range")


def count_child(work: str) -> None:
    """Run under strace: one marked save of each method per case (after a warm-up save)."""
    base = Path(work)
    for label, state in [
        ("tiny GPT-2 + AdamW", tiny_gpt2_state()),
        ("KMeans", kmeans_state()),
        ("1 KiB", {"w": torch.rand(256)}),
        ("64 MiB", {"w": torch.rand(16 * MiB)}),
    ]:
        shutil.rmtree(base / "c", ignore_errors=True)
        for name, method in methods_for(label, base / "c").items():
            method.save(0, state)
            tag = f"{label}|{name}".replace(" ", "_")
            os.mkdir(base / f"MARK-begin-{tag}")
            method.save(1, state)
            os.mkdir(base / f"MARK-end-{tag}")
            method.cleanup()
            method.close()


def count_syscalls() -> dict[tuple[str, str], dict[str, int]] | None:
    """fsyncs, renames, created directories and files of one save of each method (strace -f)."""
    if shutil.which("strace") is None:
        return None
    WORK.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=WORK) as work:
        trace = Path(work) / "trace"
        code = f"from bench.storage.commit import count_child; count_child({work!r})"
        command = [
            "strace",
            "-f",
            "-qq",
            "-e",
            f"trace={_COUNTED}",
            "-o",
            str(trace),
            sys.executable,
            "-c",
            code,
        ]
        proc = subprocess.run(command, cwd=HERE.parent, capture_output=True, text=True)
        if proc.returncode != 0 or not trace.exists():
            print(f"   strace failed ({proc.returncode}): {proc.stderr[-500:]}", flush=True)
            return None
        lines = trace.read_text().splitlines()
    found: dict[tuple[str, str], dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in lines:
        mark = re.search(r"MARK-(begin|end)-([^\"]+)\"", line)
        if mark:
            label, name = (part.replace("_", " ") for part in mark.group(2).split("|"))
            current = (
                found.setdefault((label, name), dict.fromkeys(COUNT_FIELDS, 0))
                if mark.group(1) == "begin"
                else None
            )
            continue
        call = re.match(r"\d+\s+(\w+)\(", line)
        if current is None or "resumed>" in line or not call:
            continue
        sys_name = call.group(1)
        if sys_name in ("fsync", "fdatasync"):
            current["fsync"] += 1
        elif sys_name.startswith("rename"):
            current["rename"] += 1
        elif sys_name.startswith("mkdir"):
            current["mkdir"] += 1
        elif sys_name == "sync_file_range":
            current["sync_file_range"] += 1
        elif sys_name in ("open", "openat", "creat") and ("O_CREAT" in line or sys_name == "creat"):
            current["created files"] += 1
    return found


# ----------------------------------------------------------------------------- the floor

PROTOCOLS = {
    "baseline: 1 file, fsync, rename, fsync dir": "baseline",
    "crashsafe: 2 files + dir, 3 fsyncs one by one, rename, fsync dir": "serial",
    "crashsafe: 2 files + dir, 3 fsyncs at once, rename, fsync dir": "together",
}


# another process committing 256 KiB files to the same file system in a loop: a busy journal
_BUSY = """
import os, sys
d = sys.argv[1]
data = os.urandom(256 << 10)
i = 0
while True:
    fd = os.open(os.path.join(d, f"f{i % 8}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    i += 1
"""


def measure_floor(rounds: int = 4, samples: int = 20) -> dict[str, Row]:
    """The protocols' floor alone, and while another process commits files to the same file system
    (as other jobs on a machine do); the two alternate round by round, so that what else the
    machine does at the time weighs on both alike."""
    found: dict[str, dict[str, list[float]]] = {"alone": {}, "busy": {}}
    busy_dir = WORK / "busy"
    for _ in range(rounds):
        for name, t in measure_protocols(samples).items():
            found["alone"].setdefault(name, []).append(t)
        busy_dir.mkdir(parents=True, exist_ok=True)
        other = subprocess.Popen([sys.executable, "-c", _BUSY, str(busy_dir)])
        try:
            time.sleep(0.3)
            for name, t in measure_protocols(samples).items():
                found["busy"].setdefault(name, []).append(t)
        finally:
            other.terminate()
            other.wait()
            shutil.rmtree(busy_dir, ignore_errors=True)
    return {how: {name: statistics.median(v) for name, v in rows.items()} for how, rows in found.items()}


def measure_protocols(samples: int = 60) -> Row:
    """Each commit protocol with bare syscalls (1 KiB of data, no library code), interleaved:
    the floor of each on this disk."""
    base = WORK / "protocols"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    root = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    data, manifest = os.urandom(KiB), os.urandom(2 * KiB)
    create = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    times: dict[str, list[float]] = {name: [] for name in PROTOCOLS}
    pool = ThreadPoolExecutor(2)

    def commit(name: str, how: str) -> float:
        t0 = time.perf_counter()
        if how == "baseline":
            f = os.open(name, create, 0o644, dir_fd=root)
            os.write(f, data)
            fds = [f]
        else:
            os.mkdir(name, dir_fd=root)
            d = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=root)
            f = os.open("data.bin", create, 0o644, dir_fd=d)
            os.write(f, data)
            m = os.open("manifest.json", create, 0o644, dir_fd=d)
            os.write(m, manifest)
            fds = [f, m, d]
        if how == "together":
            others = [pool.submit(os.fsync, fd) for fd in fds[1:]]
            os.fsync(fds[0])
            for other in others:
                other.result()
        else:
            for fd in fds:
                os.fsync(fd)
        os.rename(name, f"done-{name}", src_dir_fd=root, dst_dir_fd=root)
        os.fsync(root)
        took = time.perf_counter() - t0
        for fd in fds:
            os.close(fd)
        return took

    try:
        for i in range(samples):
            for label, how in PROTOCOLS.items():
                times[label].append(commit(f"{how}-{i}", how))
    finally:
        pool.shutdown()
        os.close(root)
        shutil.rmtree(base, ignore_errors=True)
    return {name: statistics.median(v) for name, v in times.items()}


# ----------------------------------------------------------------------------- where the time goes

PHASES = {  # label: (module, class or "", function)
    "flatten the state": ("crashsafe.saving", "", "flatten"),
    "write payloads (checksums, gathering)": ("crashsafe.storage.writer", "StepWriter", "write_payload"),
    "manifest to JSON (+ its checksum)": ("crashsafe.storage.writer", "", "dumps"),
    "manifest validated as a reader would": ("crashsafe.storage.writer", "", "loads"),
    "write the manifest, 3 fsyncs at once, rename, fsync dir": (
        "crashsafe.storage.local",
        "_LocalDraft",
        "commit",
    ),
}


def phases(saves: int = 30) -> tuple[float, Row]:
    """crashsafe's sync save of the tiny GPT-2 + AdamW, its time split by phase (each phase's
    function wrapped with a timer for this measurement only): (mean save, mean per phase)."""
    import importlib

    spent: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    undo = []
    for label, (module, cls, name) in PHASES.items():
        owner: Any = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        original = getattr(owner, name)

        def timed(*args: Any, _f: Any = original, _label: str = label, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                spent[_label] += time.perf_counter() - t0

        setattr(owner, name, timed)
        undo.append((owner, name, original))
    try:
        base = WORK / "phases"
        shutil.rmtree(base, ignore_errors=True)
        method = CrashsafeDurable(base)
        state = tiny_gpt2_state()
        times = []
        for i in range(saves + 1):
            if i == 1:
                spent.update(dict.fromkeys(PHASES, 0.0))
            took = method.save(i, state)
            method.cleanup()
            if i:
                times.append(took)
        method.close()
        shutil.rmtree(base, ignore_errors=True)
    finally:
        for owner, name, original in undo:
            setattr(owner, name, original)
    return statistics.mean(times), {label: t / saves for label, t in spent.items()}
