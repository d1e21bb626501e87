"""``crashsafe simulate``: score save policies on a loss curve under simulated failures."""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from crashsafe.cli._common import JsonOpt, console, emit_json, err, fail
from crashsafe.cli._tables import Column, print_table

if TYPE_CHECKING:
    from crashsafe.sim import EndRule, Estimate, FailureModel, Profile, SimResult

__all__ = ["simulate_cmd"]


def simulate_cmd(
    mtbf: Annotated[str, typer.Option(help="mean time between failures, e.g. 4h, 15min")],
    ckpt_cost: Annotated[str, typer.Option("--ckpt-cost", help="training stall per checkpoint, e.g. 30s")],
    policy: Annotated[
        str,
        typer.Option(
            help="comma-separated: young, daly, daly-exact, coci, convergence, every:N, seconds:S, overhead:F"
        ),
    ] = "young,daly,coci,convergence",
    loss_curve: Annotated[
        Path | None,
        typer.Option(help="CSV with a 'loss' column (and 'step', 'time'); default: COCI's exponential model"),
    ] = None,
    job: Annotated[
        str | None,
        typer.Option(
            help="failure-free training time of the run, e.g. 24h (default: from the CSV's time column)"
        ),
    ] = None,
    persist: Annotated[str, typer.Option(help="background persist time; unprotected until done")] = "0",
    restart: Annotated[str, typer.Option(help="time to restart after a failure")] = "0",
    end: Annotated[str, typer.Option(help="job end: fixed, fixed:STEPS, plateau, target:LOSS")] = "fixed",
    failures: Annotated[str, typer.Option(help="exponential, weibull:SHAPE or trace:FILE")] = "exponential",
    steps: Annotated[int, typer.Option(help="resample shorter curves to this many steps")] = 20000,
    trials: Annotated[int, typer.Option(help="Monte Carlo trials (seeded)")] = 1000,
    seed: Annotated[int, typer.Option(help="seed of the failure draws")] = 0,
    plot: Annotated[
        Path,
        typer.Option(help="where to write the plot (a PNG); default: simulate.png in the current directory"),
    ] = Path("simulate.png"),
    as_json: JsonOpt = False,
) -> None:
    """Replay policies on a training profile under Monte Carlo failures; print a table, write a plot."""
    import warnings

    from rich.progress import Progress

    from crashsafe._units import parse_duration
    from crashsafe.errors import CrashsafeError
    from crashsafe.policies import PolicyWarning, policy_from_name
    from crashsafe.sim import paired_ratio, simulate

    _check_plot(plot)
    _check_matplotlib()
    try:
        for option, value in (("--ckpt-cost", ckpt_cost), ("--persist", persist), ("--restart", restart)):
            _within_a_century(option, value)
        if job is not None:
            _within_a_century("--job", job)
        profile = _profile(loss_curve, job, ckpt_cost, persist, restart, steps)
        end_rule, failure_model = _end_rule(end), _failures(failures, mtbf)
        names = [n.strip() for n in policy.split(",") if n.strip()]
        if not names:
            raise fail(f"--policy {policy!r} names no policy; e.g. --policy young,coci")
        mtbf_s, restart_s = parse_duration(mtbf, "mtbf"), parse_duration(restart, "restart")
        policies = {n: policy_from_name(n, mtbf=mtbf_s, restart=restart_s) for n in names}
        results = []
        with Progress(console=err, transient=True) as progress, warnings.catch_warnings():
            warnings.simplefilter("ignore", PolicyWarning)
            task = progress.add_task("simulating", total=len(policies))
            for name, pol in policies.items():
                progress.update(task, description=f"simulating {name}")
                results.append(
                    simulate(pol, profile, failure_model, end_rule, trials=trials, seed=seed, name=name)
                )
                progress.advance(task)
    except CrashsafeError as exc:
        raise fail(str(exc)) from None

    compute_h = results[0].outcomes.compute / 3600.0
    _save_plot(results, profile, plot, title=f"MTBF {mtbf}, checkpoint {ckpt_cost}")
    if as_json:
        emit_json(
            {
                "trials": trials,
                "mtbf": mtbf,
                "ckpt_cost": ckpt_cost,
                "end": end,
                "job_hours": compute_h,
                "plot": str(plot.resolve()),
                "policies": [_policy_json(r, results[0]) for r in results],
            }
        )
        return
    columns = [
        Column("policy"),
        Column("ckpts", right=True, drop=5),
        Column("overhead h", right=True),
        Column("vs 1st", right=True, drop=2),
        Column("weighted h", right=True, drop=3),
        Column("end h", right=True, drop=4),
        Column("lost loss", right=True, drop=6),
        Column("fails", right=True, drop=7),
    ]
    rows = []
    for r in results:
        row = [r.policy, str(r.checkpoint_steps.size)]
        if r.unfinished == r.trials:
            row += ["never finishes"] + ["-"] * 5
        else:
            ratio = paired_ratio(r, results[0], "overhead")
            row += [
                _hours(r, "overhead"),
                f"{ratio.mean:.2f}x",
                _hours(r, "weighted"),
                _hours(r, "wall"),
                f"{r.estimate('progress_lost').mean:.3g}",
                f"{r.estimate('failures').mean:.2f}",
            ]
        if r.unfinished and r.unfinished < r.trials:
            row[2] += f" ({r.unfinished} DNF)"
        rows.append(row)
    print_table(
        f"{trials} trials · MTBF {mtbf} · checkpoint {ckpt_cost} · job {compute_h:.3g} h of "
        f"training · end {end}",
        columns,
        rows,
    )
    console.print(
        "overhead = stalls + lost work + restarts (mean ±95% CI); weighted = stalls + restarts "
        "+ rolled-back loss decrease priced at the job's mean convergence rate; "
        "vs 1st = paired ratio"
    )
    console.print(Text(f"wrote the plot to {plot.resolve()}"))


_CENTURY = 100 * 365.25 * 86400.0  # seconds


def _within_a_century(option: str, value: str) -> None:
    """Refuse a duration past 100 years: it overflowed the simulation (``--ckpt-cost 1e308s``, an
    OverflowError), or left every trial failing until the engine's cap, minutes per policy."""
    from crashsafe._units import parse_duration

    if parse_duration(value, option) > _CENTURY:
        raise fail(
            f"{option} {value}: the simulator takes durations up to 100 years ({_CENTURY:.3g} s); a "
            "checkpoint stalls seconds to minutes, a job runs hours to months "
            "(e.g. --ckpt-cost 30s --job 24h)"
        )


def _check_plot(path: Path) -> None:
    """Refuse a --plot target before simulating: a missing folder, or something there that is not a
    regular file (a symbolic link, even to a file, a directory, FIFO or device), which the plot must
    never go into, through or replace (rule 17 of the design: outputs as careful as inputs)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        if not path.parent.is_dir():
            raise fail(f"--plot {path}: {path.parent} is not an existing folder; create it first") from None
        return
    except OSError as exc:
        raise fail(f"--plot {path}: {exc.strerror or exc}; give another path for the PNG") from None
    if stat.S_ISLNK(mode):
        raise fail(
            f"--plot {path} is a symbolic link: the plot is never written through one (it could lead to "
            "a checkpoint's file). Remove it or give another path for the PNG"
        )
    if not stat.S_ISREG(mode):
        raise fail(
            f"--plot {path} is not a regular file (a directory, FIFO or device); give a file path for the "
            f"PNG, e.g. {path / 'simulate.png' if stat.S_ISDIR(mode) else 'simulate.png'}"
        )


def _check_matplotlib() -> None:
    """Refuse to simulate where the plot cannot be drawn: matplotlib comes with the science extra,
    and a plain install failed on a ModuleNotFoundError traceback after the whole simulation."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise fail("simulate draws its plot with matplotlib: pip install 'crashsafe[science]'") from None


def _save_plot(results: list[SimResult], profile: Profile, path: Path, title: str) -> None:
    """Render the PNG, then write it to ``path`` exactly (matplotlib alone would add '.png' to a
    name without one, and follow its own rules for other suffixes)."""
    from crashsafe.sim.plot import plot_comparison

    with tempfile.TemporaryDirectory(prefix="crashsafe-plot-") as scratch:
        rendered = Path(scratch) / "plot.png"
        plot_comparison(results, profile, rendered, title=title)
        _write_regular(path, rendered.read_bytes())


def _write_regular(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path``: written into a new file beside it (created exclusively, never through
    a link), made durable, then renamed over ``path`` once ``path`` is still a regular file or
    nothing. A rename never follows a link at its target and never opens it, so a link, FIFO or
    device there is refused untouched, and a hard link to another file (a committed manifest) is
    replaced, never written over."""
    tmp = path.with_name(f".{path.name}.crashsafe-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise fail(f"cannot write the plot to {path}: {exc.strerror}; give another --plot path") from None
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        _check_plot(path)  # again: something may have been put there while simulating
        os.rename(tmp, path)
    except OSError as exc:
        raise fail(f"cannot write the plot to {path}: {exc.strerror}; give another --plot path") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _policy_json(result: SimResult, first: SimResult) -> dict[str, Any]:
    """One policy's outcome in JSON (docs/cli.md): hours with their 95% interval; null for a policy
    whose every trial failed to finish (and for NaN)."""
    from crashsafe.sim import paired_ratio

    done = result.unfinished < result.trials

    def interval(e: Estimate, scale: float) -> dict[str, float | None] | None:
        values = {"mean": e.mean / scale, "low": e.low / scale, "high": e.high / scale}
        return {k: v if math.isfinite(v) else None for k, v in values.items()} if done else None

    def mean(metric: str) -> float | None:
        m = result.estimate(metric).mean
        return m if done and math.isfinite(m) else None

    return {
        "policy": result.policy,
        "checkpoints": int(result.checkpoint_steps.size),
        "unfinished": result.unfinished,
        "overhead_h": interval(result.estimate("overhead"), 3600.0),
        "vs_first": interval(paired_ratio(result, first, "overhead"), 1.0),
        "weighted_h": interval(result.estimate("weighted"), 3600.0),
        "end_h": interval(result.estimate("wall"), 3600.0),
        "lost_loss": mean("progress_lost"),
        "failures": mean("failures"),
    }


def _hours(result: SimResult, metric: str) -> str:
    e = result.estimate(metric)
    return f"{e.mean / 3600:.3g} ±{(e.high - e.mean) / 3600:.2g}"


def _profile(
    path: Path | None, job: str | None, stall: str, persist: str, restart: str, steps: int
) -> Profile:
    import math

    from crashsafe._units import parse_duration
    from crashsafe.sim import LossCurve, Profile, SimulationError

    if steps < 1:
        raise SimulationError(f"--steps {steps}: a run trains at least 1 step; e.g. --steps 2000")
    if path is None:
        total = parse_duration(job or "24h", "job")
        if not total > 0:
            raise SimulationError(f"--job {job}: the run must train for some time; e.g. --job 24h")
        curve = LossCurve.exponential(-3.0 / (total / 60.0), math.log(2.3), steps, total / steps, noise=0.05)
    else:
        curve = LossCurve.from_csv(path)
        if job is not None:
            total = parse_duration(job, "job")
        elif curve.step_time is not None:
            total = curve.step_time * curve.steps
        else:
            raise SimulationError(f"{path} has no 'time' column: say how long the run trains with --job 24h")
        if curve.steps < steps:
            curve = curve.resample(steps)
    return Profile.make(curve, total / curve.steps, stall, persist, restart)


def _end_rule(spec: str) -> EndRule:
    from crashsafe.sim import FixedSteps, Plateau, SimulationError, TargetLoss

    key, _, arg = spec.partition(":")
    try:
        if key == "fixed":
            return FixedSteps(int(arg) if arg else None)
        if key == "plateau":
            return Plateau()
        if key == "target" and arg:
            return TargetLoss(float(arg))
    except ValueError:
        pass
    raise SimulationError(f"--end {spec!r}: use fixed, fixed:STEPS, plateau or target:LOSS")


def _failures(spec: str, mtbf: str) -> FailureModel:
    from crashsafe.sim import Exponential, SimulationError, Trace, Weibull

    key, _, arg = spec.partition(":")
    if key == "exponential" and not arg:
        return Exponential(mtbf)
    if key == "weibull":
        try:
            return Weibull(mtbf, float(arg) if arg else 0.7)
        except ValueError:
            pass
    if key == "trace" and arg:
        return Trace.from_file(arg)
    raise SimulationError(f"--failures {spec!r}: use exponential, weibull:SHAPE or trace:FILE")
