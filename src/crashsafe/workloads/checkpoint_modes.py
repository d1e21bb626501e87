"""Iterative workloads (KMeans, GMM) checkpointed after every iteration in one of six modes.

========== =====================================================================================
mode       how the state of each iteration is kept
========== =====================================================================================
shelf      the state lives on a :class:`~crashsafe.shelf.Shelf`; one commit per iteration
savez      ``np.savez`` over the same file, no fsync (PyMM's baseline; a crash can tear it)
savez-safe ``np.savez`` to a temporary file, fsync, atomic rename, fsync of the directory
pickle     ``pickle.dump`` over the same file, no fsync (a baseline only)
torch.save ``torch.save`` over the same file, no fsync (the common idiom)
manager    crashsafe's :class:`~crashsafe.CheckpointManager` (async, keep_last=2)
========== =====================================================================================

Run from the command line (used by the crash tests)::

    python -m crashsafe.workloads.checkpoint_modes --algo kmeans --k 8 --data blobs:2000:16:8 \\
        --mode shelf --dir /dev/shm/run --max-iter 200 --out result.npz
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from crashsafe.errors import CrashsafeError
from crashsafe.shelf.errors import ShelfError
from crashsafe.workloads.iterative import Algorithm, Allocate

__all__ = ["MODES", "ModeStore", "RunResult", "UnreadableCheckpointError", "main", "open_mode", "run"]

MODES = ("shelf", "savez", "savez-safe", "pickle", "torch.save", "manager")
_Array = np.ndarray[Any, Any]


class ModeStore(Protocol):
    """Where a workload checkpoints.

    ``output()`` is called before each iteration: it returns where the iteration should put its
    new arrays (None: anywhere), which lets the shelf have them computed in place. ``save``
    commits the iteration's state and returns the state to continue from.
    """

    def load(self) -> dict[str, Any] | None: ...

    def output(self) -> Allocate | None: ...

    def save(self, state: Mapping[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


class UnreadableCheckpointError(CrashsafeError, ValueError):
    """A baseline mode's checkpoint file cannot be read back (typically torn by a crash)."""


def _nbytes(state: Mapping[str, Any]) -> int:
    return sum(v.nbytes for v in state.values() if isinstance(v, np.ndarray))


class ShelfStore:
    """The state lives on a shelf. With shadow transactions (the default) the iterations run in a
    :meth:`Shelf.loop <crashsafe.shelf.Shelf.loop>`: ``output`` begins an iteration and hands the
    loop's spare blocks to the computation, which writes its new arrays straight into them, and
    ``save`` commits them with the scalars as one loop record. With undo transactions ``save``
    copies the new arrays over the old ones in place (PyMM's way), after saving the old bytes to
    the undo log, in one transaction per iteration. The first state, a state the loop cannot hold
    (new shapes or variables, a str), and undo mode go through ``Shelf.update``.

    ``load`` returns arena-backed views: a resumed run reads its state straight from the shelf."""

    FILE = "state.shelf"

    def __init__(self, directory: Path, durability: str = "auto", tx_mode: str = "shadow") -> None:
        self.path = directory / self.FILE
        self.durability = durability
        self.tx_mode = tx_mode
        self.shelf: Any = None
        self.recovered: Any = None
        self.loop: Any = None
        if self.path.exists():
            self._open(None)

    def _open(self, size: int | None) -> None:
        from crashsafe.shelf import Shelf

        self.shelf = Shelf(self.path, size, durability=self.durability, tx_mode=self.tx_mode)  # type: ignore[arg-type]
        self.recovered = self.shelf.recovered

    def load(self) -> dict[str, Any] | None:
        if self.shelf is None or "iteration" not in self.shelf:
            return None
        state = {name: self.shelf[name] for name in self.shelf}
        self._start_loop(state)
        return state

    def _start_loop(self, state: Mapping[str, Any]) -> None:
        from crashsafe.shelf.loop_record import is_loop_scalar

        loopable = all(isinstance(v, np.ndarray) or is_loop_scalar(v) for v in state.values())
        self.loop = self.shelf.loop(list(state)) if self.tx_mode == "shadow" and loopable else None

    def output(self) -> Allocate | None:
        if self.loop is None:
            return None
        spares: dict[str, _Array] = self.loop.begin()

        def allocate(name: str, shape: tuple[int, ...]) -> _Array:
            spare = spares.get(name)
            return spare if spare is not None and spare.shape == shape else np.empty(shape)

        return allocate

    def save(self, state: Mapping[str, Any]) -> dict[str, Any]:
        loop = self.loop
        if loop is not None:
            try:
                loop.commit(state)
            except ShelfError:  # not begun, or a state the loop cannot hold (new shapes or variables)
                loop.abort()
            else:
                return {**state, **loop.arrays}
        if self.shelf is None:
            self._open(max(16 << 20, 4 * _nbytes(state) + (1 << 20)))
        self.shelf.update(state)
        saved = {name: self.shelf[name] if isinstance(value, np.ndarray) else value
                 for name, value in state.items()}
        self._start_loop(saved)
        return saved

    def close(self) -> None:
        if self.shelf is not None:
            self.shelf.close()  # an iteration cut short by an exception is rolled back


class _FileStore:
    """A baseline: one file, written by ``_write``; ``safe`` adds temp file + fsync + rename."""

    suffix = ""

    def __init__(self, directory: Path, safe: bool = False) -> None:
        self.path = directory / f"state{self.suffix}"
        self.safe = safe

    def save(self, state: Mapping[str, Any]) -> dict[str, Any]:
        if not self.safe:
            with open(self.path, "wb") as f:
                self._write(f, state)
            return dict(state)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            self._write(f, state)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return dict(state)

    def load(self) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        try:
            return self._read()
        except Exception as exc:
            raise UnreadableCheckpointError(
                f"the checkpoint {self.path} cannot be read ({type(exc).__name__}: {exc}); a crash "
                "probably tore it while it was being overwritten. Start over, or use a crash-safe mode."
            ) from None

    def output(self) -> Allocate | None:
        return None

    def _write(self, f: Any, state: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _read(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        return None


class SavezStore(_FileStore):
    suffix = ".npz"

    def _write(self, f: Any, state: Mapping[str, Any]) -> None:
        np.savez(f, **state)

    def _read(self) -> dict[str, Any]:
        with np.load(self.path) as npz:
            return {name: npz[name] for name in npz.files}


class PickleStore(_FileStore):
    suffix = ".pkl"

    def _write(self, f: Any, state: Mapping[str, Any]) -> None:
        pickle.dump(dict(state), f, protocol=pickle.HIGHEST_PROTOCOL)

    def _read(self) -> dict[str, Any]:
        with open(self.path, "rb") as f:
            state: dict[str, Any] = pickle.load(f)  # a baseline reading its own file
        return state


class TorchStore(_FileStore):
    suffix = ".pt"

    def _write(self, f: Any, state: Mapping[str, Any]) -> None:
        import torch

        torch.save({k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}, f)

    def _read(self) -> dict[str, Any]:
        import torch

        loaded = torch.load(self.path, weights_only=True)
        return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in loaded.items()}


class ManagerStore:
    """crashsafe's CheckpointManager, one committed step per iteration."""

    def __init__(self, directory: Path) -> None:
        from crashsafe.manager import CheckpointManager

        self.manager = CheckpointManager(directory / "ckpt", keep_last=2, async_save=True)

    def load(self) -> dict[str, Any] | None:
        if self.manager.latest_step() is None:
            return None
        return self.manager.load(numpy=True)

    def output(self) -> Allocate | None:
        return None

    def save(self, state: Mapping[str, Any]) -> dict[str, Any]:
        self.manager.save(int(state["iteration"]), dict(state))
        return dict(state)

    def close(self) -> None:
        self.manager.close()


def open_mode(mode: str, directory: str | os.PathLike[str], *, durability: str = "auto",
               tx_mode: str = "shadow") -> ModeStore:
    """The store of ``mode`` (one of :data:`MODES`) in ``directory`` (created if missing)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    stores: dict[str, Any] = {
        "shelf": lambda: ShelfStore(path, durability, tx_mode),
        "savez": lambda: SavezStore(path),
        "savez-safe": lambda: SavezStore(path, safe=True),
        "pickle": lambda: PickleStore(path),
        "torch.save": lambda: TorchStore(path),
        "manager": lambda: ManagerStore(path),
    }
    if mode not in stores:
        raise ValueError(f"unknown checkpoint mode {mode!r}; choose one of {', '.join(MODES)}")
    store: ModeStore = stores[mode]()
    return store


@dataclass
class RunResult:
    """Final state, where the run resumed from, and the measured times (seconds)."""

    state: dict[str, Any]
    resumed_from: int | None
    checkpoint_times: list[float] = field(default_factory=list)
    total_time: float = 0.0


def run(algo: Algorithm, x: _Array, store: ModeStore, max_iter: int,
        started: Callable[[], None] | None = None) -> RunResult:
    """Run ``algo`` on ``x`` until done or ``max_iter`` iterations, checkpointing every iteration.

    Resumes from the store's state if it has one. A per-iteration checkpoint time is everything
    the store does for that iteration (``output``, its allocations, ``save``); ``total_time``
    includes them and the computation.
    """
    begin = time.perf_counter()
    state = store.load()
    resumed = None if state is None else int(state["iteration"])
    if state is None:
        state = store.save(algo.init_state(x))
    if started is not None:
        started()  # the store holds a state from here on
    times = []
    while not bool(state["done"]) and int(state["iteration"]) < max_iter:
        start = time.perf_counter()
        out = store.output()
        spent = [time.perf_counter() - start]
        new = algo.step(x, state, None if out is None else _timed(out, spent))
        start = time.perf_counter()
        state = store.save(new)
        times.append(sum(spent) + time.perf_counter() - start)
    final = {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}
    return RunResult(final, resumed, times, time.perf_counter() - begin)


def _timed(out: Allocate, spent: list[float]) -> Allocate:
    """``out``, adding the time each call takes to ``spent`` (it is checkpoint cost, not compute)."""

    def allocate(name: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        start = time.perf_counter()
        try:
            return out(name, shape)
        finally:
            spent.append(time.perf_counter() - start)

    return allocate


def make_algorithm(name: str, k: int, seed: int, tol: float | None) -> Algorithm:
    """``kmeans`` or ``gmm`` with ``k`` clusters/components."""
    from crashsafe.workloads.gmm import GMM
    from crashsafe.workloads.kmeans import KMeans

    if name == "kmeans":
        return KMeans(k=k, seed=seed, tol=tol)
    if name == "gmm":
        return GMM(k=k, seed=seed, tol=tol)
    raise ValueError(f"unknown algorithm {name!r}; use kmeans or gmm")


def main(argv: list[str] | None = None) -> int:
    """Command line: run one workload in one mode; prints ``ready`` once the store holds a state."""
    from crashsafe.workloads.clusterdata import load

    parser = argparse.ArgumentParser(prog="python -m crashsafe.workloads.checkpoint_modes")
    parser.add_argument("--algo", choices=["kmeans", "gmm"], required=True)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tol", type=float, default=None, help="stop tolerance (default: run max-iter)")
    parser.add_argument("--data", default="digits", help="digits, mnist_like[:N] or blobs:N:D:C[:SEED]")
    parser.add_argument("--mode", choices=MODES, default="shelf")
    parser.add_argument("--dir", required=True, help="where the checkpoint lives")
    parser.add_argument("--durability", choices=["auto", "process", "power"], default="auto")
    parser.add_argument("--tx-mode", choices=["undo", "shadow"], default="shadow")
    parser.add_argument("--max-iter", type=int, default=100)
    parser.add_argument("--out", help="write the final state here (npz, atomically)")
    args = parser.parse_args(argv)
    x = load(args.data)
    algo = make_algorithm(args.algo, args.k, args.seed, args.tol)
    store = open_mode(args.mode, args.dir, durability=args.durability, tx_mode=args.tx_mode)
    recovered = getattr(store, "recovered", None) is not None

    def started() -> None:
        print(f"ready recovered={recovered}", flush=True)

    try:
        result = run(algo, x, store, args.max_iter, started)
    finally:
        store.close()
    print(f"done iterations={result.state['iteration']} resumed_from={result.resumed_from}", flush=True)
    if args.out:
        out = Path(args.out)
        tmp = out.with_name(out.name + ".tmp.npz")
        np.savez(tmp, **result.state)
        with contextlib.suppress(FileNotFoundError):
            os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
