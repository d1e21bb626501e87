"""Fine-tuning benchmark (issue 29): what a save costs when most of the state is a frozen base.

A base of N frozen ``Linear(2048, 2048)`` layers (fp32; 24 layers = 0.4 GB, 119 = 2 GB), each with a
rank-8 LoRA adapter (A 8x2048, B 2048x8, trainable) and AdamW over the adapters only. Every saver
runs the same loop: a few real training steps (forward, backward, AdamW step on random data), then
a save; K saves. Side by side in one run, interleaved repeat by repeat: crashsafe's default save of
the whole state; the same with ``unchanged=False`` (today's full save; skipped while the option does
not exist); ``codec="incremental"``; ``dcp.async_save`` and ``torch.save`` + fsync of the whole
state; and the adapter alone (adapters + AdamW state + step) with crashsafe and with torch.save, the
ideal the issue compares against. Per save: the stall (the save call), durable (until committed),
bytes the step owns on disk; then a restore of the whole state into a fresh model + optimizer
against the read limit (plain reads of the files that restore needs, warm page cache).

    python -m bench finetune [--sizes 0.4,2] [--saves 5] [--steps 3] [--repeat 2] [--out FILE]
                             [--work DIR] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import os
import shutil
import statistics
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

import crashsafe as cs
from bench.core import fsync_path
from bench.finetune_report import ADAPTER_CS, BATCH, DCP, DEFAULT_CS, FULL_CS, RANK, WIDTH, ms, plot, report

RESULTS = Path(__file__).parent / "results"

ALPHA = 16.0  # LoRA's scale numerator
DEVICE = torch.device("cpu")  # --device: where the model and its optimizer live


class LoRALinear(torch.nn.Module):
    """A frozen Linear plus a trainable rank-``rank`` update: y = Wx + b + B(Ax) * alpha/rank,
    RMS-normalised so that a deep stack neither vanishes into denormals nor overflows."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, width) / width**0.5)
        self.lora_b = torch.nn.Parameter(torch.zeros(width, rank))
        self.scale = ALPHA / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.base(x) + (x @ self.lora_a.T) @ self.lora_b.T * self.scale
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


class Tuned:
    """The model being fine-tuned, its optimizer (adapters only) and its training step."""

    def __init__(self, layers: int, width: int, seed: int) -> None:
        torch.manual_seed(seed)
        self.width = width
        self.model = torch.nn.Sequential(*[LoRALinear(width, RANK) for _ in range(layers)]).to(DEVICE)
        self.trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.optim = torch.optim.AdamW(self.trainable.values(), lr=1e-3)
        self.step = 0

    def train(self, steps: int) -> None:
        for _ in range(steps):
            x, y = (torch.randn(BATCH, self.width, device=DEVICE) for _ in range(2))
            self.optim.zero_grad(set_to_none=True)
            torch.autograd.backward(torch.nn.functional.mse_loss(self.model(x), y))
            self.optim.step()
            self.step += 1

    def whole(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optim, "step": self.step}

    def adapter(self) -> dict[str, Any]:
        return {"adapters": self.trainable, "optim": self.optim, "step": self.step}

    def base_bytes(self) -> int:
        return sum(t.nbytes for n, t in self.model.state_dict().items() if n not in self.trainable)

    def trainable_bytes(self) -> int:
        """Raw size of the trainable part: adapters, AdamW's moments and step counters, the step."""
        moments = sum(t.nbytes for s in self.optim.state.values() for t in s.values() if torch.is_tensor(t))
        return sum(p.nbytes for p in self.trainable.values()) + moments + 8


def same(a: Tuned, b: Tuned) -> bool:
    """Whether ``b`` holds exactly ``a``'s model and optimizer state (checks every restore)."""
    sa, sb = a.model.state_dict(), b.model.state_dict()
    if any(not torch.equal(sa[k], sb[k]) for k in sa):
        return False
    oa, ob = a.optim.state_dict()["state"], b.optim.state_dict()["state"]
    return oa.keys() == ob.keys() and all(
        torch.equal(torch.as_tensor(oa[i][k]), torch.as_tensor(ob[i][k])) for i in oa for k in oa[i]
    )


# ----------------------------------------------------------------------------- savers


class Saver:
    """One way of checkpointing: ``save`` is what the training loop waits for, ``wait`` until the step
    is durable; ``owned`` the bytes the step added to disk; ``needed`` the files a restore reads."""

    whole = True

    def __init__(self, where: Path) -> None:
        self.where = where

    def save(self, tuned: Tuned) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        """Until the last save is durable (a synchronous saver already is)."""

    def owned(self, step: int) -> int:
        raise NotImplementedError

    def close(self) -> None:
        """Stop writing; what a restore needs stays."""

    def needed(self) -> list[Path]:
        raise NotImplementedError

    def restore(self, target: Tuned) -> None:
        raise NotImplementedError


class Unavailable(Exception):
    """A saver this crashsafe cannot make (an option it does not have yet)."""


class Crashsafe(Saver):
    def __init__(self, where: Path, adapter: bool = False, **options: Any) -> None:
        super().__init__(where)
        self.whole = not adapter
        missing = set(options) - set(inspect.signature(cs.CheckpointManager).parameters)
        if missing:
            raise Unavailable(f"skipped: this crashsafe's CheckpointManager has no {sorted(missing)[0]}=")
        self.mgr = cs.CheckpointManager(where, **options)

    def save(self, tuned: Tuned) -> None:
        self.mgr.save(tuned.step, tuned.adapter() if not self.whole else tuned.whole())

    def wait(self) -> None:
        self.mgr.wait()

    def owned(self, step: int) -> int:
        return sum(self.mgr.manifest(step).files.values())  # its own files; referred bytes are not listed

    def close(self) -> None:
        self.mgr.close()
        with cs.CheckpointManager(self.where, keep_last=1) as mgr:
            mgr.gc()  # left: the newest step and what it needs (delta bases, referred bytes)

    def needed(self) -> list[Path]:
        return sorted(p for p in self.where.glob("step_*/*") if p.name != "manifest.json")

    def restore(self, target: Tuned) -> None:
        with cs.CheckpointManager(self.where, read_only=True) as reader:
            reader.restore(target.whole())


class TorchSave(Saver):
    def __init__(self, where: Path, adapter: bool = False) -> None:
        super().__init__(where)
        self.whole = not adapter
        where.mkdir(parents=True)

    def _file(self, step: int) -> Path:
        return self.where / f"step{step}.pt"

    def save(self, tuned: Tuned) -> None:
        part = tuned.model.state_dict() if self.whole else {n: p.detach() for n, p in tuned.trainable.items()}
        payload = {
            "model" if self.whole else "adapters": part,
            "optim": tuned.optim.state_dict(),
            "step": tuned.step,
        }
        with open(self._file(tuned.step), "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.where)

    def owned(self, step: int) -> int:
        for old in self.where.glob("*.pt"):  # keep the newest (outside the timings)
            if old != self._file(step):
                old.unlink()
        return self._file(step).stat().st_size

    def needed(self) -> list[Path]:
        return sorted(self.where.glob("*.pt"))

    def restore(self, target: Tuned) -> None:
        saved = torch.load(self.needed()[-1], mmap=True, weights_only=True)
        target.model.load_state_dict(saved["model"])
        target.optim.load_state_dict(saved["optim"])


class Dcp(Saver):
    """``dcp.async_save`` in one process (no process group: DCP saves as a single process); each
    step its own checkpoint directory; the stall includes ``get_state_dict``."""

    def __init__(self, where: Path) -> None:
        super().__init__(where)
        where.mkdir(parents=True)
        self.future: Any = None

    @staticmethod
    def _state(tuned: Tuned) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(tuned.model, tuned.optim)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, tuned: Tuned) -> None:
        from torch.distributed.checkpoint.state_dict_saver import async_save

        state = {**self._state(tuned), "step": tuned.step}
        response = async_save(state, checkpoint_id=str(self.where / f"step{tuned.step}"))
        self.future = getattr(response, "upload_completion", response)

    def wait(self) -> None:
        self.future.result()
        fsync_path(self.where)  # DCP fsyncs its files; the new directory's entry too

    def owned(self, step: int) -> int:
        for old in self.where.iterdir():
            if old.name != f"step{step}":
                shutil.rmtree(old)
        return sum(p.stat().st_size for p in self.needed())

    def needed(self) -> list[Path]:
        return sorted(p for p in self.where.rglob("*") if p.is_file())

    def restore(self, target: Tuned) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        sd = self._state(target)
        load(sd, checkpoint_id=str(next(self.where.iterdir())))
        set_state_dict(target.model, target.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def savers() -> dict[str, Callable[[Path], Saver]]:
    """The compared savers by name; each makes its saver in a fresh directory."""
    return {
        DEFAULT_CS: lambda w: Crashsafe(w),
        FULL_CS: lambda w: Crashsafe(w, unchanged=False),  # Unavailable until the option exists
        'crashsafe codec="incremental"': lambda w: Crashsafe(w, codec="incremental"),
        DCP: Dcp,
        "torch.save + fsync (whole state)": TorchSave,
        ADAPTER_CS: lambda w: Crashsafe(w, adapter=True),
        "torch.save + fsync, adapter alone": lambda w: TorchSave(w, adapter=True),
    }


# ----------------------------------------------------------------------------- measuring


def read_limit(files: list[Path], repeat: int) -> float:
    """Best time to read ``files`` into memory with plain reads (page cache warm, buffer touched)."""
    sizes = [f.stat().st_size for f in files]
    buffer = np.zeros(sum(sizes), dtype=np.uint8)
    view = buffer.data

    def read() -> None:
        at = 0
        for f, n in zip(files, sizes, strict=True):
            with open(f, "rb", buffering=0) as handle:
                got = 0
                while got < n:
                    got += handle.readinto(view[at + got : at + n]) or n
            at += n

    read()
    return _best(read, repeat)


def _read_base(tuned: Tuned) -> None:
    """Read every frozen byte once, as proving them unchanged must (docs/unchanged.md): xxh3 on the
    CPU, the device fingerprint on a GPU."""
    from crashsafe.state.fingerprint import print_of, printable
    from crashsafe.state.unchanged import HASHING_THREADS, MIN_BYTES

    frozen = [
        tensor
        for name, tensor in tuned.model.state_dict().items()
        if name not in tuned.trainable  # and watched: smaller ones are copied at every save
        and tensor.nbytes >= MIN_BYTES
        and (printable(tensor) or not tensor.is_cuda)
    ]
    if DEVICE.type == "cuda":
        for tensor in frozen:
            print_of(tensor)
        _settle()
        return
    with ThreadPoolExecutor(HASHING_THREADS) as threads:  # as many as crashsafe's hashing uses
        list(threads.map(lambda t: xxhash.xxh3_64_intdigest(t.reshape(-1).view(torch.uint8).numpy()), frozen))


def _settle() -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best


def run_saver(
    make: Callable[[Path], Saver],
    tuned: Tuned,
    target: Tuned,
    where: Path,
    saves: int,
    steps: int,
    repeat: int,
) -> dict[str, Any]:
    """K saves of ``tuned`` between training steps; then restores into ``target`` and the read limit."""
    shutil.rmtree(where, ignore_errors=True)
    saver = make(where)
    stalls, durables, owned = [], [], []
    try:
        for _ in range(saves):
            tuned.train(steps)
            gc.collect()
            _settle()
            began = time.perf_counter()
            saver.save(tuned)
            _settle()  # on a GPU: until the device may run training's next kernel (bench/gpu.py)
            stalls.append(time.perf_counter() - began)
            saver.wait()
            durables.append(time.perf_counter() - began)
            owned.append(saver.owned(tuned.step))
    finally:
        saver.close()
    row: dict[str, Any] = {"stall": stalls, "durable": durables, "owned": owned}
    if saver.whole:
        saver.restore(target)  # warms the page cache, and is checked
        if not same(tuned, target):
            raise AssertionError(f"restore from {where} did not give back the saved state")
        row["restore"] = _best(lambda: saver.restore(target), repeat)
        files = saver.needed()
        row["read limit"] = read_limit(files, repeat)
        row["read bytes"] = sum(f.stat().st_size for f in files)
    shutil.rmtree(where, ignore_errors=True)
    return row


def merge(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One saver's repeats: first saves and steady saves pooled; restores and read limits best."""
    out: dict[str, Any] = {
        "first stall": [r["stall"][0] for r in rows],
        "first durable": [r["durable"][0] for r in rows],
        "stall": [s for r in rows for s in r["stall"][1:]],
        "durable": [s for r in rows for s in r["durable"][1:]],
        "first owned": rows[0]["owned"][0],
        "owned": statistics.median(o for r in rows for o in r["owned"][1:]),
    }
    for key in ("restore", "read limit", "read bytes"):
        if key in rows[0]:
            out[key] = min(r[key] for r in rows)
    return out


def measure(layers: int, width: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every saver over one model, repeat by repeat, interleaved."""
    tuned, target = Tuned(layers, width, seed=0), Tuned(layers, width, seed=1)
    tuned.train(1)  # AdamW's state exists: the trainable part's size is known
    runs: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    for attempt in range(args.repeat):
        for name, make in savers().items():
            if name in skipped:
                continue
            try:
                row = run_saver(make, tuned, target, work / "saver", args.saves, args.steps, args.best)
            except Unavailable as exc:
                skipped[name] = str(exc)
                continue
            runs.setdefault(name, []).append(row)
            print(
                f"   [{attempt + 1}/{args.repeat}] {name:48s} stall {ms(row['stall'][-1])}, durable "
                f"{ms(row['durable'][-1])}, {row['owned'][-1] / 1e6:.1f} MB",
                flush=True,
            )
    return {
        "layers": layers,
        "read base": _best(lambda: _read_base(tuned), args.best),
        "base": tuned.base_bytes(),
        "trainable": tuned.trainable_bytes(),
        "width": width,
        "rows": {name: merge(runs[name]) if name in runs else {} for name in savers()},
        "skipped": skipped,
    }


# ----------------------------------------------------------------------------- report


def layers_of(gigabytes: float) -> int:
    """How many frozen Linear(WIDTH, WIDTH) layers (weight and bias, fp32) make ``gigabytes``."""
    return max(1, round(gigabytes * 1e9 / (4 * (WIDTH + 1) * WIDTH)))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench finetune")
    parser.add_argument("--sizes", default="0.4,2", help="frozen base sizes in GB (default 0.4,2)")
    parser.add_argument("--saves", type=int, default=5, help="saves per saver and repeat (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="training steps before each save (default 3)")
    parser.add_argument("--repeat", type=int, default=2, help="repeats, interleaved (default 2)")
    parser.add_argument("--out", type=Path, help="results markdown and a PNG beside it (default "
                        "bench/results/finetune.md; none with --quick)")  # fmt: skip
    parser.add_argument("--work", type=Path, default=Path("/tmp/crashsafe-bench-finetune"), help="scratch")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 3 saves, 1 repeat (smoke run)")
    parser.add_argument("--device", default="cpu", help="where the model lives: cpu (default) or cuda")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.quick:
        args.saves, args.steps, args.repeat = 3, 1, 1
    args.best = 1 if args.quick else 3  # restores and read limits: best of
    out = args.out or (None if args.quick else RESULTS / "finetune.md")
    args.command = "make bench BENCH=" + (f'"finetune {" ".join(argv)}"' if argv else "finetune")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    feature = "unchanged" in inspect.signature(cs.CheckpointManager).parameters
    load_before, began = os.getloadavg()[0], time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():  # DCP warns that it saves in one process, without a group
            warnings.simplefilter("ignore")  # (crashsafe logs nothing in a run without trouble)
            for size in ["quick"] if args.quick else args.sizes.split(","):
                layers, width = (2, 256) if size == "quick" else (layers_of(float(size)), WIDTH)
                print(f"-- {size}: {layers} layers of {width}", flush=True)
                results[size] = measure(layers, width, args.work, args)
                gc.collect()
    finally:
        shutil.rmtree(args.work / "saver", ignore_errors=True)
        with contextlib.suppress(OSError):
            args.work.rmdir()  # if empty
    text = report(results, args, time.perf_counter() - began, (load_before, os.getloadavg()[0]), feature)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        picture = out.with_suffix(".png")
        plot(results, picture)
        out.write_text(text + f"\n![steady saves]({picture.name})\n")
