"""Parameter-server benchmark: FreeLauncher replication vs no fault tolerance vs checkpoints.

On one local Ray (2 servers, 4 workers, actors reused between runs), for each workload (dense
digits MLP, sparse hashed logistic regression, matrix factorization), BSP and SSP, k = 1..3:

* throughput overhead of FreeLauncher against no fault tolerance, in wall time and in CPU time
  of every actor plus the driver (CPU time is less disturbed by other load on the machine),
  both taken over the training clocks only (from the end of the first clock to the end of the
  last: not the per-run setup, the first clock's allocations or the final evaluation, which cost
  every method the same and would dilute the ratio); medians of ``--repeat`` interleaved runs in
  rotating order, after one discarded warm-up run of every variant;
* replication bytes per clock (replica pushes, optimizer state and versions in pulls, the
  per-clock update-count tables);
* recovery from one SIGKILLed server (k = 2, 3): time from the kill until the job is back where
  it was, clocks recomputed, updates lost, and whether the BSP model is bit-identical to a clean
  run -- against checkpoint-and-rollback at its best interval (the interval with the shortest
  failure run among ``CKPT_INTERVALS``) and against a restart from scratch. Every method gets the
  dead shard's replacement the same way, from one standby server actor; one more FreeLauncher
  row runs without a standby (a new actor is started on the failure) to show what it buys.

    python -m bench ps [--quick] [--repeat=N] [--clocks=N] [--report-only]
    python -m bench ps --dense [--repeat=N]    # dense BSP overhead only, 30 repeats: ps_dense.md
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import ray

from crashsafe.ps import Failure, PSConfig, PSJob, RunResult, local_ray

RESULTS = Path(__file__).parent / "results"
WORKLOADS = {"digits": "dense", "sparse_lr": "sparse", "mf": "sparse"}
OPTIMIZER = "sgd"
CKPT_INTERVALS = (3, 6, 12)
NO_STANDBY = "FreeLauncher k=2, no standby"
TARGET = {"dense-bsp": 0.05, "other": 0.15}
WARMUP = 30  # clocks of each variant's discarded warm-up run


def cpu_seconds(job: PSJob) -> float:
    """User + system CPU seconds of the driver and of every live actor process."""
    pids = [s["pid"] for s in ray.get([s.status.remote() for s in job.servers])]
    pids += ray.get([w.pid.remote() for w in job.workers])
    total = 0.0
    for pid in [*pids, os.getpid()]:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def config(workload: str, consistency: str, mode: str, k: int, clocks: int, **kw: Any) -> PSConfig:
    return PSConfig(
        workload=workload,
        consistency=consistency,
        mode=mode,
        replicas=k,  # type: ignore[arg-type]
        clocks=clocks,
        optimizer=kw.pop("optimizer", OPTIMIZER),
        servers=2,
        workers=4,
        **kw,
    )


def timed_run(job: PSJob, cfg: PSConfig) -> tuple[RunResult, float, float]:
    """Run ``cfg``; return the result and the wall and CPU seconds of clocks 1 to the last (from
    the end of clock 0 to the end of the last clock: the training loop without its setup)."""
    marks: dict[int, tuple[float, float]] = {}

    def mark(clock: int, _: RunResult) -> None:
        if clock == 0:
            cpu = cpu_seconds(job)  # before the clock starts: its own calls stay outside
            marks[0] = (time.perf_counter(), cpu)
        elif clock == cfg.clocks - 1:
            marks[1] = (time.perf_counter(), cpu_seconds(job))

    job.on_clock = mark
    try:
        result = job.run(config=cfg)
    finally:
        job.on_clock = None
    (t0, c0), (t1, c1) = marks[0], marks[1]
    return result, t1 - t0, c1 - c0


def overhead(
    job: PSJob, workload: str, consistency: str, clocks: int, repeat: int, optimizer: str = OPTIMIZER
) -> list[dict[str, Any]]:
    """Failure-free runs, no FT and FreeLauncher k=1..3, interleaved; medians per variant."""
    variants = [("none", 1), ("flr", 1), ("flr", 2), ("flr", 3)]
    wall: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    cpu: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    last: dict[tuple[str, int], RunResult] = {}
    for mode, k in variants:  # warm-up: every variant's code paths and buffers once, not counted
        job.run(config=config(workload, consistency, mode, k, min(clocks, WARMUP), optimizer=optimizer))
    for rep in range(repeat):
        for i in range(len(variants)):
            mode, k = variants[(i + rep) % len(variants)]
            cfg = config(workload, consistency, mode, k, clocks, optimizer=optimizer)
            result, seconds, cpu_s = timed_run(job, cfg)
            cpu[(mode, k)].append(cpu_s)
            wall[(mode, k)].append(seconds)
            last[(mode, k)] = result

    def ratios(times: dict[tuple[str, int], list[float]], variant: tuple[str, int]) -> list[float]:
        """Per repeat, the ratio to the same repeat's no-FT time, minus 1 (pairing cancels drift)."""
        return sorted(a / b - 1 for a, b in zip(times[variant], times[("none", 1)], strict=True))

    base_wall = statistics.median(wall[("none", 1)])
    rows = []
    for mode, k in variants[1:]:
        r = last[(mode, k)]
        rows.append(
            {
                "workload": workload,
                "kind": WORKLOADS[workload],
                "consistency": consistency,
                "optimizer": optimizer,
                "k": k,
                "wall_overhead": statistics.median(ratios(wall, (mode, k))),
                "cpu_overhead": statistics.median(ratios(cpu, (mode, k))),
                "wall_ci": median_ci(ratios(wall, (mode, k))),
                "cpu_ci": median_ci(ratios(cpu, (mode, k))),
                "base_clocks_per_s": (clocks - 1) / base_wall,
                "noise": (max(wall[("none", 1)]) - min(wall[("none", 1)])) / base_wall,
                "replica_bytes": r.replica_bytes / clocks,
                "pull_extra_bytes": r.ft_pull_bytes / clocks,
                "table_bytes": r.version_bytes / clocks,
                "pull_bytes_noft": last[("none", 1)].pull_bytes / clocks,
                "metric": r.metrics,
            }
        )
    return rows


def median_ci(values: list[float]) -> tuple[float, float]:
    """A distribution-free interval for the median: the (j+1)-th smallest and (j+1)-th largest
    value, for the largest j that keeps the coverage at least 95 % (see :func:`ci_coverage`)."""
    v = sorted(values)
    j = _ci_rank(len(v))
    return v[j], v[-1 - j]


def _ci_rank(n: int) -> int:
    """How many values :func:`median_ci` leaves out at each end: the most with >= 95 % coverage."""
    j = 0
    while j + 1 < n / 2 and ci_coverage(n, j + 1) >= 0.95:
        j += 1
    return j


def ci_coverage(n: int, j: int | None = None) -> float:
    """Probability that the interval leaving ``j`` of ``n`` values out at each end (default: as
    :func:`median_ci` does) contains the true median: 1 - 2 P(Binomial(n, 1/2) <= j)."""
    j = _ci_rank(n) if j is None else j
    return 1 - 2 * sum(math.comb(n, i) for i in range(j + 1)) / 2**n


def recovery(
    job: PSJob, workload: str, consistency: str, clocks: int, kill_at: int, repeat: int
) -> list[dict[str, Any]]:
    """One SIGKILLed server: FreeLauncher (k=2, 3; k=2 also without a standby), checkpoints at
    their best interval, restart. Every method runs ``repeat`` times; medians are reported."""
    kill = [Failure(clock=kill_at, servers=(0,), how="sigkill")]
    clean = job.run(config=config(workload, consistency, "none", 1, clocks))

    def runs(name: str, make: Any, **extra: Any) -> dict[str, Any]:
        results = []
        for _ in range(repeat):
            with tempfile.TemporaryDirectory(prefix="cs-bench-ps-") as d:
                results.append(job.run(kill, config=make(d)))
        events = [r.recoveries[0] for r in results]
        med = statistics.median
        return {
            "workload": workload,
            "consistency": consistency,
            "method": name,
            "repeat": repeat,
            "seconds": med(e.seconds for e in events),
            "replace": med(e.replace_seconds for e in events),
            "rest": med(e.seconds - e.replace_seconds for e in events),
            "recomputed": max(e.recomputed_clocks for e in events),
            "lost": max(r.updates_lost for r in results),
            "discarded": max(e.discarded_updates for e in events),
            "identical": all(
                all(clean.params[n].tobytes() == r.params[n].tobytes() for n in clean.params) for r in results
            ),
            "total": med(r.seconds for r in results),
            **extra,
        }

    def ckpt(every: int) -> Any:
        return lambda d: config(
            workload, consistency, "checkpoint", 1, clocks, checkpoint_dir=d, checkpoint_every=every
        )

    rows = [
        runs(f"FreeLauncher k={k}", lambda d, k=k: config(workload, consistency, "flr", k, clocks))
        for k in (2, 3)
    ]
    rows.append(
        runs(NO_STANDBY, lambda d: config(workload, consistency, "flr", 2, clocks, spares=0), standby=False)
    )
    # The best interval: the shortest run with this failure (one run each picks it, then it is repeated).
    totals = {}
    for every in CKPT_INTERVALS:
        with tempfile.TemporaryDirectory(prefix="cs-bench-ps-") as d:
            totals[every] = job.run(kill, config=ckpt(every)(d)).seconds
    every = min(totals, key=lambda e: totals[e])
    best = runs(f"checkpoint every {every}", ckpt(every), interval=every)
    ratios = []
    for _ in range(max(2, repeat - 1)):  # failure-free cost of checkpointing, paired with no-FT runs
        base = job.run(config=config(workload, consistency, "none", 1, clocks)).seconds
        with tempfile.TemporaryDirectory(prefix="cs-bench-ps-") as d:
            ratios.append(job.run(config=ckpt(every)(d)).seconds / base)
    best["overhead"] = statistics.median(ratios) - 1
    rows.append(best)
    rows.append(runs("restart from scratch", lambda d: config(workload, consistency, "none", 1, clocks)))
    return rows


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def row_of(cells: list[Any]) -> str:
    """A markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def verdict(row: dict[str, Any], measure: str, target: float) -> str:
    """yes / noise / no for one overhead measure (see the report's text)."""
    if row[f"{measure}_overhead"] <= target:
        return "yes"
    interval = row.get(f"{measure}_ci")
    return "noise" if interval is not None and interval[0] <= target else "no"


def with_interval(row: dict[str, Any], measure: str) -> str:
    interval = row.get(f"{measure}_ci")
    text = f"{row[f'{measure}_overhead']:+.1%}"
    return text if interval is None else f"{text} [{interval[0]:+.0%}, {interval[1]:+.0%}]"


def target_of(row: dict[str, Any]) -> float:
    return TARGET["dense-bsp"] if (row["kind"], row["consistency"]) == ("dense", "bsp") else TARGET["other"]


def overhead_section(over: list[dict[str, Any]], args: dict[str, Any]) -> list[str]:
    """The report's section on failure-free overhead: how it is measured, and one row per variant."""
    lines = [
        "## Throughput overhead of FreeLauncher against no fault tolerance (failure-free runs)",
        "",
        "Overhead = median over repeats of (time with FreeLauncher / time without fault tolerance in the "
        "same repeat) - 1, times taken over the training clocks (from the end of clock 0 to the end of "
        "the last clock; setup and final evaluation excluded), after one discarded warm-up run of every "
        "variant; a distribution-free interval for that median in brackets (order statistics of the "
        f"repeats, the narrowest with at least 95 % coverage: {ci_coverage(args['repeat']):.1%} at "
        f"{args['repeat']} repeats). Target: at "
        "most 5 % for dense BSP, at most 15 % for sparse or SSP. 'met' is yes when the median is within "
        "the target, 'noise' when it is not but the interval reaches the target (the run cannot tell), "
        "no otherwise. 'no-FT spread' is (slowest - fastest) / median of the repeated no-FT runs. "
        "Bytes are per clock (whole job).",
        "",
        "| workload | BSP/SSP | k | no-FT clocks/s | no-FT spread | wall overhead | CPU overhead | target "
        "| met (wall/CPU) "
        "| replica pushes | extra pull bytes | count tables | no-FT pull bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in over:
        t = target_of(r)
        met = f"{verdict(r, 'wall', t)}/{verdict(r, 'cpu', t)}"
        name = f"{r['workload']} ({r['kind']}{', ' + r['optimizer'] if r['optimizer'] != OPTIMIZER else ''})"
        cells = [
            name,
            r["consistency"].upper(),
            r["k"],
            f"{r['base_clocks_per_s']:.1f}",
            f"{r['noise']:.0%}",
            with_interval(r, "wall"),
            with_interval(r, "cpu"),
            f"{t:.0%}",
            met,
            *(human(r[c]) for c in ("replica_bytes", "pull_extra_bytes", "table_bytes", "pull_bytes_noft")),
        ]
        lines.append(row_of(cells))
    return lines


def header(title: str, args: dict[str, Any], load: tuple[float, float], seconds: float) -> list[str]:
    """Title, command and machine of a report."""
    return [
        f"# {title}",
        "",
        f"Command: `make bench BENCH=\"ps{args['cmd']}\"` (`.venv/bin/python -m bench ps{args['cmd']}`); "
        f"{args['clocks']} clocks per run, {args['repeat']} interleaved repeats, 2 servers, 4 workers, "
        f"server-side {OPTIMIZER} unless noted; one local Ray on 127.0.0.1 with `num_cpus=2`. "
        f"Bench took {seconds:.0f} s. Machine: {platform.machine()}, {os.cpu_count()} CPUs; load average "
        f"{load[0]:.1f} at the start and {load[1]:.1f} at the end (other jobs shared the machine, so wall "
        "times are noisy; CPU time is the steadier measure).",
        "",
    ]


def write_dense_report(
    over: list[dict[str, Any]], args: dict[str, Any], load: tuple[float, float], seconds: float
) -> None:
    """``ps_dense.md``: the dense BSP rows alone, with enough repeats to tell 5 % from noise."""
    lines = header("Parameter server: dense BSP overhead, measured closely", args, load, seconds)
    lines += [
        "The dense BSP rows of `ps.md` again, alone and with three times the paired repeats: with 10 "
        "repeats their intervals span about 10 points, twice the 5 % target, so a median near the "
        "target cannot be told from noise; 30 repeats estimate each median about twice as tightly.",
        "",
        *overhead_section(over, args),
        "",
        "## Against the target",
        "",
    ]
    for measure in ("wall", "cpu"):
        said = [verdict(r, measure, target_of(r)) for r in over]
        lines.append(f"- {measure} time: within 5 % in {said.count('yes')} of {len(said)} configurations, "
                     f"not told from noise in {said.count('noise')}, over in {said.count('no')}.")
    (RESULTS / "ps_dense.md").write_text("\n".join([*lines, ""]))


def write_report(
    over: list[dict[str, Any]],
    rec: list[dict[str, Any]],
    args: dict[str, Any],
    load: tuple[float, float],
    seconds: float,
) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    lines = header("Parameter server: FreeLauncher replication vs no fault tolerance vs checkpoints", args,
                   load, seconds)
    lines += overhead_section(over, args)
    lines += [
        "",
        "## Recovery from one SIGKILLed server",
        "",
        f"24 clocks, server 0 SIGKILLed after clock 16; medians of {args['repeat_rec']} runs per method. "
        "Recovery time runs from the kill until the job is back at the progress it had; 'of which "
        "replacement' is the time until another actor owned the dead shard: detecting the death and "
        "promoting a standby server kept running for that (one per job, the same mechanism for every "
        "method; the pool is refilled in the background after the recovery), or, in the 'no standby' "
        "row, starting a new actor. 'rest' is what the method itself costs (rebuild from workers' copies "
        "and replay, or restore and recompute). The "
        "checkpoint baseline saves every server shard with crashsafe's CheckpointManager and rolls every "
        f"server and worker back; its row is the best interval among {list(CKPT_INTERVALS)} clocks (the "
        "shortest run with this failure), and 'ckpt overhead' its failure-free cost against no fault "
        "tolerance (median of paired runs). 'identical' compares the final model bit for bit with a "
        "failure-free run (SSP is not deterministic, so 'no' is expected there).",
        "",
        "| workload | BSP/SSP | method | recovery s | of which replacement s | rest s | clocks recomputed "
        "| updates lost | applied updates discarded | identical | run s | ckpt overhead |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rec:
        ovh = f"{r['overhead']:+.1%}" if "overhead" in r else ""
        cells = [
            r["workload"],
            r["consistency"].upper(),
            r["method"],
            f"{r['seconds']:.2f}",
            f"{r['replace']:.2f}",
            f"{r['rest']:.2f}",
            r["recomputed"],
            r["lost"],
            r["discarded"],
            "yes" if r["identical"] else "no",
            f"{r['total']:.2f}",
            ovh,
        ]
        lines.append(row_of(cells))
    lines += ["", "## Against the targets", "", *verdicts(over, rec), "", "![plot](ps.png)", ""]
    (RESULTS / "ps.md").write_text("\n".join(lines))


def verdicts(over: list[dict[str, Any]], rec: list[dict[str, Any]]) -> list[str]:
    flr = [r for r in rec if r["method"].startswith("FreeLauncher") and r["method"] != NO_STANDBY]
    lost = sum(r["lost"] for r in flr)
    recomputed = sum(r["recomputed"] for r in flr)
    bsp_identical = all(r["identical"] for r in flr if r["consistency"] == "bsp")
    out = [
        f"- Lost updates with FreeLauncher: {lost} (target 0); clocks recomputed: {recomputed}; "
        f"BSP models bit-identical to failure-free runs: {'all' if bsp_identical else 'NOT all'}."
    ]
    for label, rows in (
        ("dense BSP", [r for r in over if r["kind"] == "dense" and r["consistency"] == "bsp"]),
        ("sparse or SSP", [r for r in over if r["kind"] != "dense" or r["consistency"] != "bsp"]),
    ):
        wall = [verdict(r, "wall", target_of(r)) for r in rows]
        cpu = [verdict(r, "cpu", target_of(r)) for r in rows]
        out.append(
            f"- Overhead, {label} (target {target_of(rows[0]):.0%}): wall time within target in "
            f"{wall.count('yes')}/{len(rows)} configurations ({wall.count('noise')} more within noise, "
            f"{wall.count('no')} clearly over), CPU time in {cpu.count('yes')}/{len(rows)} "
            f"({cpu.count('noise')} within noise, {cpu.count('no')} clearly over)"
            + (
                f"; worst wall {max(r['wall_overhead'] for r in rows):+.1%}, worst CPU "
                f"{max(r['cpu_overhead'] for r in rows):+.1%}."
                if rows
                else "."
            )
        )
    out.append('- The dense BSP rows measured alone with 30 paired repeats: `make bench BENCH="ps --dense"`, '
               "results in `ps_dense.md`.")
    faster = rest_faster = 0
    bare = [r for r in rec if r["method"] == NO_STANDBY]
    for r in flr:
        ckpt = next(
            c
            for c in rec
            if (c["workload"], c["consistency"]) == (r["workload"], r["consistency"])
            and c["method"].startswith("checkpoint")
        )
        faster += r["seconds"] < ckpt["seconds"]
        rest_faster += r["rest"] < ckpt["rest"]
    out.append(
        f"- Recovery faster than the checkpoint baseline at its best interval (both with a standby "
        f"server): {faster}/{len(flr)} cases in total time (medians), {rest_faster}/{len(flr)} in the "
        f"method's own cost; FreeLauncher {_span(r['seconds'] for r in flr)} s against "
        f"{_span(r['seconds'] for r in rec if r['method'].startswith('checkpoint'))} s for checkpoints."
    )
    if bare:
        out.append(
            f"- Without a standby (a new actor started on the failure), FreeLauncher k=2 took "
            f"{_span(r['seconds'] for r in bare)} s, of which {_span(r['replace'] for r in bare)} s waiting "
            "for the new actor."
        )
    return out


def _span(values: Any) -> str:
    """'lo-hi' of some seconds."""
    v = sorted(values)
    return f"{v[0]:.2f}-{v[-1]:.2f}" if v else "-"


def plot(over: list[dict[str, Any]], rec: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [2, 1, 1]})
    labels = [f"{r['workload']}\n{r['consistency']} k={r['k']}" for r in over]
    x = np.arange(len(over))
    ax1.bar(x - 0.2, [100 * r["wall_overhead"] for r in over], 0.4, label="wall time")
    ax1.bar(x + 0.2, [100 * r["cpu_overhead"] for r in over], 0.4, label="CPU time")
    ax1.axhline(5, color="green", ls="--", lw=1, label="5 % (dense BSP)")
    ax1.axhline(15, color="orange", ls="--", lw=1, label="15 % (sparse/SSP)")
    ax1.set_xticks(x, labels, fontsize=6, rotation=90)
    ax1.set_ylabel("overhead vs no fault tolerance (%)")
    ax1.set_title("FreeLauncher throughput overhead (median of paired runs)")
    ax1.legend(fontsize=7)
    groups = sorted({(r["workload"], r["consistency"]) for r in rec})
    methods = ["FreeLauncher k=2", "FreeLauncher k=3", NO_STANDBY, "checkpoint", "restart from scratch"]
    width = 0.16
    for i, m in enumerate(methods):
        picked = [
            next(
                r
                for r in rec
                if (r["workload"], r["consistency"]) == g
                and (r["method"] == m or (m == "checkpoint" and r["method"].startswith(m)))
            )
            for g in groups
        ]
        x2 = np.arange(len(groups)) + (i - 2) * width
        name = m + (" (best interval)" if m == "checkpoint" else "")
        ax2.bar(x2, [r["seconds"] for r in picked], width, label=name)
        ax3.bar(x2, [r["rest"] for r in picked], width, label=name)
    for ax, title in (
        (ax2, "Recovery time (kill to regained progress)"),
        (ax3, "Recovery time without the replacement"),
    ):
        ax.set_xticks(np.arange(len(groups)), [f"{w}\n{c}" for w, c in groups], fontsize=7)
        ax.set_ylabel("seconds (median)", fontsize=8)
        ax.set_title(title, fontsize=10)
    ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "ps.png", dpi=110)


def main(argv: list[str]) -> None:
    raw = RESULTS / "ps.json"
    if "--report-only" in argv:  # rewrite ps.md and ps.png from the numbers of the last run
        saved = json.loads(raw.read_text())
        write_report(
            saved["overhead"], saved["recovery"], saved["args"], tuple(saved["load"]), saved["seconds"]
        )
        plot(saved["overhead"], saved["recovery"])
        return
    quick, dense = "--quick" in argv, "--dense" in argv
    repeat = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--repeat=")),
                  1 if quick else 30 if dense else 10)
    repeat_rec = 1 if quick else 3
    clocks = 12 if quick else next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--clocks=")), 100)
    begin, load0 = time.perf_counter(), os.getloadavg()[0]
    over: list[dict[str, Any]] = []
    rec: list[dict[str, Any]] = []
    if dense:
        with local_ray(num_cpus=2), PSJob(PSConfig(servers=2, workers=4)) as job:
            for optimizer in (OPTIMIZER, "adam"):
                print(f"  overhead digits bsp {optimizer}", flush=True)
                over += overhead(job, "digits", "bsp", clocks, repeat, optimizer=optimizer)
        args = {"cmd": "".join(f" {a}" for a in argv), "clocks": clocks, "repeat": repeat}
        load, seconds = (load0, os.getloadavg()[0]), time.perf_counter() - begin
        (RESULTS / "ps_dense.json").write_text(
            json.dumps({"overhead": over, "args": args, "load": load, "seconds": seconds}, indent=1)
        )
        write_dense_report(over, args, load, seconds)
        print((RESULTS / "ps_dense.md").read_text())
        return
    with local_ray(num_cpus=2), PSJob(PSConfig(servers=2, workers=4)) as job:
        for workload in WORKLOADS:
            for consistency in ("bsp", "ssp"):
                print(f"  overhead {workload} {consistency}", flush=True)
                over += overhead(job, workload, consistency, clocks, repeat)
        print("  overhead digits bsp adam", flush=True)
        over += overhead(job, "digits", "bsp", clocks, repeat, optimizer="adam")
        for workload in WORKLOADS:
            for consistency in ("bsp", "ssp"):
                print(f"  recovery {workload} {consistency}", flush=True)
                rec += recovery(job, workload, consistency, clocks=24, kill_at=16, repeat=repeat_rec)
    args = {
        "cmd": "".join(f" {a}" for a in argv),
        "clocks": clocks,
        "repeat": repeat,
        "repeat_rec": repeat_rec,
    }
    load, seconds = (load0, os.getloadavg()[0]), time.perf_counter() - begin
    RESULTS.mkdir(parents=True, exist_ok=True)
    raw.write_text(
        json.dumps(
            {"overhead": over, "recovery": rec, "args": args, "load": load, "seconds": seconds}, indent=1
        )
    )
    write_report(over, rec, args, load, seconds)
    plot(over, rec)
    print((RESULTS / "ps.md").read_text())
