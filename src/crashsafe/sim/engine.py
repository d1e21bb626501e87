"""Monte Carlo over failures, vectorized across trials with numpy.

Coordinates: *progress* q is failure-free training seconds (step · step_time); *G* is failure-free
wall time, progress plus the stalls already taken. Checkpoint k (progress c_k) stalls training over
G ∈ [c_k + S_{k-1}, c_k + S_k] and protects once persisted, at G = c_k + S_k + persist. A failure at
wall F rolls the trial back to its newest persisted checkpoint, then a restart of R seconds follows
(failures may strike during restarts too). Each loop iteration handles one event of every live trial.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crashsafe.sim.curve import LossCurve
from crashsafe.sim.failures import FailureModel

__all__ = ["Outcomes", "run_trials"]


@dataclass(frozen=True)
class Outcomes:
    """Per-trial results (arrays of length ``trials``); times in seconds, progress in loss units."""

    wall: np.ndarray  # time to the end rule (training + stalls + lost work + restarts)
    stalls: np.ndarray
    lost_work: np.ndarray  # training time done again after rollbacks
    restarts: np.ndarray
    progress_lost: np.ndarray  # smoothed loss decrease rolled back, summed over failures
    failures: np.ndarray
    finished: np.ndarray  # False when a trial hit max_failures (a job that cannot finish)
    compute: float  # failure-free training time (end step · step time)
    mean_rate: float  # mean loss decrease per second of the failure-free job


def run_trials(
    positions: np.ndarray,
    stalls: np.ndarray,
    compute: float,
    persist: float,
    restart: float,
    curve: LossCurve,
    step_time: float,
    failures: FailureModel,
    trials: int,
    seed: int,
    max_failures: int = 100_000,
    max_slowdown: float = 100.0,
) -> Outcomes:
    """Simulate ``trials`` runs of a job of ``compute`` training seconds checkpointing at ``positions``.

    A trial that fails ``max_failures`` times or runs past ``max_slowdown`` times its failure-free
    wall time is given up (``finished`` False): the job, so protected, practically never finishes.
    """
    n = positions.size
    c = np.concatenate([[0.0], positions])
    cum = np.concatenate([[0.0], np.cumsum(stalls)])
    starts = c[1:] + cum[:-1]  # G at which stall k begins (k = 1..n)
    starts_ext = np.concatenate([starts, [np.inf]])  # safe to index when there is no checkpoint
    durable = np.concatenate([[-np.inf], c[1:] + cum[1:] + persist])
    g_end = float(compute + cum[n])  # a python float: past 1.8e308 it is inf, with no warning
    loss_at = curve.progress_at(c / step_time)

    j = np.zeros(trials, dtype=np.int64)  # index of the checkpoint the trial resumes from
    seg = np.zeros(trials)  # wall time at which the current segment (re)starts
    wall = np.zeros(trials)
    spent_stall = np.zeros(trials)
    lost = np.zeros(trials)
    restarts = np.zeros(trials)
    progress = np.zeros(trials)
    count = np.zeros(trials, dtype=np.int64)
    finished = np.ones(trials, dtype=bool)

    # gaps drawn per block: about twice the failures the job expects, never past the max_failures + 1
    # a trial can use (a float until then: 2 * g_end / mtbf may overflow for absurd costs)
    width = 1
    if np.isfinite(failures.mtbf):
        width = int(min(max(8.0, 2 * g_end / failures.mtbf + 8), max_failures + 8))
    gaps = failures.block(seed, trials, 0, width)
    column = np.zeros(trials, dtype=np.int64)
    next_fail = gaps[:, 0].copy()
    live = np.arange(trials)

    while live.size:
        col = column[live] + 1
        if col.max() >= gaps.shape[1]:
            gaps = np.concatenate([gaps, failures.block(seed, trials, gaps.shape[1], width)], axis=1)
        fail, start, at = next_fail[live], seg[live], j[live]
        g0 = c[at] + cum[at]
        done_wall = start + (g_end - g0)

        in_restart = fail < start
        completes = ~in_restart & (fail >= done_wall)
        working = ~in_restart & ~completes

        # a failure during a restart: the restart was cut short and begins again
        idx = live[in_restart]
        restarts[idx] -= start[in_restart] - fail[in_restart]
        restarts[idx] += restart
        seg[idx] = fail[in_restart] + restart
        count[idx] += 1

        # the job reaches its end
        idx = live[completes]
        wall[idx] = done_wall[completes]
        spent_stall[idx] += cum[n] - cum[at[completes]]

        # a failure while training or checkpointing: roll back to the newest persisted checkpoint
        idx, a = live[working], at[working]
        g_fail = g0[working] + (fail[working] - start[working])
        back = np.maximum(np.searchsorted(durable, g_fail, side="right") - 1, a)
        begun = np.searchsorted(starts, g_fail, side="right")  # stalls begun so far
        inside = (begun > 0) & (g_fail < c[begun] + cum[begun])
        q_fail = np.where(inside, c[begun], g_fail - cum[begun])
        prev = np.maximum(begun - 1, 0)
        stall_done = np.where(inside, cum[prev] + g_fail - starts_ext[prev], cum[begun]) - cum[a]
        spent_stall[idx] += stall_done
        lost[idx] += q_fail - c[back]
        progress[idx] += loss_at[back] - curve.progress_at(q_fail / step_time)
        restarts[idx] += restart
        seg[idx] = fail[working] + restart
        j[idx] = back
        count[idx] += 1

        # next failure for everyone who failed; retire finished and hopeless trials
        failed = live[~completes]
        column[failed] += 1
        next_fail[failed] += gaps[failed, column[failed]]
        stuck = (count[failed] >= max_failures) | (seg[failed] > max_slowdown * g_end)
        finished[failed[stuck]] = False
        wall[failed[stuck]] = np.nan
        live = failed[~stuck]

    mean_rate = float(loss_at[0] - curve.progress_at(compute / step_time)) / compute if compute > 0 else 0.0
    return Outcomes(wall, spent_stall, lost, restarts, progress, count.astype(np.float64), finished,
                    compute, mean_rate)
