"""GPU benchmark: saving and restoring a CUDA training state, side by side in one run.

A state of fp32 parameters and AdamW's two moments on one GPU (1.6 GB and 4.8 GB), warm page cache.
Limits: the device-to-host copy of the same bytes into pinned and into pageable memory, a write +
fsync of them, a one-thread read + host-to-device copy, and a pipelined read into pinned buffers +
host-to-device. Savers: crashsafe (steady and first save), ``dcp.async_save`` with its default
stager and with a pinned ``DefaultStager``, ``torch.save`` + fsync. Restores into the live CUDA model
and optimizer: crashsafe, ``torch.load(mmap=True)``, ``torch.load(map_location="cuda")``, ``dcp.load``.
Then a training loop's wall time with a save every N steps, for each saver.

A save's *stall* is the time from the call until the GPU may run the next kernel (the call, then
``torch.cuda.synchronize()``): crashsafe's copy is ordered on the GPU, so its call returns before
the copy is done, and the training stream waits for it. *Durable* is until the step is committed.

    python -m bench gpu [--sizes 1.6,4.8] [--repeat 3] [--out bench/results/gpu.md] [--work DIR]
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import crashsafe as cs

RESULTS = Path(__file__).parent / "results"
WIDTH = 4096
CHUNK = 16 << 20


def _sync() -> None:
    torch.cuda.synchronize()


def make_state(gigabytes: float) -> dict[str, Any]:
    """Linear(4096, 4096) layers whose fp32 parameters + AdamW moments take about ``gigabytes``."""
    layers = max(1, round(gigabytes * 1e9 / 12 / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, WIDTH, device="cuda")).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    _sync()
    return {"model": model, "optim": optim, "step": 1}


def tensors_of(state: dict[str, Any]) -> list[torch.Tensor]:
    """The state's CUDA tensors: parameters, then each parameter's moments."""
    found = [p.detach() for p in state["model"].parameters()]
    for slots in state["optim"].state.values():
        found += [v for v in slots.values() if torch.is_tensor(v) and v.is_cuda]
    return found


def _timed(fn: Callable[[], Any]) -> float:
    _sync()
    began = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - began


def _best(fn: Callable[[], Any], repeat: int) -> float:
    return min(_timed(fn) for _ in range(repeat))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _fresh(path: Path) -> Iterator[Path]:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- limits


def limits(state: dict[str, Any], work: Path, repeat: int, out: dict[str, Any]) -> None:
    tensors = tensors_of(state)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]

    def to_pinned() -> None:
        for buf, t in zip(pinned, tensors, strict=True):
            buf.copy_(t, non_blocking=True)

    out["d2h pinned"] = _best(to_pinned, repeat)
    pageable = [torch.zeros(t.shape, dtype=t.dtype) for t in tensors]  # touched: no first-touch cost

    def to_pageable() -> None:
        for buf, t in zip(pageable, tensors, strict=True):
            buf.copy_(t)

    out["d2h pageable"] = _best(to_pageable, repeat)
    pageable.clear()
    floor = work / "floor.bin"

    def write_fsync() -> None:
        with open(floor, "wb", buffering=0) as f:
            for buf in pinned:
                f.write(memoryview(buf.view(-1).view(torch.uint8).numpy()))
            os.fsync(f.fileno())
        _fsync_dir(work)

    out["write + fsync"] = _best(write_fsync, repeat)
    host = np.empty(floor.stat().st_size, dtype=np.uint8)
    host.fill(0)

    def naive_read() -> None:
        with open(floor, "rb", buffering=0) as f:
            f.readinto(memoryview(host))
        at = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            t.view(-1).view(torch.uint8).copy_(torch.from_numpy(host[at : at + n]))
            at += n

    out["read + h2d, one thread"] = _best(naive_read, repeat)
    ring = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(3)]
    events: list[Any] = [None] * 3
    stream = torch.cuda.Stream()

    def pipelined_read() -> None:
        turn = 0
        with open(floor, "rb", buffering=0) as f:
            for t in tensors:
                flat = t.view(-1).view(torch.uint8)
                for off in range(0, flat.numel(), CHUNK):
                    k = turn % 3
                    turn += 1
                    if events[k] is not None:
                        events[k].synchronize()
                    n = min(CHUNK, flat.numel() - off)
                    f.readinto(memoryview(ring[k].numpy()[:n]))
                    with torch.cuda.stream(stream):
                        flat[off : off + n].copy_(ring[k][:n], non_blocking=True)
                    events[k] = torch.cuda.Event()
                    events[k].record(stream)
        stream.synchronize()

    out["pipelined read into pinned + h2d"] = _best(pipelined_read, repeat)
    floor.unlink()


# ----------------------------------------------------------------------------- savers


def _changed(state: dict[str, Any]) -> None:
    """Change every tensor of ``state`` in place (on the GPU), as a training step does."""
    with torch.no_grad():
        for tensor in tensors_of(state):
            if tensor.is_floating_point():
                tensor.add_(1.0)


def crashsafe_saves(state: dict[str, Any], work: Path, repeat: int, out: dict[str, Any]) -> None:
    firsts, stalls, returns, durables = [], [], [], []
    for attempt in range(repeat):
        with _fresh(work / "cs") as where, cs.CheckpointManager(where, keep_last=2) as mgr:
            step = 1
            _sync()
            began = time.perf_counter()
            mgr.save(step, state)
            _sync()
            firsts.append(time.perf_counter() - began)
            mgr.wait()
            for _ in range(repeat + 1 if attempt == 0 else 0):
                step += 1
                _changed(state)  # as training does: an unchanged tensor would be referred to, not copied
                _sync()
                began = time.perf_counter()
                mgr.save(step, state)
                returned = time.perf_counter()
                _sync()
                stalled = time.perf_counter()
                mgr.wait()
                done = time.perf_counter()
                if step > 2:  # the second save still pins nothing, but warms the writer
                    returns.append(returned - began)
                    stalls.append(stalled - began)
                    durables.append(done - began)
    out["crashsafe save stall, steady"] = stalls
    out["crashsafe save call returns"] = returns
    out["crashsafe first save stall"] = firsts
    out["crashsafe durable (save + wait)"] = durables


def _dcp_state(state: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(state["model"], state["optim"])
    return {"model": model_sd, "optim": optim_sd}


def dcp_saves(state: dict[str, Any], work: Path, repeat: int, out: dict[str, Any], pinned: bool) -> None:
    import torch.distributed.checkpoint as dcp

    name = "dcp.async_save, pinned DefaultStager" if pinned else "dcp.async_save (default stager)"
    options: dict[str, Any] = {}
    if pinned:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        options["async_stager"] = DefaultStager(
            StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=False)
        )
    stalls, durables = [], []
    try:
        for i in range(repeat):
            with _fresh(work / f"dcp{i}") as where:
                sd = _dcp_state(state)
                _sync()
                began = time.perf_counter()
                response = dcp.async_save(sd, checkpoint_id=str(where), **options)
                _sync()
                stalls.append(time.perf_counter() - began)
                upload = getattr(response, "upload_completion", response)
                upload.result()
                durables.append(time.perf_counter() - began)
    except Exception as exc:  # report what DCP does, as the issue asks
        out[name] = f"failed: {type(exc).__name__}: {exc}"[:160]
        traceback.print_exc()
        return
    out[f"{name} stall"] = stalls
    out[f"{name} durable"] = durables


def torch_save(state: dict[str, Any], work: Path, repeat: int, out: dict[str, Any]) -> Path:
    path = work / "torch.pt"

    def save() -> None:
        with open(path, "wb") as f:
            torch.save({"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(work)

    out["torch.save + fsync"] = _best(save, repeat)
    return path


# ----------------------------------------------------------------------------- restores


def restores(state: dict[str, Any], work: Path, torch_file: Path, repeat: int, out: dict[str, Any]) -> None:
    model, optim = state["model"], state["optim"]

    def torch_load(**kwargs: Any) -> Callable[[], None]:
        def load() -> None:
            saved = torch.load(torch_file, weights_only=True, **kwargs)
            model.load_state_dict(saved["model"])
            optim.load_state_dict(saved["optim"])

        return load

    out["torch.load(mmap=True) + load_state_dict"] = _best(torch_load(mmap=True), repeat)
    out['torch.load(map_location="cuda") + load_state_dict'] = _best(torch_load(map_location="cuda"), repeat)
    torch_file.unlink()
    gc.collect()
    torch.cuda.empty_cache()
    with _fresh(work / "cs-restore") as where:
        with cs.CheckpointManager(where) as mgr:
            mgr.save(1, state)
        reader = cs.CheckpointManager(where, read_only=True)
        reader.restore(state)  # the page cache warm, as for the others
        out["crashsafe restore into the live model + optimizer"] = _best(
            lambda: reader.restore(state), repeat
        )
        out['crashsafe load(device="cuda")'] = _best(lambda: reader.load(device="cuda"), repeat)
        reader.close()
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        with _fresh(work / "dcp-restore") as where:
            dcp.save(_dcp_state(state), checkpoint_id=str(where))

            def dcp_load() -> None:
                sd = _dcp_state(state)
                dcp.load(sd, checkpoint_id=str(where))
                set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

            out["dcp.load + set_state_dict"] = _best(dcp_load, repeat)
    except Exception as exc:
        out["dcp.load + set_state_dict"] = f"failed: {type(exc).__name__}: {exc}"[:160]


# ----------------------------------------------------------------------------- training loop


def training_loop(state: dict[str, Any], work: Path, steps: int, every: int, out: dict[str, Any]) -> None:
    """Wall time of ``steps`` AdamW steps (batch 2048) with a save every ``every`` steps, per saver."""
    import torch.distributed.checkpoint as dcp

    model, optim = state["model"], state["optim"]
    x = torch.randn(2048, WIDTH, device="cuda")

    def run(save: Callable[[int], None] | None, finish: Callable[[], None] = lambda: None) -> float:
        _sync()
        began = time.perf_counter()
        for step in range(1, steps + 1):
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            if save is not None and step % every == 0:
                save(step)
        finish()
        _sync()
        return time.perf_counter() - began

    out["loop: no saves"] = run(None)
    with _fresh(work / "loop-cs") as where, cs.CheckpointManager(where, keep_last=2) as mgr:
        out["loop: crashsafe"] = run(lambda step: mgr.save(step, state), mgr.wait)
    pending: list[Any] = []

    def dcp_save(step: int) -> None:
        for response in pending:
            getattr(response, "upload_completion", response).result()
        pending.clear()
        where = work / "loop-dcp" / str(step)
        where.mkdir(parents=True)
        pending.append(dcp.async_save(_dcp_state(state), checkpoint_id=str(where)))

    try:
        out["loop: dcp.async_save"] = run(dcp_save, lambda: dcp_save(0))
    finally:
        shutil.rmtree(work / "loop-dcp", ignore_errors=True)

    def torch_save(step: int) -> None:
        with open(work / "loop.pt", "wb") as f:
            torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    out["loop: torch.save + fsync"] = run(torch_save)
    (work / "loop.pt").unlink(missing_ok=True)


# ----------------------------------------------------------------------------- report


def _fmt(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if not value:
            return "n/a"
        lo, hi = min(value), max(value)
        return _ms(lo) if hi - lo < 0.05 * lo else f"{_ms(lo)}–{_ms(hi)}"
    return _ms(value)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _best_of(value: Any) -> float | None:
    if isinstance(value, list):
        return min(value) if value else None
    return value if isinstance(value, float) else None


TARGETS: list[tuple[str, str, str, float]] = [  # (what, measured, against, at most)
    ("steady save stall / pinned d2h copy", "crashsafe save stall, steady", "d2h pinned", 1.2),
    ("steady save stall / dcp.async_save's", "crashsafe save stall, steady",
     "dcp.async_save (default stager) stall", 0.1),
    ("first save stall / steady stall", "crashsafe first save stall", "crashsafe save stall, steady", 2.0),
    ("durable / write + fsync", "crashsafe durable (save + wait)", "write + fsync", 1.1),
    ("restore / torch.load(mmap) + load_state_dict", "crashsafe restore into the live model + optimizer",
     "torch.load(mmap=True) + load_state_dict", 1.0),
    ("restore / pipelined read + h2d", "crashsafe restore into the live model + optimizer",
     "pipelined read into pinned + h2d", 1.3),
]  # fmt: skip


def report(results: dict[str, dict[str, Any]], device: str, command: str) -> str:
    sizes = list(results)
    names = [n for n in next(iter(results.values())) if n != "bytes" and not n.startswith("loop")]
    lines = [
        "# GPU: saving and restoring a CUDA training state",
        "",
        f"Device: {device}; torch {torch.__version__}. Command: `{command}`. Best of the repeats unless a "
        "range is given. A stall is the call plus `torch.cuda.synchronize()` (until the GPU may run the "
        "next kernel).",
        "",
        "| measure | " + " | ".join(f"{results[s]['bytes'] / 1e9:.1f} GB state" for s in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    lines += [f"| {n} | " + " | ".join(_fmt(results[s].get(n, "n/a")) for s in sizes) + " |" for n in names]
    header = " | ".join(f"{results[s]['bytes'] / 1e9:.1f} GB" for s in sizes)
    lines += ["", "## Targets (ratios within one run)", "", f"| target | {header} | at most |"]
    lines.append("|---|" + "---|" * (len(sizes) + 1))
    for what, measured, against, bound in TARGETS:
        cells = []
        for s in sizes:
            a, b = _best_of(results[s].get(measured)), _best_of(results[s].get(against))
            cells.append(
                "n/a" if a is None or b is None else f"{a / b:.2f}x {'met' if a / b <= bound else 'MISSED'}"
            )
        lines.append(f"| {what} | " + " | ".join(cells) + f" | {bound}x |")
    loops = {s: {n: v for n, v in results[s].items() if n.startswith("loop")} for s in sizes}
    for s in sizes:
        if loops[s]:
            base = loops[s].get("loop: no saves")
            lines += ["", f"## Training loop, {results[s]['bytes'] / 1e9:.1f} GB state", "",
                      "| saver | wall time | vs no saves |", "|---|---|---|"]  # fmt: skip
            for n, v in loops[s].items():
                ratio = f"{v / base:.2f}x" if isinstance(v, float) and base else "n/a"
                lines.append(f"| {n.removeprefix('loop: ')} | {_fmt(v)} | {ratio} |")
    return "\n".join(lines) + "\n"


def measure(
    size: float,
    out: dict[str, Any],
    work: Path,
    repeat: int,
    loop: tuple[int, int] | None,
    written: Callable[[], None],
) -> None:
    """Every measure of one state size into ``out``, ``written`` after each part (a run cut short
    keeps what it has); a part that fails is reported and skipped."""
    state = make_state(size)
    out["bytes"] = sum(t.numel() * t.element_size() for t in tensors_of(state))
    print(f"=== {size} GB state", flush=True)
    parts: list[Callable[[], Any]] = [
        lambda: limits(state, work, repeat, out),
        lambda: crashsafe_saves(state, work, repeat, out),
        lambda: dcp_saves(state, work, repeat, out, pinned=False),
        lambda: dcp_saves(state, work, repeat, out, pinned=True),
        lambda: restores(state, work, torch_save(state, work, repeat, out), repeat, out),
    ]
    if loop is not None:
        parts.append(lambda: training_loop(state, work, *loop, out))
    for part in parts:
        try:
            part()
        except Exception:
            traceback.print_exc()
        gc.collect()
        torch.cuda.empty_cache()
        print({k: _fmt(v) for k, v in out.items() if k != "bytes"}, flush=True)
        written()


def main(argv: list[str]) -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU benchmark needs one (it exits 0 here); see bench/results/gpu.md")
        return
    sizes, repeat, out_file, work = [1.6, 4.8], 3, RESULTS / "gpu.md", Path(__file__).parent / ".work" / "gpu"
    steps, every, loop_sizes = 200, 50, [1.6]
    for i, arg in enumerate(argv):
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if arg == "--sizes":
            sizes = [float(s) for s in value.split(",")]
        elif arg == "--repeat":
            repeat = int(value)
        elif arg == "--out":
            out_file = Path(value)
        elif arg == "--work":
            work = Path(value)
        elif arg == "--loop-sizes":
            loop_sizes = [float(s) for s in value.split(",") if s]
    warnings.filterwarnings("ignore")
    device = torch.cuda.get_device_name()
    results: dict[str, dict[str, Any]] = {}
    work.mkdir(parents=True, exist_ok=True)
    command = "make bench BENCH=gpu" + (f" ({' '.join(argv)})" if argv else "")
    for size in sizes:
        out: dict[str, Any] = {}
        results[f"{size}"] = out
        out_file.parent.mkdir(parents=True, exist_ok=True)
        loop = (steps, every) if size in loop_sizes else None
        measure(size, out, work, repeat, loop, lambda: out_file.write_text(report(results, device, command)))
    print(out_file.read_text())
