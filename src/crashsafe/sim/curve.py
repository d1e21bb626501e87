"""Training loss curves for the simulator: recorded (CSV) or modelled, per optimizer step."""

from __future__ import annotations

import csv
import io
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from crashsafe.sim.errors import SimulationError

__all__ = ["MAX_FILE_BYTES", "MAX_STEPS", "LossCurve", "read_text_file"]

MAX_FILE_BYTES = 256 << 20  # a loss curve or failure trace larger than this is not one the simulator needs
MAX_STEPS = 10_000_000  # a recorded curve spans at most this many steps (its arrays are ~80 MB each)


def read_text_file(path: Path, what: str) -> str:
    """The UTF-8 text of the regular file at ``path`` (``what`` it is, for messages), at most
    :data:`MAX_FILE_BYTES`. A FIFO, device or directory is refused at once: a blocking open of a FIFO
    would wait forever for a writer, and a device could be read forever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise SimulationError(f"cannot read {what} {path}: {exc.strerror or exc}; check the path") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SimulationError(
                f"{what} {path} is not a regular file (a FIFO, device or directory); give a file's path"
            )
        data = _read_bounded(fd, path, what)
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SimulationError(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _read_bounded(fd: int, path: Path, what: str) -> bytes:
    """All of ``fd`` if it holds at most :data:`MAX_FILE_BYTES`, else a SimulationError."""
    chunks, size = [], 0
    try:
        while chunk := os.read(fd, min(1 << 24, MAX_FILE_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_FILE_BYTES:
                raise SimulationError(
                    f"{what} {path} is larger than {MAX_FILE_BYTES >> 20} MiB; the simulator needs far "
                    "less: keep every k-th row (rows may skip steps) or the part of the run to study"
                )
    except OSError as exc:
        raise SimulationError(f"cannot read {what} {path}: {exc.strerror or exc}; check the path") from None
    return b"".join(chunks)


@dataclass(frozen=True)
class LossCurve:
    """Loss after each optimizer step (``losses[i]`` = loss of step i+1), as recorded or modelled.

    ``step_time`` is the measured seconds per step when the recording had timestamps (else None).
    """

    losses: np.ndarray
    step_time: float | None = None
    name: str = "curve"
    _smooth: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        values = np.asarray(self.losses, dtype=np.float64)
        if values.ndim != 1 or values.size < 2:
            raise SimulationError(f"a loss curve needs at least 2 steps, got shape {values.shape}")
        finite = np.isfinite(values)
        if not finite.any():
            raise SimulationError("the loss curve has no finite value")
        if not finite.all():  # carry the last finite loss over NaN/inf steps (a diverged step)
            index = np.where(finite, np.arange(values.size), 0)
            np.maximum.accumulate(index, out=index)
            values = values[index]
            values[: np.argmax(finite)] = values[np.argmax(finite)]
        object.__setattr__(self, "losses", values)
        object.__setattr__(self, "_smooth", _monotone_smooth(values))

    @property
    def steps(self) -> int:
        return int(self.losses.size)

    @property
    def smooth(self) -> np.ndarray:
        """Moving average (1% of the run) made non-increasing: the progress the job has really made."""
        return self._smooth

    def progress_at(self, step: np.ndarray | float) -> np.ndarray:
        """Smoothed loss at fractional steps (0 = before the first step), interpolated."""
        grid = np.arange(self.steps + 1, dtype=np.float64)
        values = np.concatenate([[self._smooth[0]], self._smooth])
        out: np.ndarray = np.interp(np.asarray(step, dtype=np.float64), grid, values)
        return out

    def resample(self, steps: int) -> LossCurve:
        """The same curve over ``steps`` steps (linear interpolation over the fraction of the run)."""
        if steps < 2:
            raise SimulationError(f"resample needs steps >= 2, got {steps}")
        old = np.linspace(0.0, 1.0, self.steps)
        new = np.linspace(0.0, 1.0, steps)
        step_time = None if self.step_time is None else self.step_time * self.steps / steps
        return LossCurve(np.interp(new, old, self.losses), step_time, self.name)

    @classmethod
    def exponential(
        cls, theta1: float, theta2: float, steps: int, step_time: float, noise: float = 0.0, seed: int = 0
    ) -> LossCurve:
        """COCI's model L(t) = exp(θ1·t + θ2) (t in minutes), with optional multiplicative noise."""
        t_min = np.arange(1, steps + 1) * step_time / 60.0
        losses = np.exp(theta1 * t_min + theta2)
        if noise > 0:
            losses = losses * np.exp(noise * np.random.default_rng(seed).standard_normal(steps))
        return cls(losses, step_time, f"exp({theta1:g}·t{theta2:+g})")

    @classmethod
    def from_csv(cls, path: str | os.PathLike[str]) -> LossCurve:
        """Read a CSV with a ``loss`` column, and optionally ``step`` and ``time`` (seconds) columns.

        Rows may skip steps (logged every k steps): the loss is interpolated onto every step.
        """
        path = Path(path)
        try:
            rows = list(csv.DictReader(io.StringIO(read_text_file(path, "loss curve"), newline="")))
        except csv.Error as exc:
            raise SimulationError(f"{path} is not a CSV file ({exc}); write one row per step") from None
        if not rows or "loss" not in rows[0]:
            raise SimulationError(
                f"{path} needs a header with a 'loss' column (and optionally 'step', 'time'); "
                "write one with `crashsafe.sim.LossCurve.to_csv` or a row per step"
            )
        try:
            loss = np.array([float(r["loss"]) for r in rows])
            step = (np.array([float(r["step"]) for r in rows]) if "step" in rows[0]
                    else np.arange(1, len(rows) + 1.0))
            times = np.array([float(r["time"]) for r in rows]) if "time" in rows[0] else None
        except (TypeError, ValueError) as exc:
            raise SimulationError(f"{path}: a value is not a number ({exc})") from None
        if not np.all(np.isfinite(step)) or np.any(np.diff(step) <= 0):
            raise SimulationError(f"{path}: the 'step' column must be finite and increase strictly")
        if step[-1] - step[0] >= MAX_STEPS:
            raise SimulationError(
                f"{path} spans {step[-1] - step[0] + 1:.0f} steps; the simulator takes at most {MAX_STEPS}: "
                "count the steps in larger units (e.g. thousands), with the 'time' column to match"
            )
        every = np.arange(int(step[0]), int(step[-1]) + 1, dtype=np.float64)
        good = np.isfinite(loss)
        losses = np.interp(every, step[good], loss[good]) if good.any() else loss
        step_time = None
        if times is not None and len(times) > 1 and step[-1] > step[0]:
            step_time = float((times[-1] - times[0]) / (step[-1] - step[0]))
            if not (math.isfinite(step_time) and step_time > 0):
                raise SimulationError(f"{path}: the 'time' column must increase with the steps")
        return cls(losses, step_time, path.stem)

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write ``step,loss`` (and ``time`` when the step time is known)."""
        with Path(path).open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["step", "loss", "time"] if self.step_time else ["step", "loss"])
            for i, value in enumerate(self.losses, start=1):
                row = [i, repr(float(value))]
                writer.writerow([*row, repr(i * self.step_time)] if self.step_time else row)


def _monotone_smooth(values: np.ndarray) -> np.ndarray:
    window = max(1, values.size // 100)
    head, tail = np.full(window // 2, values[0]), np.full(window - 1 - window // 2, values[-1])
    padded = np.concatenate([head, values, tail])
    cumulative = np.concatenate([[0.0], np.cumsum(padded)])
    average = (cumulative[window:] - cumulative[:-window]) / window
    return np.minimum.accumulate(average)
