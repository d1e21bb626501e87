"""The memory tier benchmark's report (markdown) and figure, from the figures bench/memory_tier
gathered (also kept as JSON beside the report)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

MiB = 1 << 20
CORES = 2  # this machine's (where the JSON does not say): every rank's training and saves share them
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
    two_copy = statistics.median(_flat(steps.get("two_copy_floor", [])) or [float("nan")])
    two_copy_cpu = statistics.mean(steps.get("two_copy_cpu", []) or [float("nan")])
    return {
        "two_copy": two_copy, "two_copy_cpu": two_copy_cpu,
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
    order = labels  # (as bench/memory_tier/rank.py lists them)
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
        "| kind | source | recovery (open + restore), best; median | of which opening the manager | / local "
        "disk (page cache warm): best; paired median | / local disk (evicted): best; paired median | / S3: "
        "best "
        "| where each rank's restore came from (`mgr.recovery.source`) | bytes read, persistent tier; memory "
        "tier (all ranks) | bit-identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in results.items():
        rec = recovery_figures(r["recovery"])
        for source, f in rec.items():
            warm, cold = _ratio(rec, source, "disk"), _ratio(rec, source, "disk, cold")
            s3 = f"{_ratio(rec, source, 's3')[0]:.2f}x" if "s3" in rec else "-"
            lines.append(
                f"| {NAMES[kind]} | {source} | {_ms(f['best'])}; {_ms(f['median'])} | {_ms(f['open'])} | "
                f"{warm[0]:.2f}x; {warm[1]:.2f}x | {cold[0]:.2f}x; {cold[1]:.2f}x | {s3} | "
                f"{', '.join(f['sources'])} | {f['persistent_bytes'] / MiB:.0f} MiB; "
                f"{f['memory_bytes'] / MiB:.0f} MiB | {'yes' if f['identical'] else '**no**'} |"
            )
    return [*lines, "", *recovery_ceiling(results)]


def recovery_ceiling(results: dict[str, Any]) -> list[str]:
    """Why memory is not 0.3x the local disk here: both are reads of RAM, with the same work around."""
    parts = []
    floors = []
    for kind, r in results.items():
        rec, floor = recovery_figures(r["recovery"]), statistics.median(r["steps"]["floor"])
        memory = rec["memory"]["best"]
        parts.append(
            f"{NAMES[kind]}: memory {memory / rec['disk']['best']:.2f}x the warm disk, "
            f"{memory / rec['disk, cold']['best']:.2f}x the evicted one, {memory / floor:.1f}x the copy "
            "floor "
            "of section 1"
        )
        if "read_floor" in r:  # slowest rank's best, all ranks at once
            read = {source: max(rank[source] for rank in r["read_floor"]) for source in ("memory", "disk")}
            floors.append(
                f"{NAMES[kind]}: {_ms(read['memory'])} from the RAM disk, {_ms(read['disk'])} from the "
                f"warm page cache ({read['memory'] / read['disk']:.2f}x)"
            )
    measured = (
        " **The floor of the ratio, measured**: every rank reading its part's bytes into a kept buffer "
        "and checksumming them, all ranks at once, nothing else (`read_floors` in "
        "bench/memory_tier/rank.py): " + "; ".join(floors) + ". Where that ratio is above 0.3x, no "
        "restore from this RAM disk can be 0.3x one from a local disk whose page cache holds the step."
        if floors
        else ""
    )
    return [
        "**The ceiling.** A restore from the memory tier reads the part from tmpfs, which is RAM, as is the "
        "page cache that holds a local step just written; an evicted step is read from a virtual disk whose "
        "host may cache it too. Around the read, all of them do the same work: open the manager, agree on "
        "the "
        "step, checksum every byte, allocate the fresh optimizer's moments and copy the values in "
        "(`load_state_dict`). Best times: " + "; ".join(parts) + ". A peer restore adds the transfer of the "
        "wiped host's parts over loopback gloo (sent, checked, committed and read back, as a save's copies "
        "are). Against a disk that has not cached the step, or an object store, the same memory restore is "
        "the fraction in the `/ S3` column." + measured
    ]


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


def targets(results: dict[str, Any], every: int, cores: int) -> list[str]:
    out = []
    ok = {m: all(t["lost"] <= 0 for r in results.values() for t in r[m]) for m in ("kills", "sync")}
    verdict = "met" if all(ok.values()) else ("**missed**" if not any(ok.values()) else "**mixed**")
    out.append(
        f"- **Steps lost per failure, memory save every step: 0** — {verdict}: with `async_save=False` "
        f"{_lost(results, 'sync')} ({'met' if ok['sync'] else 'missed'}); with async saves, the default, "
        f"{_lost(results, 'kills')} "
        f"({'met' if ok['kills'] else 'missed: the step whose save was in flight'}); "
        f"persistent every {every} alone, today: {_lost(results, 'today')}."
    )
    parts, met = [], True
    for kind, r in results.items():
        f = step_figures(r["steps"], every)
        share = f["memory_over"] / f["base"]
        met &= share <= OVERHEAD_TARGET
        parts.append(
            f"{NAMES[kind]} {_pct(share)} ({_ms(f['memory_over'])} on a {_ms(f['base'])} step; floor, the "
            "copy "
            f"into kept buffers: {_pct(f['floor'] / f['base'])}; the least a tier with a second copy "
            f"adds here, measured: {_pct(f['two_copy_cpu'] / cores / f['base'])})"
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
    cores = meta.get("cores", CORES)
    spare = cores >= 2 * plan["world"]  # (a core per rank's training and one for its background)
    kinds = ", ".join(NAMES[k] for k in results)
    part = {k: r["steps"]["part_bytes"][0] / MiB for k, r in results.items()}
    lines = [
        "# The memory tier: a memory save every step, recovery from each source, steps lost",
        "",
        f"Produced by `{meta['command']}` on {meta['when']}, {meta['machine']}; memory directories on "
        f"{meta.get('shm', 'tmpfs (/dev/shm)')}, the persistent tier on ext4 on a virtual disk, "
        + (
            "S3 = moto's ThreadedMotoServer on 127.0.0.1 (a child process)"
            if meta.get("s3", True)
            else "no S3 (`--no-s3`)"
        )
        + f"; the whole run took {meta['elapsed'] / 60:.1f} min; load average {meta['load']}"
        + (
            ". Other sessions' jobs (tests, a field test of 4 ranks) shared the machine during the run."
            if not spare
            else "."
        )
        + "",
        "",
        (
            f"**{cores} cores only**: {plan['world']} ranks (each with its background save thread and gloo's "
            "threads) oversubscribe them, so everything here is CPU-bound and noisy, and a memory save's "
            "background work does not run beside training, as it would on a host with cores to spare: it "
            "takes the training's cores."
            if not spare
            else f"**{cores} cores**: the {plan['world']} ranks train on one thread each "
            "(`OMP_NUM_THREADS=1`), which leaves cores to their background saves and gloo's threads; a "
            "memory save still shares the memory bandwidth, its process's GIL and loopback with training."
        )
        + " Ratios are taken within one run, between configurations measured in the same processes, "
        "block after block (each round starts with the next configuration).",
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
        "least a snapshot does. CPU-seconds: user + system of every rank's process (all threads), summed. "
        "A fraction of a step depends on the step's length (here the batch's); the milliseconds a save adds "
        "depend on it less (the CPU a save takes is the same whatever the step).",
        "",
        "## Targets",
        "",
        *targets(results, every, cores),
        "",
        "## 1. What a save costs a training step",
        "",
        *step_table(results, every),
        "",
        *ceiling(results, every, cores),
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


def ceiling(results: dict[str, Any], every: int, cores: int) -> list[str]:
    """Why a memory save costs what it does here: the CPU it adds on these cores, its bytes, its stall."""
    figures = {k: step_figures(r["steps"], every) for k, r in results.items()}
    bound = {k: f["floor"] / f["base"] for k, f in figures.items()}
    two_copy = {k: f["two_copy_cpu"] / cores / f["base"] for k, f in figures.items()}
    lines = [
        "**The ceiling on this machine.** Every rank's background save runs on the same "
        f"{cores} cores as every rank's training; where they are all busy, the CPU a memory save adds is "
        "wall time added to the step, whatever the overlap:",
        "",
        "| kind | part per rank (memory step) | CPU-seconds a memory save adds per step, all ranks | its "
        "least wall "
        f"time on {cores} cores (of a step) | measured per-step overhead (of a step) | save call, median "
        "(of a "
        "step) | floor: the copy into staging (of a step) | the least a tier with a second copy does, "
        f"measured: wall, all ranks at once; its CPU-seconds, all ranks; their least wall time on {cores} "
        "cores (of a step) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in results.items():
        f = step_figures(r["steps"], every)
        part, least = r["steps"]["part_bytes"][0], f["cpu_extra"] / cores
        lines.append(
            f"| {NAMES[kind]} | {part / MiB:.0f} MiB | {f['cpu_extra']:.2f} | {_ms(least)} "
            f"({_pct(least / f['base'])}) "
            f"| {_ms(f['memory_over'])} ({_pct(f['memory_over'] / f['base'])}) | {_ms(f['memory_stall'])} "
            f"({_pct(f['memory_stall'] / f['base'])}) | {_ms(f['floor'])} ({_pct(f['floor'] / f['base'])}) "
            f"| {_ms(f['two_copy'])}; {f['two_copy_cpu']:.2f}; {_ms(f['two_copy_cpu'] / cores)} "
            f"({_pct(f['two_copy_cpu'] / cores / f['base'])}) |"
        )
    lines += [
        "",
        "Per save each rank passes over its part about seven times (the table below times them): the copy "
        "into staging; writing its memory step and checksumming it; gloo's send and receive over loopback "
        "(a copy into the kernel and one out of it); checksumming what arrived; writing and committing the "
        "copy. (A rank sends its part from the staged bytes it was written from, and a copy is not read "
        "back: two passes fewer than the first version, whose run measured DDP +338%, FSDP2 +48% on a "
        "busier machine.) A DDP rank's memory part is its whole replica (docs/memory.md), so the 4 DDP "
        "ranks write and send 4 times the bytes of the 4 FSDP2 ranks for the same model, and their "
        "background save outlasts a training step: each save then waits for the one in flight (the save "
        "call's median above is that wait; the snapshot itself is in the table below). FSDP2's save keeps "
        "up: its save call is a few times the copy floor, and its overhead is about the CPU its background "
        "adds. On a host whose cores are not all busy training (a GPU job's CPUs), that background work "
        "runs beside the step and the stall would be the save call alone. **The least any memory tier "
        "with a second copy costs** is measured in the table's last column, all ranks at once, with the "
        "cheapest parts there are and none of crashsafe's: the snapshot copied straight into RAM-disk "
        "pages that exist already (no allocation, no staging buffer besides), the format's checksum, "
        "gloo's send from there to the peer while the peer's part is received straight into the pages "
        "of its copy, and a checksum of what arrived; no commit protocol, no retention, no agreement "
        "between the ranks "
        "(`_two_copy_floor` in bench/memory_tier/rank.py). Where every core is busy training, its CPU is "
        "time added to a step: "
        + "; ".join(f"{NAMES[k]} {_pct(two_copy[k])} of a step" for k in two_copy)
        + ". A target below that is below what any memory tier with a second copy, sent over gloo, "
        "can do on these cores. (An estimate without the checksums and gloo's kernel copies: four "
        "passes at the staging copy's speed, "
        + ", ".join(f"{NAMES[k]} {_pct(4 * bound[k])}" for k in bound)
        + ".) A DDP part of 1/N of the replica (as the persistent tier writes) would cut DDP's bytes "
        "4 times.",
    ]
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
        "The job (bench/memory_tier/job.py: restore, then train, `save` per the row's schedule, print `step "
        "N` "
        "once step N is trained and its `save` returned) is started on its ranks; "
        f"{plan['kill_span'][0]} to {plan['kill_span'][1]} steps (memory tier) or {plan['today_span'][0]} to "
        f"{plan['today_span'][1]} steps (persistent only) after the step it resumed from (drawn at random, "
        "seed "
        f"{seed}), a random rank is SIGKILLed at a random instant of the next step, and the other ranks "
        "right "
        "after (as a launcher's agent stops the group; their saves in flight die too); then the job is "
        "restarted on the same memory directories and restores. **Last step every rank completed**: the "
        "smallest of the ranks' last `step N` lines (every line a rank printed before it died is read). "
        "Trials are chained: each restart trains on to the next kill. **Steps lost** = that step minus the "
        "step restored: **1** is the step whose save was in flight (async: `save` returns after the snapshot "
        "and the memory step is committed in the background; one save is in flight at a time, so at most 1); "
        "**-1** is a step restored whose `save` had not returned yet (`async_save=False`: the ranks were "
        "killed "
        "after every part and copy of it was committed, before the call returned): nothing lost. A restart "
        "that finds no step starts from step 0 (`none`: the persistent-only runs were killed before their "
        "first save)."
    )


def plot(results: dict[str, Any], path: Path, every: int) -> None:
    """Time per step by configuration, and recovery time by source, per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

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
    right.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    right.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    right.set_ylabel("seconds (log)")
    right.set_title("recovery: open + restore, slowest rank (best)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
