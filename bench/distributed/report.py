"""The distributed benchmark's markdown report and figure, from the launches' gathered results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.distributed.model import WIDTH, layers_for

MiB = 1 << 20
NAMES = {
    "crashsafe": "crashsafe async",
    "crashsafe_sync": "crashsafe sync (async_save=False)",
    "dcp_async": "dcp.async_save",
    "dcp_async_cached": "dcp.async_save, cached staging",
    "dcp": "dcp.save",
    "raw": "raw write+fsync of each rank's share (ceiling)",
}
RESTORED_AS = {"crashsafe": "crashsafe", "dcp": "dcp"}  # dcp.load reads either DCP save's files


def state_bytes(size_mib: int) -> int:
    """The exact state the bench builds for ``size_mib``: parameters + 2 AdamW moments (fp32)."""
    return layers_for(size_mib * MiB) * (WIDTH * WIDTH + WIDTH) * 4 * 3


PHASE_KEYS = {
    "hash": "planning (describe, hash what ranks hold alike, exchange): DDP in the stall, FSDP2 after it",
    "copy": "stall: of which the copy into staging",
    "gather": "all_gather offers (in the stall) + reports (waits for the slowest rank)",
    "write": "write this rank's part (encode, write, checksum, fsync)",
    "commit": "commit on rank 0 + broadcast of its outcome",
}


def steady(values: list[float]) -> float:
    """The best save after the first (which allocates staging, thread pools, page cache)."""
    return min(values[1:]) if len(values) > 1 else values[0]


def _mid(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def median(values: list[float]) -> float:
    """The median save after the first."""
    return _mid(values[1:] or values)


def best_index(values: list[float]) -> int:
    """Which save :func:`steady` took."""
    return min(range(1, len(values)), key=lambda i: values[i]) if len(values) > 1 else 0


def _t(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def _spread(values: list[float]) -> str:
    """Best (median, min-max) of the saves after the first."""
    rest = values[1:] or values
    if len(rest) == 1:
        return _t(rest[0])
    return f"{_t(min(rest))} ({_t(median(values))}, {_t(min(rest))}-{_t(max(rest))})"


def _mib(values: list[int]) -> str:
    lo, hi = max(0, min(values)) / MiB, max(0, max(values)) / MiB
    return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _ratio(s: dict[str, Any], method: str, key: str, other: str, other_key: str) -> tuple[float, float]:
    """(best / best, median of the rounds' paired ratios) of two methods' figures after the first
    save. Both methods save once per round, close in time, so a paired ratio cancels most of the
    load that other jobs put on the machine, which changes from round to round."""
    best = steady(s[method][key]) / steady(s[other][other_key])
    mine, theirs = s[method][key], s[other][other_key]
    paired = [a / b for a, b in zip(mine[1:] or mine, theirs[1:] or theirs, strict=True)]
    return best, _mid(paired)


def _judged(ratio: tuple[float, float], target: float) -> str:
    """Met when both the best / best and the paired median ratio meet the target; mixed when one
    does; missed when neither."""
    met = [r <= target for r in ratio]
    verdict = "met" if all(met) else "**mixed**" if any(met) else "**missed**"
    return f"{ratio[0]:.2f}x; {ratio[1]:.2f}x {verdict}"


def targets(results: dict[str, Any]) -> list[str]:
    """One line per (state, ranks): the three targets' ratios (best; median), met or missed."""
    lines = [
        "| state | ranks | stall: crashsafe / dcp.async_save, best; paired median (target <= 0.5x) "
        "| durable: crashsafe / dcp.save, best; paired median (target <= 1.0x) "
        "| written in total / state (DDP target 1.0x) "
        "| stall / DCP's cached async_save (no target) | raw write+fsync / dcp.save "
        "| floor of a verified copy-first save: (crashsafe's stall + raw) / dcp.save "
        "| crashsafe sync durable / dcp.save |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, worlds in results.items():
        kind, size = case.split()
        for world, r in worlds.items():
            s = r["saves"]
            stall = _ratio(s, "crashsafe", "stall", "dcp_async", "stall")
            cached = _ratio(s, "crashsafe", "stall", "dcp_async_cached", "stall")
            durable = _ratio(s, "crashsafe", "durable", "dcp", "durable")
            raw = _ratio(s, "raw", "durable", "dcp", "durable")
            sync = _ratio(s, "crashsafe_sync", "durable", "dcp", "durable")
            snapshot, plain_write = steady(s["crashsafe"]["stall"]), steady(s["raw"]["durable"])
            floor = (snapshot + plain_write) / steady(s["dcp"]["durable"])
            written = sum(r["bytes"]["crashsafe"]) / state_bytes(int(size))
            dcp_written = sum(r["bytes"]["dcp"]) / state_bytes(int(size))
            once = f"{written:.3f}x " + (_verdict(written < 1.01) if kind == "ddp" else "(shards)")
            lines.append(
                f"| {kind.upper()} {state_bytes(int(size)) / MiB:.0f} MiB | {world[1:]} "
                f"| {_judged(stall, 0.5)} | {_judged(durable, 1.0)} "
                f"| {once} (DCP {dcp_written:.3f}x) | {cached[0]:.2f}x; {cached[1]:.2f}x "
                f"| {raw[0]:.2f}x; {raw[1]:.2f}x | {floor:.2f}x | {sync[0]:.2f}x; {sync[1]:.2f}x |"
            )
    return lines


def verdicts(results: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    """Which (state, ranks) had each target mixed or missed (see :func:`_judged`)."""
    keys = ("stall", "durable", "once")
    out: dict[str, dict[str, list[str]]] = {k: {"mixed": [], "missed": []} for k in keys}
    for case, worlds in results.items():
        kind, size = case.split()
        for world, r in worlds.items():
            s, name = r["saves"], f"{kind.upper()} {state_bytes(int(size)) / MiB:.0f} MiB x{world[1:]}"
            for key, ratio, target in (
                ("stall", _ratio(s, "crashsafe", "stall", "dcp_async", "stall"), 0.5),
                ("durable", _ratio(s, "crashsafe", "durable", "dcp", "durable"), 1.0),
            ):
                met = sum(x <= target for x in ratio)
                if met < 2:
                    out[key]["mixed" if met else "missed"].append(name)
            if kind == "ddp" and sum(r["bytes"]["crashsafe"]) / state_bytes(int(size)) >= 1.01:
                out["once"]["missed"].append(name)
    return out


def case_table(case: str, worlds: dict[str, Any]) -> list[str]:
    kind, size = case.split()
    lines = [
        f"### {kind.upper()} {state_bytes(int(size)) / MiB:.0f} MiB",
        "",
        "| ranks | method | stall: best (median, min-max) | durable: best (median, min-max) "
        "| first save: stall / durable | written per rank (MiB) | peak extra memory per rank, first save "
        "(MiB) | restore (peak extra MiB per rank) | resharded restore (peak extra MiB per rank) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for world, r in worlds.items():
        for method, name in NAMES.items():
            s = r["saves"][method]
            restored = RESTORED_AS.get(method)
            restore = r["restores"].get(restored or "")
            reshard = [(k, v) for k, v in r["restores"].items() if restored and k.startswith(restored + "<-")]
            resharded = ", ".join(
                f"{_t(v['time'])} from {k.split('<-')[1]} ranks ({_mib(v['mem'])})" for k, v in reshard
            )
            restore_text = f"{_t(restore['time'])} ({_mib(restore['mem'])})" if restore else "-"
            lines.append(
                f"| {world[1:]} | {name} | {_spread(s['stall'])} | {_spread(s['durable'])} "
                f"| {_t(s['stall'][0])} / {_t(s['durable'][0])} | {_mib(r['bytes'][method])} "
                f"| {_mib(s['mem'])} | {restore_text} | {resharded or '-'} |"
            )
    return [*lines, ""]


def breakdown(results: dict[str, Any]) -> list[str]:
    """crashsafe's best steady save, phase by phase (the slowest rank's time in each phase)."""
    from bench.distributed.phases import PHASES

    rows = []
    for case, worlds in results.items():
        kind, size = case.split()
        for world, r in worlds.items():
            s = r["saves"]
            i = best_index(s["crashsafe"]["durable"])
            per_rank = s["crashsafe"]["phases"][i]
            phase = {k: max(p.get(k, 0.0) for p in per_rank) for p in per_rank for k in p}
            rows.append((f"{kind.upper()} {size} MiB, {world[1:]} ranks", s, i, phase))
    lines = [
        "| phase | " + " | ".join(name for name, *_ in rows) + " |",
        "|---|" + "---|" * len(rows),
        "| stall (snapshot: copy into staging) | "
        + " | ".join(_t(s["crashsafe"]["stall"][i]) for _, s, i, _ in rows)
        + " |",
    ]
    for label in PHASES.values():
        if any(label in p for *_, p in rows):
            lines.append(f"| {label} | " + " | ".join(_t(p.get(label)) for *_, p in rows) + " |")
    lines += [
        "| **durable (crashsafe, this save)** | "
        + " | ".join(_t(s["crashsafe"]["durable"][i]) for _, s, i, _ in rows)
        + " |",
        "| raw write+fsync of the share (best) | "
        + " | ".join(_t(steady(s["raw"]["durable"])) for _, s, _, _ in rows)
        + " |",
        "| dcp.save (best) | " + " | ".join(_t(steady(s["dcp"]["durable"])) for _, s, _, _ in rows) + " |",
        "| not timed above: crashsafe's delete of the older step (best), what `keep_last=1` adds to "
        "the background commit | "
        + " | ".join(_t(min(s["crashsafe"]["drop"], default=None)) for _, s, _, _ in rows)
        + " |",
    ]
    return lines


def why(results: dict[str, Any]) -> list[str]:
    """For every case whose durable target was mixed or missed: crashsafe's best save split into
    its phases beside the floors (figures from the same saves as the tables)."""
    judged = verdicts(results)["durable"]
    lines = []
    for case, worlds in results.items():
        kind, size = case.split()
        for world, r in worlds.items():
            name = f"{kind.upper()} {state_bytes(int(size)) / MiB:.0f} MiB x{world[1:]}"
            if name not in judged["mixed"] + judged["missed"]:
                continue
            s = r["saves"]
            i = best_index(s["crashsafe"]["durable"])
            ph = {k: max(p.get(v, 0.0) for p in s["crashsafe"]["phases"][i]) for k, v in PHASE_KEYS.items()}
            stall = steady(s["crashsafe"]["stall"])
            dcp, raw = steady(s["dcp"]["durable"]), steady(s["raw"]["durable"])
            sync = _ratio(s, "crashsafe_sync", "durable", "dcp", "durable")
            lines.append(
                f"- {kind.upper()} {state_bytes(int(size)) / MiB:.0f} MiB, {world[1:]} ranks: crashsafe "
                f"{_t(s['crashsafe']['durable'][i])} = its stall {_t(s['crashsafe']['stall'][i])} ("
                + (f"hashing its replica and planning {_t(ph['hash'])}, copying its share {_t(ph['copy'])})"
                   if kind == "ddp" else f"copying its shards {_t(ph['copy'])}; planning after it "
                   f"{_t(ph['hash'])})")
                + f", writing + fsyncing its part {_t(ph['write'])} (raw writes and fsyncs "
                f"the same share in {_t(raw)}), the exchanges up to {_t(ph['gather'])} (they wait for the "
                f"slowest rank), commit {_t(ph['commit'])}; `dcp.save` {_t(dcp)}. Floor "
                f"{(stall + raw) / dcp:.2f}x `dcp.save`; crashsafe sync (no copy) {sync[0]:.2f}x; "
                f"{sync[1]:.2f}x."
            )
    return lines


def memory(results: dict[str, Any]) -> list[str]:
    """The machine's memory during each launch: the most the job took (available before minus the
    lowest available while it ran, page cache counted as available)."""
    lines = ["| launch | ranks | machine memory taken at its peak (GiB) |", "|---|---|---|"]
    for case, worlds in results.items():
        kind, size = case.split()
        for world, r in worlds.items():
            m = r.get("machine_mem")
            if m:
                taken = (m["available_before"] - m["lowest_available"]) / (1 << 30)
                lines.append(f"| {kind.upper()} {size} MiB | {world[1:]} | {taken:.1f} |")
    return lines


def _retries(results: dict[str, Any]) -> list[str]:
    """The launches that failed once and ran again (their figures are the second run's)."""
    lines = [
        f"- {case} on {world[1:]} ranks{' (resharded restores)' if key == 'retried_reshard' else ''}: {why}"
        for case, worlds in results.items()
        for world, r in worlds.items()
        for key in ("retried", "retried_reshard")
        if (why := r.get(key))
    ]
    return ["Launches that failed once and were run again:", "", *lines, ""] if lines else []


def _reading(results: dict[str, Any]) -> list[str]:
    """What the targets' outcome means, from the figures (no verdict is written by hand)."""
    judged = verdicts(results)
    lines = []
    for key, name in (
        ("stall", "Stall <= 0.5x dcp.async_save"),
        ("durable", "Durable commit <= 1.0x dcp.save"),
        ("once", "DDP state written once"),
    ):
        parts = [f"{how} in {', '.join(cases)}" for how, cases in judged[key].items() if cases]
        outcome = "; ".join(parts) + "." if parts else "met everywhere (best and median)."
        lines.append(f"- **{name}**: {outcome}")
    return lines


def _sync_range(results: dict[str, Any]) -> str:
    """crashsafe sync's durable / dcp.save over every case: best / best, and paired medians."""
    runs = [r["saves"] for worlds in results.values() for r in worlds.values()]
    got = [_ratio(s, "crashsafe_sync", "durable", "dcp", "durable") for s in runs]
    best, med = [g[0] for g in got], [g[1] for g in got]
    return (
        f"{min(best):.2f}-{max(best):.2f}x `dcp.save` in the best saves and {min(med):.2f}-{max(med):.2f}x "
        "in the paired medians"
    )


def _why_section(results: dict[str, Any]) -> list[str]:
    cases = why(results)
    if not cases:
        return []
    return [
        "## Why the durable target is missed",
        "",
        *cases,
        "",
        "A DDP rank holds the whole replicated state. crashsafe hashes all of it where it lives, in the "
        "save call, to find the replicas by content (a tensor that ranks hold under one name with "
        "different values is kept for each rank, where DCP keeps one rank's copy without reading it: "
        "`.venv/bin/python -m bench.distributed.replicas`), then copies and writes only its 1/N share; "
        "the hash of what it writes is also its checksum. An FSDP2 rank hashes only what other ranks "
        "hold alike (its RNG state, step counters), not its shards. `dcp.save` neither copies nor reads "
        "what the other ranks write: each rank writes its 1/N straight from the live tensors. The floor "
        "of a save that verifies replicas and copies before it writes, its stall + a plain write of its "
        "share (the floor column), is therefore near `dcp.save` where N ranks hash N replicas on these "
        "2 cores, and the exchanges wait for the slowest rank. A mixed case's best save met the target "
        "and its median did not (the spread is in the tables below). The persist path alone (crashsafe "
        f"sync, no copy, no staging) is {_sync_range(results)}. Going below the floor takes trusting "
        "that same-named tensors are identical, as DCP does, which restores another rank's values when "
        "they are not; crashsafe does not trade that for speed (docs/distributed.md names the price).",
        "",
    ]


def report(
    results: dict[str, Any], command: str, machine: str, elapsed: float, repeats: list[int], load: str
) -> str:
    saves, restores = repeats
    lines = [
        "# Distributed checkpoints: crashsafe vs torch.distributed.checkpoint (DDP and FSDP2)",
        "",
        f"Produced by `{command}` on {{when}}, {machine}, ext4 on a virtual "
        f"disk; the whole run took {elapsed / 60:.1f} min; load average {load}. Other sessions' jobs "
        "(tests, benchmarks) shared the machine during the run.",
        "",
        "**2 cores only**: 4 ranks (4 processes, each with its background persist thread) oversubscribe "
        "them, so the 4-rank figures are contended and noisy; ratios are taken within one run, between "
        "methods measured in the same processes, round after round (each round starts with the next "
        "method, so no method always follows the same one).",
        "",
        f"State = an MLP of {WIDTH}x{WIDTH} layers, its fp32 parameters + AdamW's two moments, in total "
        "(over all ranks): DDP holds it whole on every rank, FSDP2 (`fully_shard` per layer) shards it. "
        "One launch per (state, ranks), one process per rank, gloo; the rendezvous store, gloo and "
        "crashsafe's coordination group listen on 127.0.0.1 only. Every rank builds the model, then each "
        f"method saves it {saves} times (the weights change between saves). Figures are the best save "
        "after the first, with the median and the min-max of those saves; the first save (it allocates "
        "staging buffers and thread pools) is shown separately. Each target's ratio is given twice: "
        "best / best, then the median over rounds of the round's own ratio (both methods saved in the "
        "same round, seconds apart, so the load of other jobs, which changes from round to round, "
        "mostly cancels). A target is met when both meet it, mixed when one does, missed when neither. "
        f"Every checkpoint is restored {restores} times (round after round); the best is shown.",
        "",
        "- **crashsafe async**: `CheckpointManager(dir, keep_last=None)` (collective: torch.distributed "
        "is up), `save(step, {'model': model, 'optim': optim, 'step': i})`, then `wait()`.",
        "- **crashsafe sync**: the same with `async_save=False`: no copy, `save` writes from the live "
        "tensors and returns committed, as `dcp.save` does; it separates crashsafe's persist path "
        "from the cost of its snapshot.",
        "- **dcp.async_save**: `async_save(get_state_dict(model, optim), checkpoint_id=...)` as "
        "documented: its default stager copies the state into freshly allocated memory on every call.",
        "- **dcp.async_save, cached staging**: the same with one `DefaultStager` kept across saves "
        "(`async_stager=`), which reuses its staged copies, as crashsafe reuses its staging buffers. "
        "(`FileSystemWriter(cache_staged_state_dict=True)` would do the same but pins its memory, which "
        "needs CUDA.) Shown for a like-for-like stall; the target is against the default.",
        "- **dcp.save**: `save(get_state_dict(model, optim), checkpoint_id=...)`, synchronous.",
        "- **raw**: the ceiling of a persist: each rank writes its share of the bytes (its shards, or "
        "1/N of the replicated DDP state) to one file with `os.write` and fsyncs it; a barrier; rank 0 "
        "fsyncs the directory and its parent. No checksum, no manifest, no copy.",
        "",
        "- **stall**: time the training loop is blocked in the save call, slowest rank (all ranks start "
        "together after a barrier). For DCP it includes `get_state_dict(model, optim)`, which DCP needs "
        "for each save; crashsafe takes `{'model': model, 'optim': optim}` as they are.",
        "- **durable**: from the save call until the step is committed and on disk, slowest rank: "
        "crashsafe `save` + `wait()` (returns on every rank once rank 0 renamed the step into place and "
        "fsynced it, and its outcome reached every rank); `dcp.async_save(...).result()`; `dcp.save`. "
        "DCP's `FileSystemWriter` has `sync_files=True` by default: it fsyncs every data file and "
        "`.metadata.tmp` before renaming it to `.metadata`, but fsyncs no directory, so neither the "
        "rename nor the new files' entries are durable when it returns; the bench adds rank 0's fsync "
        "of the step directory and its parent, and a barrier, inside DCP's timing (a few ms).",
        "- **retention**: untimed for every method: the older step is deleted between saves (DCP's and "
        "raw by `rmtree`, crashsafe's by `mgr.delete`, whose time is shown below: what `keep_last=1` "
        "would add inside crashsafe's background commit, where rank 0 runs retention before telling "
        "the other ranks the outcome).",
        "- **written per rank**: bytes of the newest checkpoint on disk by the rank that wrote them "
        "(crashsafe's manifest and DCP's `.metadata` count for rank 0).",
        "- **peak extra memory**: per rank, the peak of anonymous memory (RssAnon, sampled every 2 ms; "
        "freed heap memory trimmed first) above its level before the method's first save; for crashsafe "
        "and the cached DCP stager it is their staging copy, kept for the next save. Mapped checkpoint "
        "pages (page cache) are not counted; the kernel's RSS high-water mark, which counts them, is "
        "in distributed.json (`mem_rss`).",
        "- **restore**: into a fresh model and optimizer (as a restarted job), slowest rank: crashsafe "
        "`CheckpointManager(dir, read_only=True)` + `restore`; DCP `get_state_dict` + `dcp.load` + "
        "`set_state_dict` of what `dcp.save` wrote. **Resharded**: the other world size's checkpoint "
        "(4 ranks' into 2, 2 ranks' into 4). Every restore is checked: the sum of all restored values "
        "equals the saved one. The page cache is warm for a same-world restore (the checkpoint was "
        "just written); a resharded one reads what the previous launch wrote, which later writes may "
        "have pushed partly out of the page cache, alike for both methods. The fresh optimizer has no "
        "moments yet, so every restore allocates them (2/3 of the state).",
        "",
        *_retries(results),
        "## Targets",
        "",
        *_reading(results),
        "",
        *targets(results),
        "",
        "The last columns are ceilings. crashsafe's stall is its snapshot: a DDP rank hashes its "
        "replica where it lives (to find replicas by content) and copies the 1/N it writes into kept "
        "buffers; an FSDP2 rank copies its shards (its plan is made after the stall); DCP's cached "
        "stager copies the whole state (plus `get_state_dict`). A save that verifies replicas and copies "
        "before it writes cannot be durable sooner than its snapshot + a plain write of its share: "
        "`(crashsafe's stall + raw) / dcp.save` is that floor, while `dcp.save` writes straight from "
        "the live tensors and neither copies nor reads what other ranks write. crashsafe sync does not "
        "copy: its ratio is the persist path alone (with the hash).",
        "",
        "## Where crashsafe's durable time goes",
        "",
        "Each phase of crashsafe's best steady save, timed inside the library (bench/distributed/phases.py "
        "wraps its functions), the slowest rank's figure per phase; the stall's phases run on the "
        "training thread, the others one after the other in each rank's background thread.",
        "",
        *breakdown(results),
        "",
        *_why_section(results),
        "## Memory of the machine",
        "",
        "The most memory each launch took (MemAvailable before it minus its lowest while it ran; the "
        "machine has 24 GiB, shared with other jobs).",
        "",
        *memory(results),
        "",
        "## Every figure",
        "",
    ]
    for case, worlds in results.items():
        lines += case_table(case, worlds)
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, rows = [], []
    for case, worlds in results.items():
        kind, size = case.split()
        for world, r in worlds.items():
            labels.append(f"{kind.upper()}\n{state_bytes(int(size)) / MiB:.0f} MiB\n{world[1:]} ranks")
            rows.append(r["saves"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(NAMES)
    for ax, key, title in (
        (axes[0], "stall", "training stall per save (s, log)"),
        (axes[1], "durable", "until durably committed (s, log)"),
    ):
        for i, (method, name) in enumerate(NAMES.items()):
            xs = [j + i * width for j in range(len(rows))]
            ax.bar(xs, [steady(r[method][key]) for r in rows], width, label=name)
        ax.set_xticks([j + width * (len(NAMES) - 1) / 2 for j in range(len(rows))], labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
