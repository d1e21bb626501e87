"""One PNG comparing policies: overhead with 95% intervals, and where each checkpoints on the curve."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from crashsafe.sim.profile import Profile
from crashsafe.sim.result import SimResult

__all__ = ["plot_comparison"]


def plot_comparison(
    results: Sequence[SimResult], profile: Profile, path: str | os.PathLike[str], title: str = ""
) -> None:
    """Bars of time and progress-weighted overhead (with CIs) and the checkpoints on the loss curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, curve) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r.policy for r in results]
    x = np.arange(len(results))
    series = ((-0.2, "overhead", "time overhead"), (0.2, "weighted", "progress-weighted"))
    for offset, metric, label in series:
        est = [r.estimate(metric) for r in results]
        means = np.array([e.mean for e in est]) / 3600.0
        errors = np.array([[e.mean - e.low for e in est], [e.high - e.mean for e in est]]) / 3600.0
        bars.bar(x + offset, np.nan_to_num(means), 0.4, yerr=np.nan_to_num(errors), capsize=3, label=label)
    heights = [r.estimate(m).mean for r in results for m in ("overhead", "weighted")]
    finite = [h for h in heights if np.isfinite(h) and h > 0]
    if finite and max(finite) > 20 * min(finite):
        bars.set_yscale("log")  # one policy far off the others must not flatten the rest
    for i, r in enumerate(results):
        if r.unfinished:
            bars.annotate(f"{r.unfinished} DNF", (i, 0.02), xycoords=("data", "axes fraction"),
                          ha="center", va="bottom", color="red")
    bars.set_xticks(x, names, rotation=20)
    bars.set_ylabel("hours per job (mean, 95% CI)")
    bars.legend()
    bars.set_title("fault-tolerance overhead")

    hours = np.arange(1, profile.curve.steps + 1) * profile.step_time / 3600.0
    curve.plot(hours, profile.curve.losses, color="0.75", lw=0.6, label="loss")
    curve.plot(hours, profile.curve.smooth, color="k", lw=1.2, label="smoothed")
    low, high = float(profile.curve.smooth.min()), float(profile.curve.losses.max())
    for i, r in enumerate(results):
        marks = r.checkpoint_steps * profile.step_time / 3600.0
        level = low * (high / low) ** (0.05 + 0.9 * (i + 0.5) / len(results)) if low > 0 else high
        curve.plot(marks, np.full(marks.size, level), "|", ms=8, label=f"{r.policy} ({marks.size})")
    if results:
        curve.axvline(results[0].end_step * profile.step_time / 3600.0, color="r", ls=":", lw=1, label="end")
    if low > 0:
        curve.set_yscale("log")
    curve.set_xlabel("training hours")
    curve.set_ylabel("loss")
    curve.legend(fontsize=7, loc="upper right")
    curve.set_title("checkpoints on the loss curve")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
