"""Integrations benchmark: per-save training stall and time to a durable checkpoint, measured inside
real training runs, side by side in one run.

* Lightning: the digits CNN (``crashsafe.workloads.lightning_digits``) trained by a stock ``Trainer``
  whose ``ModelCheckpoint`` saves ``epoch=..ckpt`` and ``last.ckpt`` every 4 steps, with Lightning's
  default ``TorchCheckpointIO``, its ``AsyncCheckpointIO`` (over the same writer) and crashsafe's
  ``CrashsafeCheckpointIO``; at width 64 (a state of ~0.8 MiB, where fixed per-save costs decide)
  and at a width giving ~100 MiB of state (where the copy and the write do).
* Hugging Face: the tiny GPT-2 (``crashsafe.workloads.hf_tiny``) trained by ``Trainer`` with HF's
  own ``save_steps`` checkpoints and by ``CrashsafeTrainer``.

Stall = time the training thread spends in the framework's save call of the checkpoint IO
(Lightning: ``CheckpointIO.save_checkpoint``; HF: ``Trainer._save_checkpoint``); Lightning builds
its checkpoint dict before that call, the same for every IO. Durable = from the start of that call
until the checkpoint is on disk: Lightning and HF do not fsync, so for them the bench fsyncs each
file they wrote and its directory right after the write (that fsync is not counted as stall: the
frameworks do not block on it); crashsafe's is its commit (data and manifest fsynced, atomic rename,
directory fsynced) and, for Lightning, the pointer file at Lightning's path. Medians over the
saves of each run (the first save of a run, which allocates buffers, included), best of
``--repeat`` runs, the checkpointing methods interleaved; ratios are taken against the framework's
default. The floor section times the fixed costs these are made of.

    python -m bench integrations [--repeat N] [--quick]
"""

from __future__ import annotations

import argparse
import io
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from bench.core import fsync_path

WORK = Path(__file__).parent / ".work" / "integrations"
RESULTS = Path(__file__).parent / "results"
Timings = list[tuple[float, float, bool]]  # (stall, durable, a second save of its step) per save, s
LARGE_WIDTH = 8192  # the digits CNN at this width: ~100 MiB of weights and Adam state


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fsync_path(path)
    fsync_path(folder)
    fsync_path(folder.parent)


# ---------------------------------------------------------------- Lightning


def _lightning_io(kind: str) -> Any:
    """The CheckpointIO of ``kind``; Lightning's are wrapped to record (stall, durable) per save."""
    from lightning.pytorch.plugins import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO

    if kind == "crashsafe":
        from crashsafe.integrations.lightning import CrashsafeCheckpointIO

        return CrashsafeCheckpointIO()

    class CloneOnly(CheckpointIO):  # type: ignore[misc]
        """The stall's ceiling for any save that returns before writing: Lightning's dict walked and
        every tensor cloned (AsyncCheckpointIO's copy), then dropped: no thread, nothing written."""

        def __init__(self) -> None:
            self.timings: Timings = []

        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            from lightning_utilities.core.apply_func import apply_to_collection

            begin = time.perf_counter()
            apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().clone())
            self.timings.append((time.perf_counter() - begin, math.nan, Path(path).name == "last.ckpt"))

        def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("nothing was written")

        def remove_checkpoint(self, path: Any) -> None:
            return None  # nothing was written

    if kind == CLONE_ONLY:
        return CloneOnly()

    class Fsynced(TorchCheckpointIO):  # type: ignore[misc]
        """Lightning's default write; then (not Lightning's cost) an fsync of the file and its
        directory: when the checkpoint is durable."""

        def __init__(self) -> None:
            self.written: list[float] = []
            self.durable: list[float] = []

        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options)
            self.written.append(time.perf_counter())
            fsync_path(Path(path))
            fsync_path(Path(path).parent)
            self.durable.append(time.perf_counter())

    class Timed(CheckpointIO):  # type: ignore[misc]
        """Times the training thread's save call (for the synchronous writer: until written)."""

        def __init__(self, inner: Any, writer: Fsynced) -> None:
            self.inner, self.writer = inner, writer
            self.calls: list[tuple[float, float, str]] = []  # (begin, returned, file name)

        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            begin = time.perf_counter()
            self.inner.save_checkpoint(checkpoint, path, storage_options)
            self.calls.append((begin, time.perf_counter(), Path(path).name))

        def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            return self.inner.load_checkpoint(*args, **kwargs)

        def remove_checkpoint(self, path: Any) -> None:
            self.inner.remove_checkpoint(path)

        def teardown(self) -> None:
            self.inner.teardown()

        @property
        def timings(self) -> Timings:
            sync = self.inner is self.writer
            return [
                ((written if sync else returned) - begin, durable - begin, name == "last.ckpt")
                for (begin, returned, name), written, durable in zip(
                    self.calls, self.writer.written, self.writer.durable, strict=True
                )
            ]

    writer = Fsynced()
    return Timed(writer if kind == "TorchCheckpointIO" else AsyncCheckpointIO(writer), writer)


CLONE_ONLY = "ceiling: clone only, nothing written"


def lightning_run(kind: str, steps: int, every: int, directory: Path, width: int) -> tuple[Timings, float]:
    """One training run; the (stall, durable) of each save and the run's wall time."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from crashsafe.workloads import lightning_digits as job

    shutil.rmtree(directory, ignore_errors=True)
    io = _lightning_io(kind)
    module = job.DigitsModule(width=width, data_dir=directory)
    checkpoint = ModelCheckpoint(dirpath=directory, every_n_train_steps=every, save_last=True)
    trainer = job.make_trainer(steps, [io], [checkpoint], directory)
    begin = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    wall = time.perf_counter() - begin
    if kind == "crashsafe":
        timings = [(s.stall, s.durable, s.name == "last.ckpt") for s in io.stats]
    else:
        timings = io.timings
    shutil.rmtree(directory, ignore_errors=True)
    return timings, wall


# ---------------------------------------------------------------- Hugging Face


def hf_run(kind: str, steps: int, every: int, directory: Path, width: int = 0) -> tuple[Timings, float]:
    from transformers import Trainer

    from crashsafe.integrations.transformers import CrashsafeTrainer
    from crashsafe.workloads import hf_tiny

    shutil.rmtree(directory, ignore_errors=True)
    timings: Timings = []
    begun: dict[int, tuple[float, float]] = {}  # step -> (begin, returned)
    base = CrashsafeTrainer if kind == "crashsafe" else Trainer
    writer = ThreadPoolExecutor(1)  # the floor's background writes
    written: list[tuple[float, float, Future[float]]] = []  # (begin, returned, when durable)

    class Timed(base):  # type: ignore[misc, valid-type]
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            begin = time.perf_counter()
            if kind == FLOOR:  # clone, then write and fsync in the background
                copied = _gather_and_clone(self)
                path = directory / f"floor-{self.state.global_step}.pt"
                written.append((begin, time.perf_counter(), writer.submit(_write_fsynced, copied, path)))
                return
            super()._save_checkpoint(model, trial)
            returned = time.perf_counter()
            begun[self.state.global_step] = (begin, returned)
            if kind != "crashsafe":
                _fsync_tree(directory / f"checkpoint-{self.state.global_step}")
                timings.append((returned - begin, time.perf_counter() - begin, False))

    trainer = Timed(
        model=hf_tiny.tiny_gpt2(),
        args=hf_tiny.training_args(directory, steps, every, logging_steps=1000),
        train_dataset=hf_tiny.TokenData(),
    )
    started: dict[int, float] = {}  # step -> when the writer thread began its commit
    if kind == "crashsafe":
        manager = trainer.checkpoints
        persist = manager._persist

        def timed_persist(store: Any, step: int, *args: Any) -> Any:
            started[step] = time.perf_counter()
            return persist(store, step, *args)

        manager._persist = timed_persist
    begin = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - begin
    if kind == "crashsafe":
        stats = trainer.checkpoints.stats
        trainer.close()
        for s in stats:  # durable: until committed (SaveStats.persist ends there, before retention)
            first, returned = begun[s.step]
            timings.append((returned - first, started[s.step] + s.persist - first, False))
    writer.shutdown()
    timings += [(returned - first, durable.result() - first, False) for first, returned, durable in written]
    shutil.rmtree(directory, ignore_errors=True)
    return timings, wall


FLOOR = "floor: clone, then torch.save + fsync on a thread"


def _gather_and_clone(trainer: Any) -> dict[str, Any]:
    """The least an async save does in HF's save call: HF's bookkeeping, the state_dicts and RNG
    states a resume needs (as crashsafe's trainer saves them), and a clone of every tensor in one
    walk (as Lightning's AsyncCheckpointIO copies); no check of any value."""
    from lightning_utilities.core.apply_func import apply_to_collection

    from crashsafe.integrations.transformers import _record_callback_state
    from crashsafe.state.rng import RNGState

    trainer.store_flos()
    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        _record_callback_state(trainer.state, callback)
    state = {
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.lr_scheduler.state_dict(),
        "rng": RNGState().state_dict(),
        "trainer_state": dict(vars(trainer.state)),
        "hf_config": trainer.model.config.to_dict(),
    }
    copied: dict[str, Any] = apply_to_collection(state, torch.Tensor, lambda t: t.detach().clone())
    return copied


def _write_fsynced(state: dict[str, Any], path: Path) -> float:
    """The floor's background write: one torch.save file (no checksum, no atomic commit), fsynced
    with its directory; returns when it is durable."""
    torch.save(state, path)
    fsync_path(path)
    fsync_path(path.parent)
    return time.perf_counter()


# ---------------------------------------------------------------- the floor


def _median_ms(work: Callable[[int], object], n: int) -> float:
    work(-1)
    times = []
    for i in range(n):
        begin = time.perf_counter()
        work(i)
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def floor(width: int, n: int) -> list[tuple[str, float]]:
    """The fixed costs a save is made of, for the digits CNN's real Lightning checkpoint dict."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins import TorchCheckpointIO

    import crashsafe as cs
    from crashsafe.integrations.lightning import CrashsafeCheckpointIO
    from crashsafe.integrations.pointer import Pointer, write_pointer
    from crashsafe.state.rng import RNGState
    from crashsafe.state.snapshot import fast_copy
    from crashsafe.state.staging import StagingPool, detached_copy
    from crashsafe.workloads import lightning_digits as job

    directory = WORK / "floor"
    shutil.rmtree(directory, ignore_errors=True)
    module = job.DigitsModule(width=width, data_dir=directory)
    checkpoint_cb = ModelCheckpoint(dirpath=directory, every_n_train_steps=1000)
    trainer = job.make_trainer(4, [CrashsafeCheckpointIO()], [checkpoint_cb], directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    tensors = [t for t in _tensors(checkpoint)]
    copies = [torch.empty_like(t) for t in tensors]
    pool = StagingPool()
    torch_io = TorchCheckpointIO()
    rows: list[tuple[str, float]] = []

    def memcpy(_: int) -> None:
        for t, c in zip(tensors, copies, strict=True):
            c.copy_(t)

    def torch_save_bytes(_: int) -> None:
        torch.save(checkpoint, io.BytesIO())

    def small_atomic_file(i: int) -> None:  # the fixed durable cost of one new file, atomically
        tmp = directory / "small.tmp"
        with open(tmp, "wb") as f:
            f.write(b"x" * 300)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / "small")
        fsync_path(directory)

    def torch_io_fsynced(_: int) -> None:
        torch_io.save_checkpoint(checkpoint, directory / "t.ckpt")
        fsync_path(directory / "t.ckpt")
        fsync_path(directory)

    tiny = cs.CheckpointManager(directory / "tiny", keep_last=None, async_save=False)
    whole = cs.CheckpointManager(directory / "whole", keep_last=None, async_save=False)
    state = {"lightning": checkpoint, "rng": RNGState()}
    rows += [
        ("copy_ of the checkpoint's tensors into preallocated tensors (what any async save copies)",
         _median_ms(memcpy, n)),
        ("crashsafe's copy at a later save (fast_copy: containers, tensors into staging)",
         _median_ms(lambda _: fast_copy(state, pool), n)),
        ("crashsafe's checked copy (detached_copy, the first save of a run)",
         _median_ms(lambda _: detached_copy(state, pool), n)),
        ("torch.save into memory (TorchCheckpointIO's serialization)", _median_ms(torch_save_bytes, n)),
        ("TorchCheckpointIO.save_checkpoint (no fsync): its stall", _median_ms(
            lambda _: torch_io.save_checkpoint(checkpoint, directory / "t.ckpt"), n)),
        ("TorchCheckpointIO.save_checkpoint + fsync file + fsync dir: its durable",
         _median_ms(torch_io_fsynced, n)),
        ("a 300-byte file: write, fsync, rename, fsync dir (1 file's fixed cost)",
         _median_ms(small_atomic_file, n)),
        ("crashsafe pointer file (write_pointer: the same protocol)",
         _median_ms(lambda _: write_pointer(directory / "p.ckpt", Pointer("p.ckpt", 1, "0" * 16, True)), n)),
        ("crashsafe commit of a 1-value state (data + manifest + dir fsynced, rename, root fsynced)",
         _median_ms(lambda i: tiny.save(i + 1, {"x": 1}), n)),
        ("crashsafe commit of this checkpoint (synchronous CheckpointManager.save)",
         _median_ms(lambda i: whole.save(i + 1, state), n)),
    ]  # fmt: skip
    tiny.close()
    whole.close()
    shutil.rmtree(directory, ignore_errors=True)
    return rows


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


# ---------------------------------------------------------------- report


def _summary(timings: Timings) -> tuple[float, float, float, float, float]:
    """Median stall, median durable, worst stall, and the median durable of first and of second
    saves of a step (``save_last``'s ``last.ckpt``; nan if none) of one run."""
    stalls = [s for s, _, _ in timings]
    firsts = [d for _, d, second in timings if not second]
    seconds = [d for _, d, second in timings if second]
    return (
        statistics.median(stalls),
        statistics.median(d for _, d, _ in timings),  # nan for a run that writes nothing
        max(stalls),
        statistics.median(firsts) if firsts else math.nan,
        statistics.median(seconds) if seconds else math.nan,
    )


def _state_mib(width: int) -> float:
    from crashsafe.workloads import lightning_digits as job

    module = job.DigitsModule(width=width)
    return sum(p.numel() * p.element_size() for p in module.parameters()) * 3 / 2**20  # + Adam's two


def bench(
    title: str,
    run: Callable[[str, int, int, Path, int], tuple[Timings, float]],
    kinds: list[str],
    steps: int,
    repeat: int,
    width: int = 0,
    every: int = 4,
) -> list[str]:
    """Run every kind ``repeat`` times, interleaved; the table of the best run of each."""
    runs: dict[str, list[tuple[tuple[float, ...], int, float]]] = {k: [] for k in kinds}
    for r in range(repeat):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            timings, wall = run(kind, steps, every, WORK / kind.replace(" ", "_"), width)
            runs[kind].append((_summary(timings), len(timings), wall))
    best = {kind: min(found) for kind, found in runs.items()}  # by median stall
    (default_stall, default_durable, *_), _, _ = best[kinds[0]]
    split = width > 0  # Lightning: first and second (last.ckpt) saves of a step apart
    lines = [
        f"## {title}",
        "",
        "| checkpointing | saves | stall (median) | stall / default | worst stall | durable (median) "
        "| durable / default |" + (" durable: 1st save of a step / `last.ckpt` |" if split else "")
        + " training run (wall) |",
        "|---|---|---|---|---|---|---|" + ("---|" if split else "") + "---|",
    ]
    for kind, ((stall, durable, worst, first, second), saves, wall) in best.items():
        written = not math.isnan(durable)  # else: nothing was written
        parts = f"| {first * 1e3:.1f} / {second * 1e3:.1f} ms " if written else "| - "
        lines.append(
            f"| {kind} | {saves} | {stall * 1e3:.2f} ms | {stall / default_stall:.2f}x "
            f"| {worst * 1e3:.1f} ms "
            + (f"| {durable * 1e3:.1f} ms | {durable / default_durable:.2f}x " if written else "| - | - ")
            + (parts if split else "")
            + f"| {wall:.2f} s |"
        )
        print(f"  {title} {kind}: stall {stall * 1e3:.2f} ms, durable {durable * 1e3:.1f} ms", flush=True)
    if FLOOR in best:
        (floor_stall, floor_durable, *_), _, _ = best[FLOOR]
        lines += ["", f"- the floor (an async save that does less than any crashsafe save: no check, no "
                  f"checksum, no atomic commit): stall {floor_stall / default_stall:.2f}x, durable "
                  f"{floor_durable / default_durable:.2f}x {kinds[0]}'s; crashsafe's stall = "
                  f"{best['crashsafe'][0][0] / floor_stall:.2f}x the floor's"]  # fmt: skip
    if CLONE_ONLY in best:
        ceiling = best[CLONE_ONLY][0][0] / default_stall
        lines += ["", f"- the ceiling (the clone alone, which any save that returns before writing makes, "
                  f"with no thread beside training): stall {ceiling:.2f}x {kinds[0]}'s; target <= 0.2x: "
                  f"{'within reach' if ceiling <= 0.2 else 'out of reach of any such save'}"]  # fmt: skip
    (stall, durable, *_), _, _ = best["crashsafe"]
    s_ratio, d_ratio = stall / default_stall, durable / default_durable
    lines += [
        "",
        f"- crashsafe stall = **{s_ratio:.2f}x** {kinds[0]}'s (target <= 0.2x: "
        f"**{'met' if s_ratio <= 0.2 else 'missed'}**); durable = **{d_ratio:.2f}x** (target <= 1.0x: "
        f"**{'met' if d_ratio <= 1.0 else 'missed'}**)",
        "",
    ]
    return lines


def _reading(small: list[float], large: list[float]) -> list[str]:
    """What the floor says about the ratios in training (rows in ``floor``'s order)."""
    fast, torch_stall, torch_durable, pointer, commit = 1, 4, 5, 7, 9
    return [
        "## Reading",
        "",
        f"- **Stall, small state.** crashsafe's copy alone takes {small[fast]:.2f} ms, "
        f"{small[fast] / small[torch_stall]:.2f}x of TorchCheckpointIO's save alone "
        f"({small[torch_stall]:.2f} ms): "
        "at 0.8 MiB the copy is a walk over Lightning's ~230 values and ~30 tensors, not bytes. In training "
        "the same walk costs about twice as much (the training step has just evicted what it touches): "
        "the ceiling row, a bare clone of Lightning's dict with no thread and nothing written, already "
        "stalls about 0.2x, so the target leaves nothing for handing the copy to a writer thread that then "
        "shares the GIL and the 2 cores with training (a `last.ckpt` save comes right after its step's "
        "first save, while that one commits). Lightning's own AsyncCheckpointIO, the clone plus that "
        "hand-over, is the comparable async save (its row above).",
        f"- **Durable, small state.** A commit of this checkpoint alone takes {small[commit]:.2f} ms "
        f"({small[commit] / small[torch_durable]:.2f}x of TorchCheckpointIO + fsync alone, "
        f"{small[torch_durable]:.2f} ms), and a first save of a new file name adds its pointer file "
        f"({small[pointer]:.2f} ms: write, fsync, rename, directory fsync), so the first save of a step "
        "costs about a commit and a pointer, and `last.ckpt`, queued behind it, about two commits: at this "
        "size the fixed fsync rounds of an atomic, verified commit (data, manifest and directory "
        "fsynced before the rename, the root after it) decide, and the target of 1.0x is out of reach "
        "of this design (one crashsafe step + one pointer file per Lightning path, one writer thread). "
        "The quieter the disk, the larger the ratio: an fsync round costs well under 1 ms on an idle "
        "disk and several ms on a busy one, and TorchCheckpointIO + fsync pays about one.",
        f"- **Durable, ~100 MiB.** A commit alone takes {large[commit]:.0f} ms, "
        f"{large[commit] / large[torch_durable]:.2f}x of TorchCheckpointIO + fsync alone "
        f"({large[torch_durable]:.0f} ms). In training it shares the CPU with the training step "
        "(TorchCheckpointIO has it alone while training waits) and `last.ckpt` waits for the first save "
        "of its step: compare the first-save column, where no save is queued ahead.",
        "",
    ]


def _header(args: argparse.Namespace, steps: int, repeat: int) -> list[str]:
    load = os.getloadavg()
    disk = "unknown"
    try:
        device = os.stat(WORK).st_dev
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if os.path.exists(fields[1]) and os.stat(fields[1]).st_dev == device:
                disk = f"{fields[2]} ({fields[0]})"
    except OSError:
        pass
    command = "python -m bench integrations" + (" --quick" if args.quick else f" --repeat {repeat}")
    return [
        "# Integrations: stall and durable time inside Lightning and Hugging Face training",
        "",
        f"Produced by `{command}` (what `make bench BENCH=integrations` runs) on "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC: {os.cpu_count()} cores ({platform.machine()}), "
        f"Linux {platform.release()}, {disk}, Python {platform.python_version()}, torch {torch.__version__}, "
        f"1 torch thread. Load average at the start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} "
        "(1/5/15 min; the machine is shared: ratios are taken within one run).",
        "",
        "Each section names its training steps and save interval (Lightning: "
        "`ModelCheckpoint(every_n_train_steps=N, save_last=True)`, so two saves per step saved; HF: "
        "`save_steps=N`). The small Lightning module runs twice: once with about 0.1 s of training "
        "between saves, once with a save every 4 steps (~30 ms apart, faster than this disk commits "
        "twice: a background writer falls behind, and crashsafe's `in_flight=2` then makes training "
        "wait, where AsyncCheckpointIO's queue grows without bound). "
        f"Median over the saves of a run, best of {repeat} runs (by median stall), the "
        "methods interleaved. **Stall** = time the training thread spends in the framework's save call "
        "(Lightning: `CheckpointIO.save_checkpoint`, after Lightning built its checkpoint dict, which "
        "every IO shares; HF: `Trainer._save_checkpoint`). **Durable** = from the start of that call "
        "until the checkpoint is on disk: Lightning and HF do not fsync, so an fsync of each file they "
        "wrote and of its directory is added after their write (not counted as their stall); "
        "crashsafe's is its atomic commit (+ for Lightning the pointer file at Lightning's path, "
        "when it names a new file). A background save's durable includes its wait behind the save "
        "before it (`save_last` saves twice per step). See `bench/integrations.py`.",
        "",
    ]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench integrations")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer steps, one repeat")
    args = parser.parse_args(argv)
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(1)
    WORK.mkdir(parents=True, exist_ok=True)
    tempfile.tempdir = str(WORK)
    repeat, steps = (1, 24) if args.quick else (args.repeat, 60)
    lines = _header(args, steps, repeat)
    kinds = ["TorchCheckpointIO", "AsyncCheckpointIO", "crashsafe"]
    small, large = _state_mib(64), _state_mib(LARGE_WIDTH)
    lines += bench(f"Lightning digits CNN, width 64 ({small:.1f} MiB of state): {steps * 3} steps, a save "
                   "every 16", lightning_run, [*kinds, CLONE_ONLY], steps * 3, repeat, width=64,
                   every=16)  # fmt: skip
    lines += bench(f"Lightning digits CNN, width 64, saves faster than the disk commits: {steps} steps, a "
                   "save every 4", lightning_run, [*kinds, CLONE_ONLY], steps, repeat, width=64,
                   every=4)  # fmt: skip
    lines += bench(f"Lightning digits CNN, width {LARGE_WIDTH} ({large:.0f} MiB of state): {steps // 2} "
                   "steps, a save every 4", lightning_run, kinds, steps // 2, repeat,
                   width=LARGE_WIDTH)  # fmt: skip
    lines += bench(f"HF tiny GPT-2 (Trainer): {steps} steps, a save every 4", hf_run,
                   ["HF save_steps", "crashsafe", FLOOR], steps, repeat)  # fmt: skip
    small_floor, large_floor = floor(64, 15), floor(LARGE_WIDTH, 5)
    lines += [
        "## The floor: the parts of one save, alone (no training running; medians of 15 / 5)",
        "",
        f"| what | width 64 ({small:.1f} MiB) | width {LARGE_WIDTH} ({large:.0f} MiB) |",
        "|---|---|---|",
        *(
            f"| {what} | {ms:.2f} ms | {big:.1f} ms |"
            for (what, ms), (_, big) in zip(small_floor, large_floor, strict=True)
        ),
        "",
    ]
    lines += _reading([ms for _, ms in small_floor], [ms for _, ms in large_floor])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "integrations.md").write_text("\n".join(lines))
    print("\n".join(lines))
    shutil.rmtree(WORK, ignore_errors=True)
