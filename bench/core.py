"""Core engine benchmark: training stall, time to durable commit, restore time and peak memory.

States of 64 MiB to 2 GiB (an MLP's state_dict plus its Adam state), side by side in one run,
against a plain memcpy (the floor of any snapshot), torch.save+fsync, safetensors+fsync,
torch.distributed.checkpoint save and async_save, np.savez+fsync, and a raw sequential
write+fsync of the same bytes (the ceiling of persist throughput). Every figure is the best of
``--repeat`` runs; ratios are taken within one run because the machine is noisy.

    python -m bench core [--quick] [--repeat N]
"""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import crashsafe as cs

WORK = Path(__file__).parent / ".work" / "core"
RESULTS = Path(__file__).parent / "results"
MiB = 1 << 20


def make_state(total_bytes: int) -> dict[str, Any]:
    """An MLP whose parameters + Adam moments take ``total_bytes`` (fp32), after one real step."""
    params = total_bytes // 4 // 3
    width = 2048
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=True) for _ in range(layers)])
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return {"model": model, "optim": optim, "step": 1}


def flat_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """model + optimizer tensors as one flat dict (for safetensors / np.savez)."""
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    for pid, slots in state["optim"].state_dict()["state"].items():
        for name, t in slots.items():
            out[f"optim.{pid}.{name}"] = t.reshape(-1) if t.dim() == 0 else t
    return out


def state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in flat_tensors(state).values())


class PeakRSS:
    """Samples the process RSS every millisecond; ``extra`` is the peak above the start."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.start = self._rss()
        self.peak = self.start
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def fsync_path(path: Path) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in paths:
        fsync_path(p)
    fsync_path(path if path.is_dir() else path.parent)


def fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


Row = dict[str, float]


def bench_memcpy(state: dict[str, Any]) -> Row:
    tensors = list(flat_tensors(state).values())
    buffers = [torch.empty_like(t) for t in tensors]
    for b in buffers:
        b.zero_()  # pre-fault, as crashsafe's staging buffers are
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for b, t in zip(buffers, tensors, strict=True):
            b.copy_(t)
        best = min(best, time.perf_counter() - t0)
    return {"stall": best}


def bench_raw_write(state: dict[str, Any]) -> Row:
    """Sequential write + fsync of the state's bytes: the ceiling of persist throughput.

    Like a training job's repeated checkpoints, it writes a new file each round and deletes the
    previous one (outside the timing), so both it and crashsafe see a warm page cache.
    """
    blobs = [t.reshape(-1).view(torch.uint8).numpy() for t in flat_tensors(state).values()]
    best = float("inf")
    for i in range(3):
        path = fresh(WORK / f"raw{i}.bin")
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for blob in blobs:
            view = memoryview(blob)
            pos = 0
            while pos < len(view):
                pos += os.write(fd, view[pos:])
        os.fsync(fd)
        os.close(fd)
        best = min(best, time.perf_counter() - t0)
        if i:
            (WORK / f"raw{i - 1}.bin").unlink()
    return {"stall": best, "durable": best}


def bench_crashsafe(state: dict[str, Any], async_save: bool, saves: int = 4) -> Row:
    """Several saves, as a training loop makes them; the first allocates and pre-faults staging."""
    directory = fresh(WORK / f"crashsafe-{async_save}")
    mgr = cs.CheckpointManager(directory, keep_last=1, async_save=async_save)
    stalls = []
    with PeakRSS() as mem:
        for step in range(saves):
            t0 = time.perf_counter()
            mgr.save(step, state)
            stalls.append(time.perf_counter() - t0)
            mgr.wait()
    persists = [s.persist for s in mgr.stats]
    mgr.close()
    target = make_like(state)
    reader = cs.CheckpointManager(directory, read_only=True)
    gc.collect()
    t0 = time.perf_counter()
    reader.restore(target)
    restore = time.perf_counter() - t0
    steady = min(range(1, saves), key=lambda i: stalls[i] + persists[i])
    durable = stalls[steady] + persists[steady] if async_save else stalls[steady]
    return {
        "stall": min(stalls[1:]),
        "durable": durable,
        "persist": min(persists[1:]),
        "first_stall": stalls[0],
        "restore": restore,
        "mem": mem.extra,
    }


def make_like(state: dict[str, Any]) -> dict[str, Any]:
    """A restore target with the same architecture (fresh weights, empty optimizer)."""
    layers = len(state["model"])
    width = state["model"][0].in_features
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=1e-4), "step": 0}


def bench_torch_save(state: dict[str, Any]) -> Row:
    path = fresh(WORK / "torch.pt")
    payload = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        torch.save(payload, path)
        fsync_tree(path)
        durable = time.perf_counter() - t0
    gc.collect()
    t0 = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    target = make_like(state)
    target["model"].load_state_dict(loaded["model"])
    target["optim"].load_state_dict(loaded["optim"])
    restore = time.perf_counter() - t0
    return {"stall": durable, "durable": durable, "restore": restore, "mem": mem.extra}


def bench_safetensors(state: dict[str, Any]) -> Row:
    from safetensors.torch import load_file, save_file

    path = fresh(WORK / "state.safetensors")
    tensors = {k: v.contiguous() for k, v in flat_tensors(state).items()}
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        save_file(tensors, str(path))
        fsync_tree(path)
        durable = time.perf_counter() - t0
    gc.collect()
    t0 = time.perf_counter()
    loaded = load_file(str(path))
    for t in loaded.values():
        t.add_(0)  # materialize: load_file maps lazily
    restore = time.perf_counter() - t0
    return {"stall": durable, "durable": durable, "restore": restore, "mem": mem.extra}


def bench_npsavez(state: dict[str, Any]) -> Row:
    path = fresh(WORK / "state.npz")
    arrays = {k.replace(".", "_"): v.numpy() for k, v in flat_tensors(state).items()}
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        np.savez(path, **arrays)
        fsync_tree(path)
        durable = time.perf_counter() - t0
    gc.collect()
    t0 = time.perf_counter()
    with np.load(path) as z:
        _ = {k: z[k] for k in z.files}
    restore = time.perf_counter() - t0
    return {"stall": durable, "durable": durable, "restore": restore, "mem": mem.extra}


def bench_dcp(state: dict[str, Any], asynchronous: bool) -> Row:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = fresh(WORK / f"dcp-{asynchronous}")
    model_sd, optim_sd = get_state_dict(state["model"], state["optim"])
    payload = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            if asynchronous:
                future = dcp.async_save(payload, checkpoint_id=str(directory))
                stall = time.perf_counter() - t0
                future.result()
            else:
                dcp.save(payload, checkpoint_id=str(directory))
            fsync_tree(directory)  # DCP's FileSystemWriter fsyncs files; make the directory durable too
            durable = time.perf_counter() - t0
            if not asynchronous:
                stall = durable
        target = make_like(state)
        t_model, t_optim = get_state_dict(target["model"], target["optim"])
        target_payload = {"model": t_model, "optim": t_optim}
        gc.collect()
        t0 = time.perf_counter()
        dcp.load(target_payload, checkpoint_id=str(directory))
        set_state_dict(
            target["model"],
            target["optim"],
            model_state_dict=target_payload["model"],
            optim_state_dict=target_payload["optim"],
        )
        restore = time.perf_counter() - t0
    return {"stall": stall, "durable": durable, "restore": restore, "mem": mem.extra}


METHODS: dict[str, Callable[[dict[str, Any]], Row]] = {
    "memcpy (floor)": bench_memcpy,
    "raw write+fsync (ceiling)": bench_raw_write,
    "crashsafe async": lambda s: bench_crashsafe(s, True),
    "crashsafe sync": lambda s: bench_crashsafe(s, False),
    "torch.save+fsync": bench_torch_save,
    "safetensors+fsync": bench_safetensors,
    "DCP save": lambda s: bench_dcp(s, False),
    "DCP async_save": lambda s: bench_dcp(s, True),
    "np.savez+fsync": bench_npsavez,
}


def run(sizes_mib: list[int], repeat: int) -> dict[int, dict[str, Row]]:
    results: dict[int, dict[str, Row]] = {}
    for size in sizes_mib:
        state = make_state(size * MiB)
        actual = state_bytes(state)
        print(f"-- state {actual / MiB:.0f} MiB", flush=True)
        rows: dict[str, Row] = {}
        for _ in range(repeat):
            for name, fn in METHODS.items():
                gc.collect()
                row = fn(state)
                best = rows.get(name)
                rows[name] = row if best is None else {k: min(v, best.get(k, v)) for k, v in row.items()}
                print(
                    f"   {name:28s} " + " ".join(f"{k}={v:.3f}" for k, v in row.items() if k != "mem"),
                    flush=True,
                )
        results[actual] = rows
        del state
        shutil.rmtree(WORK, ignore_errors=True)
    return results


def _fmt(x: float | None, unit: str = "s") -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.0f} ms" if unit == "s" and x < 1 else f"{x:.2f} s" if unit == "s" else f"{x:.2f}"


def report(results: dict[int, dict[str, Row]], command: str) -> str:
    lines = [
        "# Core engine: stall, durable commit, restore, memory",
        "",
        f"Produced by `{command}` on {time.strftime('%Y-%m-%d')} (2 cores, ext4 virtual disk). ",
        "State = an MLP's parameters + Adam moments (fp32). Best of the repeats; ratios within one run.",
        "Stall = time the training loop is blocked. Durable = until the checkpoint is on disk and "
        "committed (fsync). Restore = read + verify (crashsafe) + load into a model/optimizer. "
        "Memory = peak RSS increase during the saves (for crashsafe async: its reusable staging "
        "buffers, allocated once). crashsafe figures are the steady state of repeated saves; its "
        "first save, which allocates staging, is listed separately.",
        "",
    ]
    for size, rows in results.items():
        cs_async = rows["crashsafe async"]
        memcpy = rows["memcpy (floor)"]["stall"]
        raw = rows["raw write+fsync (ceiling)"]["durable"]
        torch_save = rows["torch.save+fsync"]
        lines += [
            f"## {size / MiB:.0f} MiB",
            "",
            "| method | stall | stall / memcpy | durable | restore | peak extra memory |",
            "|---|---|---|---|---|---|",
        ]
        for name, row in rows.items():
            mem = f"{row['mem'] / MiB:.0f} MiB" if "mem" in row else "-"
            lines.append(
                f"| {name} | {_fmt(row['stall'])} | {row['stall'] / memcpy:.1f}x "
                f"| {_fmt(row.get('durable'))} | {_fmt(row.get('restore'))} | {mem} |"
            )
        throughput = size / cs_async["persist"]
        raw_tp = size / raw
        stall_ratio = cs_async["stall"] / memcpy
        lines += [
            "",
            f"- crashsafe async stall = **{stall_ratio:.2f}x memcpy** (target <= 1.5x); torch.save+fsync "
            f"stalls **{torch_save['stall'] / cs_async['stall']:.1f}x longer** (target >= 8x)",
            f"- first save (allocates and pre-faults staging): {_fmt(cs_async['first_stall'])}",
            f"- persist throughput {throughput / MiB:.0f} MiB/s = **{throughput / raw_tp:.0%} of raw "
            f"write+fsync** ({raw_tp / MiB:.0f} MiB/s; target >= 90%)",
            f"- restore {_fmt(cs_async['restore'])} vs torch.load {_fmt(torch_save['restore'])}: "
            f"**{torch_save['restore'] / cs_async['restore']:.2f}x** (target >= 1x)",
            "",
        ]
    return "\n".join(lines) + "\n"


def plot(results: dict[int, dict[str, Row]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in METHODS if not n.startswith("raw")]
    sizes = list(results)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar(
            [j + i * width for j in range(len(sizes))],
            [results[s][name]["stall"] for s in sizes],
            width,
            label=name,
        )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"{s / MiB:.0f} MiB" for s in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("training stall per checkpoint (s, log)")
    ax.set_title("How long the training loop waits for a checkpoint")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    repeat = 1 if quick else 3
    for i, a in enumerate(argv):
        if a == "--repeat":
            repeat = int(argv[i + 1])
    sizes = [64, 256] if quick else [64, 256, 1024, 2048]
    torch.set_num_threads(2)
    results = run(sizes, repeat)
    command = "make bench BENCH=core" + (" (--quick)" if quick else "")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "core.md").write_text(report(results, command) + "\n![stall](core.png)\n")
    plot(results, RESULTS / "core.png")
    print((RESULTS / "core.md").read_text())
