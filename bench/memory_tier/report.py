"""The memory tier benchmark's report (markdown) and figure, from the figures bench/memory_tier
gathered (also kept as JSON beside the report)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

MiB = 1 << 20
CORES = 2  # this machine's: every rank's training and background saves share them
OVERHEAD_TARGET, RECOVERY_TARGET = 0.10, 0.3
NAMES = {"ddp": "DDP", "fsdp": "FSDP2"}


def _flat(blocks: list[list[float]]) -> list[float]:
    return [x for block in blocks for x in block]


def step_figures(steps: dict[str, Any], every: int) -> dict[str, float]:
    """Seconds per step of each configuration and what the saves add, from one kind's blocks."""
    none, memory, plain = steps["none"], steps["memory"], steps["persistent"]
    sizes = steps["sizes"]
    base = sum(none["block"]) / (sizes["none"] * len(none["block"]))
    steady = [x for block in memory["step"] for x in block[1:]]  # each waited for its predecessor's save
    mem_step = statistics.mean(steady or _flat(memory["step"]))
    mem_block = sum(memory["block"]) / (sizes["memory"] * len(memory["block"]))
    extra_save = statistics.mean(p - n for p, n in zip(plain["block"], none["block"], strict=True))
    per_plain = max(extra_save, 0.0) / every
    cpu_base = sum(none["cpu"]) / (sizes["none"] * len(none["cpu"]))
    cpu_mem = sum(memory["cpu"]) / (sizes["memory"] * len(memory["cpu"]))
    floor = statistics.median(steps["floor"])
    return {
        "base": base, "memory": mem_step, "memory_block": mem_block, "memory_over": mem_step - base,
        "memory_stall": statistics.median(_flat(memory["stall"])),
        "memory_stall_max": max(_flat(memory["stall"])), "plain_extra": extra_save, "plain_over": per_plain,
        "plain_stall": statistics.median(_flat(plain["stall"])),
        "plain_stall_max": max(_flat(plain["stall"])),
        "both_over": mem_step - base + per_plain, "floor": floor, "cpu_base": cpu_base, "cpu_mem": cpu_mem,
        "cpu_extra": cpu_mem - cpu_base, "first_memory": steps["first_stall"]["memory"],
        "first_plain": steps["first_stall"]["persistent"],
    }  # fmt: skip


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if abs(x) >= 0.095 else f"{100 * x:.1f}%"


def _ms(x: float) -> str:
    return f"{1000 * x:.0f} ms" if x < 10 else f"{x:.1f} s"


def step_table(results: dict[str, Any], every: int) -> list[str]:
    lines = [
        "| kind | configuration | time per step | added per step (of a step) | save call (stall): median; "
        "max "
        "| CPU-seconds per step, all ranks |",
        "|---|---|---|---|---|---|",
    ]
    for kind, r in results.items():
        f, name = step_figures(r["steps"], every), NAMES[kind]
        lines += [
            f"| {name} | no checkpoint (baseline) | {_ms(f['base'])} | - | - | {f['cpu_base']:.2f} |",
            f"| {name} | memory save every step (steady state) | {_ms(f['memory'])} | "
            f"{_ms(f['memory_over'])} "
            f"({_pct(f['memory_over'] / f['base'])}) | {_ms(f['memory_stall'])}; "
            f"{_ms(f['memory_stall_max'])} "
            f"| {f['cpu_mem']:.2f} |",
            f"| {name} | persistent save every {every} steps (no memory tier) | "
            f"{_ms(f['base'] + f['plain_over'])} "
            f"| {_ms(f['plain_over'])} ({_pct(f['plain_over'] / f['base'])}) | {_ms(f['plain_stall'])}; "
            f"{_ms(f['plain_stall_max'])} | - |",
            f"| {name} | memory every step + persistent every {every} (the sum) | "
            f"{_ms(f['base'] + f['both_over'])} | {_ms(f['both_over'])} ({_pct(f['both_over'] / f['base'])}) "
            "| - | - |",
            f"| {name} | floor: copy the rank's state into kept buffers | - | {_ms(f['floor'])} "
            f"({_pct(f['floor'] / f['base'])}) | - | - |",
        ]
    return lines


def phase_table(results: dict[str, Any]) -> list[str]:
    """Per memory save, mean over the ranks: where the background's time goes (wall, not CPU)."""
    kinds = list(results)
    labels: list[str] = []
    per: dict[str, dict[str, float]] = {}
    for kind in kinds:
        steps = results[kind]["steps"]
        saves = steps["sizes"]["memory"] * len(steps["phases"])
        sums: dict[str, float] = {}
        for block in steps["phases"]:
            for rank in block:
                for label, value in rank.items():
                    sums[label] = sums.get(label, 0.0) + value / len(block) / saves
                    if label not in labels:
                        labels.append(label)
        per[kind] = sums
    order = sorted(labels, key=lambda x: (not x.startswith("snapshot"), "persistent" in x))
    lines = ["| phase (per memory save, mean over ranks) | " + " | ".join(NAMES[k] for k in kinds) + " |",
             "|---|" + "---|" * len(kinds)]  # fmt: skip
    for label in order:
        if label.startswith("persistent"):
            continue  # (no persistent write falls in the memory blocks)
        cells = [_ms(per[k].get(label, 0.0)) for k in kinds]
        lines.append(
            f"| {label.replace(' ', '&nbsp;', len(label) - len(label.lstrip()))} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def recovery_figures(rounds: dict[str, list[list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Per source: the slowest rank's time of each round (open + restore), and what was read."""
    out = {}
    for source, got in rounds.items():
        times = [max(g["time"] for g in ranks) for ranks in got]
        out[source] = {
            "times": times, "best": min(times), "median": statistics.median(times),
            "open": statistics.median(max(g["open"] for g in ranks) for ranks in got),
            "sources": sorted({g["source"] for ranks in got for g in ranks}),
            "persistent_bytes": max(sum(g["persistent_bytes"] for g in ranks) for ranks in got),
            "memory_bytes": max(sum(g["memory_bytes"] for g in ranks) for ranks in got),
            "identical": all(g["bit_identical"] for ranks in got for g in ranks),
        }  # fmt: skip
    return out


def _ratio(rec: dict[str, dict[str, Any]], source: str, against: str) -> tuple[float, float]:
    """best / best, and the median over rounds of the round's own ratio."""
    a, b = rec[source], rec[against]
    paired = [x / y for x, y in zip(a["times"], b["times"], strict=True)]
    return a["best"] / b["best"], statistics.median(paired)


def recovery_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| kind | source | recovery (open + restore), best; median | of which opening the manager | "
        "/ local disk (page cache warm): best; paired median | / local disk (evicted): best; paired median "
        "| where each rank's restore came from (`mgr.recovery.source`) | bytes read, persistent tier; memory "
        "tier (all ranks) | bit-identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in results.items():
        rec = recovery_figures(r["recovery"])
        for source, f in rec.items():
            warm, cold = _ratio(rec, source, "disk"), _ratio(rec, source, "disk, cold")
            lines.append(
                f"| {NAMES[kind]} | {source} | {_ms(f['best'])}; {_ms(f['median'])} | {_ms(f['open'])} | "
                f"{warm[0]:.2f}x; {warm[1]:.2f}x | {cold[0]:.2f}x; {cold[1]:.2f}x | "
                f"{', '.join(f['sources'])} | "
                f"{f['persistent_bytes'] / MiB:.0f} MiB; {f['memory_bytes'] / MiB:.0f} MiB | "
                f"{'yes' if f['identical'] else '**no**'} |"
            )
    return lines


def kill_table(results: dict[str, Any], every: int) -> list[str]:
    lines = [
        "| kind | saves | kill | rank killed | last step every rank completed | step restored | restored "
        "from "
        "| steps lost | restart's restore |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in results.items():
        for mode, label in modes(every):
            for i, t in enumerate(r[mode], 1):
                where = ", ".join(sorted(set(t["sources"])))
                lines.append(
                    f"| {NAMES[kind]} | {label} | {i} | {t['victim']} | {t['completed']} (each rank's last: "
                    f"{', '.join(map(str, t['last_steps']))}) | {t['restored']} | {where} | {t['lost']} | "
                    f"{t['restore_seconds']:.2f} s |"
                )
    return lines


def modes(every: int) -> list[tuple[str, str]]:
    """The kill trials' schedules: their key in the results, their name in the report."""
    return [
        ("kills", "memory every step (async, the default)"),
        ("sync", "memory every step, `async_save=False`"),
        ("today", f"persistent every {every} (no memory tier: today)"),
    ]


def _lost(results: dict[str, Any], mode: str) -> str:
    return "; ".join(f"{NAMES[k]} {[t['lost'] for t in r[mode]]}" for k, r in results.items())


def targets(results: dict[str, Any], every: int) -> list[str]:
    out = []
    ok = {m: all(t["lost"] == 0 for r in results.values() for t in r[m]) for m in ("kills", "sync")}
    verdict = "met" if all(ok.values()) else ("**missed**" if not any(ok.values()) else "**mixed**")
    out.append(
        f"- **Steps lost per failure, memory save every step: 0** — {verdict}: async saves (the default) "
        f"{_lost(results, 'kills')}; `async_save=False` {_lost(results, 'sync')} (persistent every {every} "
        f"alone, today: {_lost(results, 'today')})."
    )
    parts, met = [], True
    for kind, r in results.items():
        f = step_figures(r["steps"], every)
        share = f["memory_over"] / f["base"]
        met &= share <= OVERHEAD_TARGET
        parts.append(
            f"{NAMES[kind]} {_pct(share)} ({_ms(f['memory_over'])} on a {_ms(f['base'])} step; floor, the "
            "copy "
            f"into kept buffers: {_pct(f['floor'] / f['base'])})"
        )
    out.append(f"- **Per-step overhead of a memory save every step <= 10% of a step** — "
               f"{'met' if met else '**missed**'}: " + "; ".join(parts) + ".")  # fmt: skip
    parts, verdicts = [], []
    for kind, r in results.items():
        rec = recovery_figures(r["recovery"])
        for source in ("memory", "peer"):
            for against, label in (("disk", "warm"), ("disk, cold", "evicted")):
                best, paired = _ratio(rec, source, against)
                verdicts.append(best <= RECOVERY_TARGET and paired <= RECOVERY_TARGET)
                parts.append(f"{NAMES[kind]} {source} / disk {label} {best:.2f}x; {paired:.2f}x")
    verdict = "met" if all(verdicts) else ("**missed**" if not any(verdicts) else "**mixed**")
    head = "- **Recovery from memory or a peer <= 0.3x a restore from local disk** (best; paired median)"
    out.append(f"{head} — {verdict}: " + "; ".join(parts) + ".")
    clean = all(
        recovery_figures(r["recovery"])[s]["persistent_bytes"] == 0
        for r in results.values()
        for s in ("memory", "peer")
    )
    out.append(
        f"- **No persistent read when a copy exists in memory** — {'met' if clean else '**missed**'}: every "
        "memory and peer restore named its source `memory` or `peer <rank>` and read 0 bytes of the "
        "persistent "
        "tier's files (bench/readcount.py)."
    )
    return out


def report(results: dict[str, Any], meta: dict[str, Any]) -> str:
    plan, every = meta["plan"], meta["plan"]["persist_every"]
    kinds = ", ".join(NAMES[k] for k in results)
    part = {k: r["steps"]["part_bytes"][0] / MiB for k, r in results.items()}
    lines = [
        "# The memory tier: a memory save every step, recovery from each source, steps lost",
        "",
        f"Produced by `{meta['command']}` on {meta['when']}, {meta['machine']}; memory directories on tmpfs "
        "(/dev/shm), the persistent tier on ext4 on a virtual disk, S3 = moto's ThreadedMotoServer on "
        "127.0.0.1 "
        f"(a child process); the whole run took {meta['elapsed'] / 60:.1f} min; load average {meta['load']}. "
        "Other sessions' jobs (tests, a field test of 4 ranks) shared the machine during the run.",
        "",
        f"**{CORES} cores only**: {plan['world']} ranks (each with its background save thread and gloo's "
        "threads) oversubscribe them, so everything here is CPU-bound and noisy, and a memory save's "
        "background "
        "work does not run beside training, as it would on a host with cores to spare: it takes the "
        "training's "
        "cores. Ratios are taken within one run, between configurations measured in the same processes, "
        "block "
        "after block (each round starts with the next configuration).",
        "",
        f"State = bench/distributed's MLP of 2048x2048 layers, fp32 parameters + AdamW's two moments, "
        f"{plan['total']} MiB nominal in total ("
        + ", ".join(f"{NAMES[k]}: {v:.0f} MiB per rank" for k, v in part.items())
        + f"), {kinds}, {plan['world']} ranks (one process each, gloo on 127.0.0.1), pretended as 2 hosts of "
        f"{plan['world'] // 2} rank(s) (`MemoryTier(host=...)`). A training step: forward and backward of a "
        f"batch of {plan['batch']} x 2048 per rank (loss: mean squared error), the gradient all-reduce "
        "(DDP) or "
        "FSDP2's all-gathers and reduce-scatters, AdamW's step.",
        "",
        "- **memory save every step**: `CheckpointManager(dir, keep_last=2, "
        "memory=MemoryTier('/dev/shm/...', "
        f"persist_every={every}, copies=2, keep_last=2, host=...))`, `save` after every step (async). Each "
        "save "
        "copies the rank's state into staging, then in the background commits it in the rank's memory "
        "directory and sends it to a rank on the other host, which commits and checks the copy. Measured "
        "over "
        f"{plan['rounds']} blocks of {plan['memory_block']} steps: the steady state is each step after a "
        "block's first (its save waits for the previous one, one save in flight); no persistent write falls "
        "in "
        f"these steps (the {every}th save's), so its cost is added from the next row: **the sum** row.",
        f"- **persistent save every {every} steps**: plain `CheckpointManager(dir, keep_last=2)` (async), as "
        f"without a memory tier: {plan['rounds']} blocks of {plan['block']} steps with one save in the "
        "middle; "
        "the block's time over the baseline block's of the same round is one save's cost, spread over "
        f"{every} "
        "steps.",
        "- Every block ends with `wait()`, timed in it. Time per step = the slowest rank's. **Floor**: every "
        "rank copies its state (its local shards) into buffers allocated beforehand, all ranks at once: the "
        "least a snapshot does. CPU-seconds: user + system of every rank's process (all threads), summed.",
        "",
        "## Targets",
        "",
        *targets(results, every),
        "",
        "## 1. What a save costs a training step",
        "",
        *step_table(results, every),
        "",
        *ceiling(results, every),
        "",
        "### Where a memory save's time goes",
        "",
        "Timed inside crashsafe (bench/distributed/phases.py wraps its functions), per memory save, wall "
        "time "
        "on the rank's background thread (the snapshot on the training thread), mean over the ranks:",
        "",
        *phase_table(results),
        "",
        "## 2. Recovery: a restarted job's restore of the same step",
        "",
        recovery_text(plan),
        "",
        *recovery_table(results),
        "",
        "## 3. Steps lost per failure",
        "",
        kills_text(plan, meta["seed"]),
        "",
        *kill_table(results, every),
        "",
    ]
    return "\n".join(lines) + "\n"


def ceiling(results: dict[str, Any], every: int) -> list[str]:
    """Why the memory save costs what it does here: the CPU it adds, on 2 cores, and its bytes."""
    lines = ["**The ceiling on this machine.** "]
    parts = []
    for kind, r in results.items():
        f = step_figures(r["steps"], every)
        part = r["steps"]["part_bytes"][0]
        parts.append(
            f"{NAMES[kind]}: a memory save adds {f['cpu_extra']:.2f} CPU-seconds per step over the "
            f"{len(r['steps']['part_bytes'])} ranks; on {CORES} cores, already busy with training, that is "
            "at least "
            f"{_ms(f['cpu_extra'] / CORES)} of wall time per step "
            f"({_pct(f['cpu_extra'] / CORES / f['base'])} of a "
            f"step) whatever the code's overlap; per save each rank moves its {part / MiB:.0f} MiB part "
            "about 8 "
            "times (copy into staging, write + checksum its memory step, read + checksum to send, gloo's "
            "send "
            "and receive over loopback, checksum, write + commit the copy, read it back + checksum)"
        )
    lines[0] += "; ".join(parts) + (
        ". The floor (the copy into staging alone) is the part the training thread must wait for; the rest "
        "is background work that a host with idle cores runs beside the training step, and that here "
        "competes "
        "with it for the same 2 cores."
    )
    return lines


def recovery_text(plan: dict[str, Any]) -> str:
    return (
        "One step is saved once with a memory tier whose every save is also persistent (so the memory tier "
        "and the local disk hold the very same step) and once to S3; then, round after round "
        f"({plan['recover_rounds']}, each starting with the next source), every rank builds a fresh model "
        "and "
        "optimizer and opens a `CheckpointManager(persistent, memory=MemoryTier(...))` and `restore`s, as a "
        "restarted job does: **memory** (every rank's own copy in /dev/shm); **peer** (host b's memory "
        "directory deleted first: its ranks pull their parts from host a's copies); **disk** (an empty "
        "memory "
        "tier: the local persistent tier, its files in the page cache as after a save); **disk, cold** (the "
        "same, the step's files evicted from the page cache with `posix_fadvise(DONTNEED)` first: on this "
        "virtual machine the host may still cache them); **s3** (an empty memory tier, the persistent tier "
        "`s3://` on moto). Time = from opening the manager until `restore` returns, slowest rank. Every "
        "restore is checked bit for bit against the state saved, and its `mgr.recovery.source` and the bytes "
        "it read from each tier's files are checked (the run stops if a memory or peer restore read the "
        "persistent tier). The ratios' target is against the local disk; both disk rows are shown, since a "
        "warm page cache is itself a copy in memory."
    )


def kills_text(plan: dict[str, Any], seed: int) -> str:
    return (
        "The job (bench/memory_tier/job.py: restore, then train, `save` per the row's schedule, print "
        "`step N` once step N is trained and its `save` returned) is started on its ranks; "
        f"{plan['kill_span'][0]} to {plan['kill_span'][1]} steps (memory) or {plan['today_span'][0]} to "
        f"{plan['today_span'][1]} steps (persistent only) after the step it resumed from (drawn at random, "
        "seed "
        f"{seed}), a random rank is SIGKILLed at a random instant of the next step, and the other ranks "
        "right after (as a launcher's agent stops the group; their saves in flight die too); then the job is "
        "restarted on the same memory directories and restores. **Last step every rank completed**: the "
        "smallest of the ranks' last `step N` lines (every line a rank printed before it died is read). "
        "**Steps lost** = that step minus the step restored. Trials are chained: each restart trains on to "
        "the next kill. With async saves a step whose save was still in flight when the rank died can be "
        "lost "
        "(the memory tier restores the newest step held complete)."
    )


def plot(results: dict[str, Any], path: Path, every: int) -> None:
    """Time per step by configuration, and recovery time by source, per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    kinds = list(results)
    rows = ["no checkpoint", "memory save every step", f"persistent save every {every}", "floor (copy)"]
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        values = []
        for kind in kinds:
            f = step_figures(results[kind]["steps"], every)
            values.append([f["base"], f["memory"], f["base"] + f["plain_over"], f["floor"]][i])
        left.bar([j + i * width for j in range(len(kinds))], values, width, label=row)
    left.set_xticks([j + width * 1.5 for j in range(len(kinds))], [NAMES[k] for k in kinds])
    left.set_ylabel("seconds per training step")
    left.set_title("training step with each kind of save")
    left.legend(fontsize=8)
    sources = list(next(iter(results.values()))["recovery"])
    width = 0.8 / len(sources)
    for i, source in enumerate(sources):
        values = [recovery_figures(results[k]["recovery"])[source]["best"] for k in kinds]
        right.bar([j + i * width for j in range(len(kinds))], values, width, label=source)
    right.set_xticks(
        [j + width * (len(sources) - 1) / 2 for j in range(len(kinds))], [NAMES[k] for k in kinds]
    )
    right.set_yscale("log")
    right.set_ylabel("seconds (log)")
    right.set_title("recovery: open + restore, slowest rank (best)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
