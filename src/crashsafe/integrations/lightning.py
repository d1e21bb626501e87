"""PyTorch Lightning: crashsafe checkpoints with one line (docs/integrations.md).

* ``Trainer(plugins=[CrashsafeCheckpointIO()])`` keeps Lightning's checkpoint model: the stock
  ``ModelCheckpoint`` decides what to save and delete (top-k, ``save_last``, ``every_n_train_steps``,
  re-saving one path) and ``fit(ckpt_path="last")`` resumes. Each path holds a pointer file
  (``integrations/pointer.py``) naming its step; the checkpoints live in ``.crashsafe/`` beside it
  (``integrations/lightning_folder.py``), committed atomically, verified on load, with fallback.
  Saving returns after a copy into staging buffers and, for a new name, its pointer file (Lightning
  links ``last.ckpt`` to it at once); a pointer whose step has not committed loads the newest
  committed step of its directory. Two saves may be in flight, so ``save_last``'s second save of a
  step does not wait for the first; a background thread writes, commits, then makes the pointer
  name it, durable and new (its mtime picks "last"), and deletes what a new checkpoint replaces
  unless a pointer file names it (Lightning's ``AsyncCheckpointIO`` contract: errors surface at the
  next save or at teardown). A directory's first checkpoint is saved synchronously.
* ``Trainer(callbacks=[CrashsafeCallback("ckpt", policy=...)])`` hands checkpointing wholly to a
  :class:`~crashsafe.CheckpointManager` (policies, codecs, retention, SIGTERM) and resumes from its
  newest intact step when ``fit`` starts.

Both save the RNG states with Lightning's checkpoint and restore them on resume, so a run resumed from
an epoch's end (or with data that follows Lightning's batch index) continues bit for bit; from
mid-epoch Lightning itself restarts the epoch's data (docs/integrations.md, "Which Lightning resumes
are exact"). Steps are numbered by Lightning's global step.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins import CheckpointIO, TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from crashsafe._log import through
from crashsafe.encoding import CodecSpec
from crashsafe.errors import CrashsafeError, NoCheckpointError
from crashsafe.format.manifest import MAX_STEP
from crashsafe.integrations.lightning_folder import CheckpointFolder, load_pointed, saved_steps
from crashsafe.integrations.pointer import (
    STORE,
    Pointer,
    is_pointer,
    names_itself,
    read_pointer,
    write_pointer,
)
from crashsafe.manager import CheckpointManager
from crashsafe.pending import Background
from crashsafe.policies.base import EverySteps, SavePolicy
from crashsafe.policies.retention import UNSET, KeepSpec, Unset
from crashsafe.state.rng import RNGState
from crashsafe.state.snapshot import fast_copy
from crashsafe.state.staging import StagingPool, detached_copy
from crashsafe.storage.lock import held_by

_BACKLOG = 8  # deferred removals and deletions done even while saves are queued
_LOG = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # where Lightning tells of its checkpoints
_PLUGIN_HOLDS = (
    "the CrashsafeCheckpointIO plugin of a Lightning Trainer, whose fit (or validate, test) is still "
    "running or did not end; it releases the directory when that ends, or call "
    "trainer.strategy.checkpoint_io.teardown() on that Trainer"
)
_CALLBACK_HOLDS = (
    "the CrashsafeCallback of a Lightning Trainer whose fit is still running or did not end; it "
    "releases the directory when that fit ends, or call callback.manager.close()"
)

__all__ = [
    "CrashsafeCallback",
    "CrashsafeCheckpointIO",
    "SaveTiming",
    "load_checkpoint",
    "load_from_checkpoint",
]


def _global_step(checkpoint: Mapping[str, Any]) -> int | None:
    """Lightning's global step in its checkpoint dict, if it is one a step can be numbered by."""
    step = checkpoint.get("global_step")
    return step if isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_STEP else None


def _cut_short(path: Path) -> bool:
    """An empty file beside a crashsafe store: a pointer whose un-fsynced write (a save returns before
    its pointer is durable) a power loss cut short. It loads as a pointer to its own name."""
    try:
        return path.stat().st_size == 0 and (path.parent / STORE).is_dir()
    except OSError:
        return False


def _map(checkpoint: dict[str, Any], map_location: Any) -> dict[str, Any]:
    """Tensors moved to ``map_location`` (a device or its name); loaded tensors are on the CPU."""
    if map_location is None:
        return checkpoint
    if not isinstance(map_location, (str, torch.device)):
        raise TypeError(
            f"map_location={map_location!r}: crashsafe checkpoints load on the CPU and move to a device "
            "given as a torch.device or its name; a function or a dict is not supported"
        )
    moved: dict[str, Any] = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(map_location))
    return moved


@dataclass(frozen=True)
class SaveTiming:
    """One save: how long training was blocked, and how long until it was committed (seconds)."""

    name: str
    stall: float
    durable: float


class CrashsafeCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes crashsafe checkpoints: ``Trainer(plugins=[...])``.

    Args:
        codec, lossless: as for :class:`~crashsafe.CheckpointManager` (delta codecs work, but a
            step that a kept step's delta needs is deleted only once no kept step needs it).
        restore_rng: loading a checkpoint also restores the python, numpy and torch RNGs saved with
            it (Lightning's own checkpoints do not save them, so its resumed runs draw other numbers).
        in_flight: saves that may be copied but not yet committed, each with its own staging copy
            of the state (memory: ``in_flight`` copies). Two let ``save_last``'s second save of a
            step return without waiting for the first to commit; 1 keeps a single copy.

    Every save copies and writes every tensor, frozen ones too (the manager sees the plugin's staging
    copy, never the live tensors it could prove unchanged); ``CrashsafeCallback`` refers to a frozen
    base instead (docs/integrations.md, "Fine-tuning").
    """

    def __init__(
        self,
        *,
        codec: CodecSpec = None,
        lossless: Sequence[str] = (),
        restore_rng: bool = True,
        in_flight: int = 2,
    ) -> None:
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, got {in_flight}")
        self._codec = codec
        self._lossless = tuple(lossless)
        self.restore_rng = restore_rng
        self._dirs: dict[Path, CheckpointFolder] = {}
        self._pools = [StagingPool(clones=False) for _ in range(in_flight)]  # copies land in save_checkpoint
        self._using: list[Future[None] | None] = [None] * in_flight  # the save each pool is staging
        self._saves = 0
        self._writer = Background("crashsafe-lightning")  # saves and removals, in order
        self._timings: deque[tuple[str, float, float, list[float]]] = deque(maxlen=1000)
        self._ended = False  # torn down: a Trainer's run ended, so a save holds its directory no longer

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Copy ``checkpoint`` into staging buffers, write its pointer if the name is new, and return;
        it commits in the background (a directory's first checkpoint: before returning). A
        background error is raised here, at the next save."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        begin = time.perf_counter()
        target = _local_path(path)
        slot = self._saves % len(self._pools)
        previous = self._using[slot]
        if previous is not None:
            previous.exception()  # its buffers are free once that save committed (or failed)
        self._raise_errors(done_only=True)
        held = self._open(target.parent)
        state, pool = {"lightning": checkpoint, "rng": RNGState()}, self._pools[slot]
        snapshot = fast_copy(state, pool) if self._saves else None
        if snapshot is None:  # the first save is checked in full here, so its errors come now
            snapshot = detached_copy(state, pool)
        pool.settle()  # CUDA tensors' copies landed: the writer thread reads the copy as it is
        first = not held.saved  # nothing committed here yet: a crash before this commit has no fallback
        name, step, key = target.name, held.number(_global_step(checkpoint)), secrets.token_hex(8)
        if not first and not names_itself(target):  # Lightning may link last.ckpt to it once we return
            _write(lambda: write_pointer(target, Pointer(name, step, key), durable=False), target)
        metrics = {k: float(checkpoint.get(k, 0)) for k in ("global_step", "epoch")}
        timing: list[float] = []  # when the checkpoint was committed and named

        def save(directory: CheckpointFolder) -> None:
            timing.append(directory.save(name, step, key, snapshot, metrics, first))

        self._using[slot] = self._submit(held, save)
        self._saves += 1
        if first:  # the writer names it after the commit
            self._settle()
        self._timings.append((target.name, begin, time.perf_counter(), timing))
        if self._ended:  # after its run (trainer.save_checkpoint once fit ended): committed, released
            self.teardown()

    @property
    def stats(self) -> list[SaveTiming]:
        """The last 1000 committed saves, oldest first: how long each blocked training (its copy and
        hand-over to the writer thread), and how long until its pointer named it."""
        return [
            SaveTiming(name, went_on - begin, timing[0] - begin)
            for name, begin, went_on, timing in self._timings
            if timing
        ]

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint a pointer file at ``path`` names (verified, with fallback); a plain
        ``torch.save`` file is loaded as Lightning would."""
        self._settle()
        real = Path(os.path.realpath(_local_path(path)))  # save_last="link" makes last.ckpt a link
        if real.exists() and not real.is_file():
            raise CrashsafeError(f"{path} is not a checkpoint file (a directory, a FIFO or a device)")
        if not is_pointer(real) and not _cut_short(real):
            loaded: dict[str, Any] = TorchCheckpointIO().load_checkpoint(path, map_location, weights_only)
            return loaded
        pointer = read_pointer(real) if is_pointer(real) else Pointer(real.name)
        held = self._dirs.get(real.parent)
        if held is None and not (real.parent / STORE).is_dir():
            raise NoCheckpointError(
                f"{path} is a crashsafe pointer file, but {real.parent / STORE} is not beside it: a pointer "
                "loads only in the folder it was saved in, beside its store. Move it back there"
            )
        with through(_LOG):  # "loaded step N (where, seconds)" beside Lightning's "Restoring states"
            if held is not None:
                state = load_pointed(held.mgr, held.saved, pointer, path)
            else:
                with CheckpointManager(real.parent / STORE, read_only=True) as reader:
                    state = load_pointed(reader, saved_steps(reader), pointer, path)
        if self.restore_rng:
            RNGState().load_state_dict(state["rng"])
        return _map(state["lightning"], map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint once the saves before it are committed; its steps are deleted when the
        writer is idle. With no writer thread (after ``teardown``: ``OnExceptionCheckpoint`` removes
        its file then) it is done here and the store closed again, so no lock outlives the run."""
        target = _local_path(path)
        if target.is_symlink() or not is_pointer(target):
            TorchCheckpointIO().remove_checkpoint(path)  # save_last="link"'s link, or a torch.save file
            return
        held = self._open(target.parent)
        if self._writer.running:
            self._submit(held, lambda directory: directory.remove(target.name))
            return
        try:
            held.remove(target.name)
            held.collect()
        finally:
            del self._dirs[target.parent]
            held.mgr.close()

    def wait(self) -> None:
        """Block until every save so far is committed (and its pointer written); raise its error."""
        self._settle()

    def teardown(self) -> None:
        """Wait for every pending save (raising its error), do the deferred removals, close the
        stores. Lightning calls it when a run (fit, validate, test) ends; from then on a save (or a
        removal) is committed before it returns and releases its directory again, so no lock
        outlives the run (the next Trainer of this process may write there)."""
        self._ended = True
        try:
            self._settle()
            for directory in self._dirs.values():
                directory.collect()
        finally:
            self._writer.close()
            for directory in self._dirs.values():
                directory.mgr.close()
            self._dirs.clear()
            for pool in self._pools:
                pool.clear()
            self._using = [None] * len(self._pools)

    def _submit(self, held: CheckpointFolder, work: Callable[[CheckpointFolder], None]) -> Future[None]:
        """Run ``work`` in the writer thread; then, if no other work is queued (or the backlog is
        long), the directory's deferred removals and deletions."""
        writer = self._writer

        def run() -> None:
            work(held)
            if not writer.waiting or held.backlog > _BACKLOG:
                held.collect(busy=lambda: writer.waiting and held.backlog <= _BACKLOG)

        return writer.submit(run)

    def _open(self, path: Path) -> CheckpointFolder:
        """The store of ``path``, opened (and its orphans dropped) at first use, here rather than in
        the writer thread: Lightning links into the directory as soon as a save returns."""
        held = self._dirs.get(path)
        if held is None:
            _write(lambda: path.mkdir(parents=True, exist_ok=True), path)
            with held_by(_PLUGIN_HOLDS):
                manager = CheckpointManager(
                    path / STORE, keep_last=None, async_save=False, codec=self._codec, lossless=self._lossless
                )
            held = self._dirs[path] = CheckpointFolder(path, manager)
            held.drop_orphans()
        return held

    def _settle(self) -> None:
        """Wait for the background work; raise the first error it met."""
        self._raise_errors(done_only=False)

    def _raise_errors(self, *, done_only: bool) -> None:
        """Forget finished background work (all of it, waiting, unless ``done_only``); raise the
        first error it met."""
        errors = self._writer.finished(wait=not done_only)
        if errors:
            raise CrashsafeError(
                f"saving a Lightning checkpoint in the background failed: {errors[0]!r}"
            ) from errors[0]


def _write(action: Callable[[], None], path: Path) -> None:
    """Run a file-system ``action`` on ``path`` in the training thread; its OSError as a CrashsafeError."""
    try:
        action()
    except OSError as exc:
        raise CrashsafeError(
            f"cannot write {path} ({exc.strerror or exc}); check that its directory is writable and has space"
        ) from exc


def _local_path(path: Any) -> Path:
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise CrashsafeError(
            f"{text}: CrashsafeCheckpointIO writes to local paths; for object stores use "
            "CrashsafeCallback(directory='s3://...') or CheckpointManager(mirror=...)"
        )
    return Path(text.removeprefix("file://")).absolute()


def load_checkpoint(path: str | os.PathLike[str], map_location: Any | None = None) -> dict[str, Any]:
    """The Lightning checkpoint dict at ``path`` (a pointer file written by CrashsafeCheckpointIO)."""
    io = CrashsafeCheckpointIO(restore_rng=False)
    try:
        return io.load_checkpoint(path, map_location)
    finally:
        io.teardown()


def load_from_checkpoint(
    cls: type[LightningModule], path: str | os.PathLike[str], map_location: Any | None = None, **kwargs: Any
) -> LightningModule:
    """``cls.load_from_checkpoint(path, ...)`` for a crashsafe checkpoint: the module built from the
    saved hyperparameters (``kwargs`` override them, ``strict=`` as Lightning's) with its weights."""
    from lightning.pytorch.core.saving import _load_state

    module = _load_state(cls, load_checkpoint(path, map_location), **kwargs)
    assert isinstance(module, LightningModule)
    return module


class _LazyState(Mapping[str, Any]):
    """A state built only when a save reads it: Lightning's full checkpoint dict is assembled only
    for the batches a policy chooses to save."""

    def __init__(self, build: Callable[[], dict[str, Any]]) -> None:
        self._build = build
        self._state: dict[str, Any] | None = None

    def _get(self) -> dict[str, Any]:
        if self._state is None:
            self._state = self._build()
        return self._state

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


class CrashsafeCallback(Callback):
    """Checkpointing by a :class:`~crashsafe.CheckpointManager`: ``Trainer(callbacks=[...])``.

    After every optimizer step the manager's policy decides whether to save (default: every
    ``every_n_steps``; pass ``policy=`` for ``cs.policies.Young(...)`` and the rest), with metrics from
    ``trainer.callback_metrics``; each step is numbered by Lightning's global step. When ``fit``
    starts, the newest intact step is restored (model, optimizers, schedulers, loops, callbacks,
    precision, RNG). The other arguments are the manager's (:class:`~crashsafe.CheckpointManager`):
    with ``unchanged`` (default True) a step refers to the tensors provably unchanged since the
    previous one (a frozen base) instead of copying and writing them again (docs/unchanged.md).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_n_steps: int = 100,
        resume: bool = True,
        policy: SavePolicy | None = None,
        keep: KeepSpec = None,
        keep_last: int | Unset | None = UNSET,
        keep_every: int | None = None,
        async_save: bool = True,
        codec: CodecSpec = None,
        lossless: Sequence[str] = (),
        save_on_sigterm: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        mirror: str | os.PathLike[str] | None = None,
        mirror_keep: KeepSpec = None,
        mirror_keep_last: int | Unset | None = UNSET,
        mirror_keep_every: int | None = None,
        pinned_bytes: int | None = None,
        unchanged: bool = True,
    ) -> None:
        self.directory = directory
        self.resume = resume
        self._options: dict[str, Any] = dict(  # the manager's arguments
            policy=policy if policy is not None else EverySteps(every_n_steps), keep=keep,
            keep_last=keep_last, keep_every=keep_every, async_save=async_save, codec=codec, lossless=lossless,
            save_on_sigterm=save_on_sigterm, storage_options=storage_options, mirror=mirror,
            mirror_keep=mirror_keep, mirror_keep_last=mirror_keep_last, mirror_keep_every=mirror_keep_every,
            pinned_bytes=pinned_bytes, unchanged=unchanged,
        )  # fmt: skip
        self.manager: CheckpointManager | None = None
        self._offered: int | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero and self.manager is None:
            with held_by(_CALLBACK_HOLDS):
                self.manager = CheckpointManager(self.directory, **self._options)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.resume or self.manager is None or self.manager.latest_step() is None:
            return
        with through(_LOG):  # "resumed from step N (where, seconds)", as Lightning says "Restoring states"
            state = self.manager.load()
        # Lightning has no public way to resume from a dict: hand it to its checkpoint connector, as
        # ``fit(ckpt_path=...)`` does. The model and callbacks are restored here; Lightning restores
        # the training state (precision, loops, optimizers, schedulers) right after this hook.
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = state["lightning"]
        connector.restore_model()
        connector.restore_datamodule()
        connector.restore_callbacks()
        RNGState().load_state_dict(state["rng"])

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.manager is None or step == self._offered:  # gradient accumulation: no new step yet
            return
        self._offered = step
        metrics = {
            k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1
        }

        def build() -> dict[str, Any]:
            return {
                "lightning": trainer._checkpoint_connector.dump_checkpoint(weights_only=False),
                "rng": RNGState(),
            }

        self.manager.maybe_save(step, _LazyState(build), metrics)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self.manager is not None:
            self.manager.close()
            self.manager = None
