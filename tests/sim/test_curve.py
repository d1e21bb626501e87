"""Loss curves (CSV, model, smoothing, resampling), end rules and policy replay."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crashsafe.policies import ConvergenceAware, EverySteps, Young, young_interval
from crashsafe.sim import FixedSteps, LossCurve, Plateau, Profile, SimulationError, TargetLoss, Trace, replay


def test_csv_round_trip_and_step_time(tmp_path: Path) -> None:
    curve = LossCurve(np.exp(-np.arange(100) / 20.0), step_time=0.5)
    curve.to_csv(tmp_path / "run.csv")
    back = LossCurve.from_csv(tmp_path / "run.csv")
    np.testing.assert_array_equal(back.losses, curve.losses)
    assert back.step_time == pytest.approx(0.5)


def test_csv_with_gaps_is_interpolated(tmp_path: Path) -> None:
    (tmp_path / "sparse.csv").write_text("step,loss\n1,1.0\n11,0.5\n21,nan\n31,0.25\n")
    curve = LossCurve.from_csv(tmp_path / "sparse.csv")
    assert curve.steps == 31 and curve.step_time is None
    assert curve.losses[5] == pytest.approx(0.75)
    assert curve.losses[20] == pytest.approx(0.375)


@pytest.mark.parametrize(
    ("text", "message"),
    [("step,acc\n1,0.5\n", "'loss' column"), ("step,loss\n2,1\n1,0.5\n", "increase"),
     ("loss\n1\nabc\n", "not a number"), ("loss,time\n1,5\n0.5,4\n", "time"),
     ("step,loss\n1,2\ninf,1\n", "finite"), ("step,loss\n1,2\n1e11,1\n", "at most")],
)
def test_bad_csv(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "bad.csv").write_text(text)
    with pytest.raises(SimulationError, match=message):
        LossCurve.from_csv(tmp_path / "bad.csv")
    with pytest.raises(SimulationError, match="cannot read"):
        LossCurve.from_csv(tmp_path / "missing.csv")


def _refused_at_once(read: Callable[[], object], fifo: Path) -> BaseException | None:
    """What ``read()`` raised, if it returned within 10 s; a read still waiting on the FIFO fails the
    test, and is then released by opening and closing the FIFO's writing end (so no thread is left)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            read()
            outcome.append(None)
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY))  # the reader gets EOF
        thread.join(10)
        pytest.fail(f"reading the FIFO {fifo} waited for a writer")
    return outcome[0]


def test_a_fifo_device_or_directory_is_refused_at_once(tmp_path: Path) -> None:
    """A loss curve or failure trace is read only from a regular file: a FIFO's open would wait for a
    writer forever (found by an audit: `crashsafe simulate --loss-curve FIFO` hung)."""
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    for read in (lambda: LossCurve.from_csv(fifo), lambda: Trace.from_file(fifo)):
        error = _refused_at_once(read, fifo)
        assert isinstance(error, SimulationError) and "not a regular file" in str(error)
    for path in (tmp_path, Path("/dev/zero")):
        with pytest.raises(SimulationError, match="not a regular file"):
            LossCurve.from_csv(path)
        with pytest.raises(SimulationError, match="not a regular file"):
            Trace.from_file(path)


def test_an_oversized_or_binary_file_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.csv"
    with big.open("wb") as f:
        f.write(b"loss\n1\n")
        f.truncate((256 << 20) + 1)  # one byte over the bound; sparse: no disk used
    with pytest.raises(SimulationError, match="larger than 256 MiB"):
        LossCurve.from_csv(big)
    with pytest.raises(SimulationError, match="larger than 256 MiB"):
        Trace.from_file(big)
    (tmp_path / "bin.csv").write_bytes(b"loss\n\xff\xfe\n")
    with pytest.raises(SimulationError, match="not UTF-8"):
        LossCurve.from_csv(tmp_path / "bin.csv")
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbfloss\n1\n0.5\n")  # a spreadsheet's CSV
    assert LossCurve.from_csv(tmp_path / "bom.csv").steps == 2


def test_smooth_is_monotone_and_nan_steps_carry_the_last_loss() -> None:
    rng = np.random.default_rng(0)
    losses = np.exp(-np.arange(2000) / 300.0) * (1 + 0.3 * rng.standard_normal(2000)) + 0.1
    losses[[0, 500, 501]] = math.nan
    curve = LossCurve(losses)
    assert np.all(np.isfinite(curve.losses)) and curve.losses[500] == curve.losses[499]
    assert np.all(np.diff(curve.smooth) <= 0)
    assert curve.progress_at(0.0) == curve.smooth[0] and curve.progress_at(2000.0) == curve.smooth[-1]
    with pytest.raises(SimulationError):
        LossCurve(np.array([math.nan, math.nan]))


def test_resample_and_exponential_model() -> None:
    curve = LossCurve.exponential(-0.1, 0.5, steps=600, step_time=1.0)
    assert curve.losses[59] == pytest.approx(math.exp(-0.1 + 0.5))
    longer = curve.resample(6000)
    assert longer.steps == 6000 and longer.losses[-1] == pytest.approx(curve.losses[-1])
    assert longer.step_time == pytest.approx(0.1)


def test_end_rules() -> None:
    curve = LossCurve(np.concatenate([np.linspace(2.0, 0.1, 300), np.full(700, 0.1)]))
    assert FixedSteps().end_step(curve) == 1000 and FixedSteps(10).end_step(curve) == 10
    assert TargetLoss(1.0).end_step(curve) == pytest.approx(160, abs=5)
    plateau = Plateau(window=0.1, min_drop=0.05).end_step(curve)
    assert 300 <= plateau <= 420
    assert Plateau().end_step(LossCurve(np.exp(-np.arange(1000) / 50.0))) == 1000  # never plateaus
    with pytest.raises(SimulationError, match="never reaches"):
        TargetLoss(0.01).end_step(curve)
    with pytest.raises(SimulationError):
        Plateau(window=2.0)


def test_replay_gives_the_policys_steps() -> None:
    profile = Profile(LossCurve(np.linspace(2, 1, 1000)), step_time=1.0, stall=2.0, persist=0.0)
    assert replay(EverySteps(100), profile, 1000).steps.tolist() == list(range(100, 1000, 100))
    young = replay(Young(400.0), profile, 1000).steps
    assert young[0] == 10 and set(np.diff(young).tolist()) == {int(young_interval(2.0, 400.0))}


def test_replay_waits_for_the_persist_before_the_cost_is_known() -> None:
    profile = Profile(LossCurve(np.linspace(2, 1, 1000)), step_time=1.0, stall=2.0, persist=50.0)
    schedule = replay(Young(400.0), profile, 1000)
    assert schedule.steps[0] == 10 and schedule.steps[1] >= 60
    fast = replay(Young(1.0), profile, 400)  # interval 2 s < persist: each save waits for the last
    assert fast.stalls[1] == 2.0 and np.all(fast.stalls[2:] > 2.0)


def test_replay_collects_policy_warnings() -> None:
    profile = Profile(LossCurve(np.linspace(1, 2, 300)), step_time=1.0, stall=1.0)  # a rising loss
    schedule = replay(ConvergenceAware(600.0, schedule="coci"), profile, 300)
    assert any("not decreasing" in note for note in schedule.notes)
