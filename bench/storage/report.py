"""The storage benchmark's results as markdown and a picture."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from bench.storage.commit import SAVEZ, SAVEZ_PLAIN, TORCH
from bench.storage.common import MiB, Row
from bench.storage.objectstore import DCP_THREADS, VERIFIED
from bench.storage.tiers import LOCAL, MIRROR, TRAFFIC


def ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 0.01 else f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def header(command: str, elapsed: float, repeat: int) -> list[str]:
    return [
        "# Storage: object stores, two tiers, and the fixed cost of a durable commit",
        "",
        f"Produced by `{command}` on {time.strftime('%Y-%m-%d')}: {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), 24 GiB, Linux {platform.release()}, ext4 "
        f"(mounted with `discard`) on a virtual disk, Python {platform.python_version()}, torch "
        f"{torch.__version__}; {elapsed / 60:.1f} min in all. Up to {repeat} repeats, methods interleaved "
        "(rotated order each repeat), best repeat; the ratios are taken within one run, because this 2-core "
        "machine is shared and noisy (other jobs ran during this one).",
        "",
    ]


def objectstore(nbytes: int, rows: dict[str, Row]) -> list[str]:
    mib = nbytes / MiB
    mine = rows["crashsafe"]
    raw = {k: v for k, v in rows.items() if k.startswith("s3fs") and k != VERIFIED}
    best_up = min(raw, key=lambda k: raw[k]["save"])
    best_down = min(raw, key=lambda k: raw[k]["restore"])
    dcp = next(v for k, v in rows.items() if k.startswith("DCP"))
    up, down = raw[best_up]["save"] / mine["save"], raw[best_down]["restore"] / mine["restore"]
    vs_dcp = min(dcp["save"] / mine["save"], dcp["restore"] / mine["restore"])
    lines = [
        f"## 1. Object store: {mib:.0f} MiB to S3 (moto on 127.0.0.1)",
        "",
        "moto's ThreadedMotoServer runs in a child process; every client uses s3fs with the same "
        "storage_options. **crashsafe** = `CheckpointManager('s3://bench/...', storage_options=..., "
        "async_save=False)`: save = until `save` returns with the step committed (packing, checksums, "
        "parallel uploads, manifest last); restore = `restore` of a new `CheckpointManager(url, "
        "read_only=True)` (list, manifest, every payload fetched and checksum-verified, loaded into a fresh "
        f"model and optimizer); opening that manager and its new S3 client took {ms(mine['open'])} more, "
        "outside the timing, as the raw client's creation is. **s3fs** = `fs.pipe` / `fs.cat` of the same "
        "bytes, already in memory, cut into objects of the given size (the ceiling on this server: no "
        "checksums, no loading). **DCP** = "
        f"`dcp.save(..., storage_writer=FsspecWriter(url, thread_count={DCP_THREADS}, **storage_options))`, "
        "`dcp.load(..., storage_reader=FsspecReader(url, ...))` + `set_state_dict`, one process.",
        "",
        "| method | save | save MiB/s | restore | restore MiB/s |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        save = f"{ms(row['save'])} | {mib / row['save']:.0f}" if "save" in row else "- | -"
        lines.append(f"| {name} | {save} | {ms(row['restore'])} | {mib / row['restore']:.0f} |")
    return [
        *lines,
        "",
        f"- upload: crashsafe = **{up:.2f}x the raw s3fs ceiling** ({best_up}) — target >= 0.9x: "
        f"{verdict(up >= 0.9)}",
        f"- download: crashsafe = **{down:.2f}x the raw s3fs ceiling** ({best_down}) — target >= 0.9x: "
        f"{verdict(down >= 0.9)}",
        f"- download against the ceiling of a verified restore (the raw transfer + an xxh3 of each object + "
        f"a copy into warm memory, the least any restore into a model does): crashsafe = "
        f"**{rows[VERIFIED]['restore'] / mine['restore']:.2f}x** of it",
        "- the transfer is CPU-bound here: moto and s3fs's HTTP handling share the 2 cores with the client, "
        "so every pass over the bytes that the raw `fs.cat` skips (a checksum, a copy into the model) "
        "costs download throughput",
        f"- vs DCP's fsspec path: save **{dcp['save'] / mine['save']:.2f}x faster**, restore "
        f"**{dcp['restore'] / mine['restore']:.2f}x faster** — target >= 1.5x: {verdict(vs_dcp >= 1.5)}",
        "",
    ]


def tiers(rows: dict[str, dict[str, Row]], nbytes: int) -> list[str]:
    lines = [
        "## 2. Two tiers: the training stall with a mirror",
        "",
        f"A training loop of the MLP + Adam of part 1 ({nbytes / MiB:.0f} MiB of state, batch 32) saving "
        "asynchronously (the default) every 3 steps, `keep_last=2`; with `mirror='s3://...'` "
        "(`mirror_keep_last=2`) each committed step is then copied to the mirror in the background and "
        "verified there. **stall** = how long `save` blocks the loop (median of the saves after the first, "
        "which allocates staging), split into **wait** (for the previous save's local commit: `mgr.wait()` "
        "just before `save`) and **copy** (the rest: the copy into staging and bookkeeping); **compute** = "
        "the training steps between two saves; **lag** = how long the mirror still needed after the loop.",
        "",
        "| server | setup | stall | wait | copy | worst stall | compute between saves | local drain "
        "| mirror lag |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for server, setups in rows.items():
        for name, row in setups.items():
            lag = ms(row["lag"]) if name == MIRROR else "-"
            lines.append(
                f"| {server} | {name} | {ms(row['stall'])} | {ms(row['wait'])} | {ms(row['copy'])} "
                f"| {ms(row['stall_max'])} | {ms(row['compute'])} | {ms(row['drain'])} | {lag} |"
            )
    lines.append("")
    for server, setups in rows.items():
        local, mirror, traffic = setups[LOCAL], setups[MIRROR], setups[TRAFFIC]
        ratio = mirror["stall"] / local["stall"]
        noise = max(local["stall_spread"], mirror["stall_spread"])
        lines.append(
            f"- {server}: two-tier stall = **{ratio:.2f}x the local-only stall** (the spread of the stall "
            f"over repeats: {noise:.2f}x) — target equal within noise: {verdict(ratio <= noise)}; the "
            f"training steps between saves took {mirror['compute'] / local['compute']:.2f}x as long with "
            "the mirror; with the same S3 traffic run by another process instead (no mirror in this "
            f"process, so no GIL shared with it) the stall was {traffic['stall'] / local['stall']:.2f}x"
        )
    return [*lines, ""]


def commit(
    rows: list[dict[str, Any]],
    found: dict[tuple[str, str], dict[str, int]] | None,
    floor: dict[str, Row],
    split: tuple[float, Row] | None,
) -> list[str]:
    lines = [
        "## 3. The fixed cost of a durable local commit",
        "",
        "Time until the checkpoint is durable and committed: crashsafe's sync save (`async_save=False`, "
        "`keep_last=None`; the previous step deleted outside the timing) vs `torch.save` to a temporary "
        "file + fsync + rename + fsync of the directory (the previous file deleted outside the timing); for "
        "the KMeans state also `np.savez` the same way, and `np.savez` alone (no fsync, no rename: not "
        "crash-safe, for reference). Saves alternate between the methods; the median of each repeat, the "
        "best repeat. Single-array states are one float32 tensor.",
        "",
        f"| state | arrays | bytes | saves | crashsafe | {TORCH}+fsync+rename+dir fsync | ratio | <= 1.0x |",
        "|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for row in rows:
        ratio = row["crashsafe"] / row[TORCH]
        worst = max(worst, ratio)
        lines.append(
            f"| {row['label']} | {row['arrays']} | {row['bytes']:,} | {row['saves']} "
            f"| {ms(row['crashsafe'])} | {ms(row[TORCH])} | {ratio:.2f}x "
            f"| {'yes' if ratio <= 1.0 else 'no'} |"
        )
    lines += ["", f"- worst ratio {worst:.2f}x — target <= 1.0x at every size: {verdict(worst <= 1.0)}"]
    for row in rows:
        if SAVEZ in row:
            lines.append(
                f"- KMeans: crashsafe {ms(row['crashsafe'])} vs {SAVEZ}+fsync+rename+dir fsync "
                f"{ms(row[SAVEZ])} (**{row['crashsafe'] / row[SAVEZ]:.2f}x**); {SAVEZ_PLAIN} "
                f"{ms(row[SAVEZ_PLAIN])}: the rest is the price of durability on this disk"
            )
    lines.append("")
    if found:
        lines += [
            "What one save does to the file system (strace -f of one save each, after a warm-up save):",
            "",
            "| state | method | fsync | rename | mkdir | files created | sync_file_range |",
            "|---|---|---|---|---|---|---|",
        ]
        for (label, name), c in found.items():
            lines.append(
                f"| {label} | {name} | {c['fsync']} | {c['rename']} | {c['mkdir']} | {c['created files']} "
                f"| {c['sync_file_range']} |"
            )
        lines.append("")
    lines += [
        "The floor: each commit protocol with bare syscalls on this disk, 1 KiB of data (median of an "
        "interleaved loop, no library code), alone and while another process commits 256 KiB files in a "
        "loop (fsync each) on the same file system, the two alternating in 4 rounds. An fsync that needs "
        "a journal commit of its own waits for the one in flight; three issued at once can share one.",
        "",
        "| protocol | alone | another process committing files |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {ms(v)} | {ms(floor['busy'][name])} |" for name, v in floor["alone"].items()]
    lines.append("")
    base, serial, mine = list(floor["alone"])
    quiet, busy = floor["alone"], floor["busy"]
    lines += [
        "Reading the results:",
        "",
        f"- the floor of crashsafe's protocol (2 files and a directory, 4 fsyncs, the first 3 at once) is "
        f"{quiet[mine] / quiet[base]:.2f}x the baseline's (1 file, 2 fsyncs) alone and "
        f"{busy[mine] / busy[base]:.2f}x with another process committing files; with the 3 fsyncs one "
        f"after the other it is {quiet[serial] / quiet[base]:.2f}x and {busy[serial] / busy[base]:.2f}x. "
        "Issued at once, the three can share one journal commit: where each fsync waits for a commit of "
        "its own (a busy journal: milliseconds per fsync, as in many rows of the commit table), that brings "
        "4 fsyncs to the cost of the baseline's 2; where fsyncs cost a fraction of a millisecond, "
        "crashsafe's extra file, directory and fsyncs and its fixed Python work (about a millisecond per "
        "save) show. How much an fsync costs swings with what else the machine writes at that moment, so "
        "a small state's ratio does too",
    ]
    if split is not None:
        total, parts = split
        commit_part = list(parts.values())[-1]
        lines.append(
            f"- the tiny GPT-2 save is {ms(total - commit_part)} of Python work "
            f"({1 - commit_part / total:.0%}; table below) and a commit of "
            f"{ms(commit_part)}: flattening 160 arrays, the manifest as JSON and its validation as a reader "
            "would (rule 10: a step that would not load back is never committed), per-array bookkeeping, "
            "against torch.save pickling the same dicts"
        )
    lines.append("")
    if split is not None:
        total, parts = split
        lines += [
            f"Where a sync save of the tiny GPT-2 + AdamW (160 arrays) spends its {ms(total)} (mean of 30 "
            "saves; each phase timed by wrapping its function):",
            "",
            "| phase | time | share |",
            "|---|---|---|",
        ]
        lines += [f"| {name} | {ms(t)} | {t / total:.0%} |" for name, t in parts.items()]
        rest = total - sum(parts.values())
        lines += [
            f"| the rest (listing steps, staging views, codecs, retention) | {ms(rest)} "
            f"| {rest / total:.0%} |",
            "",
        ]
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r["bytes"])
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [r["bytes"] for r in rows]
    ax.loglog(x, [r["crashsafe"] for r in rows], "o-", label="crashsafe sync save")
    ax.loglog(x, [r[TORCH] for r in rows], "s--", label="torch.save + fsync + rename + dir fsync")
    for r in rows:
        if not r["label"][0].isdigit():
            ax.annotate(r["label"], (r["bytes"], r["crashsafe"]), fontsize=7)
    ax.set_xlabel("state size (bytes)")
    ax.set_ylabel("time to durable commit (s)")
    ax.set_title("Durable local commit")
    ax.legend(fontsize=8)
    ax2.bar([r["label"] for r in rows], [r["crashsafe"] / r[TORCH] for r in rows])
    ax2.axhline(1.0, color="k", lw=1, ls="--")
    ax2.set_ylabel("crashsafe / torch.save baseline")
    ax2.set_title("Ratio (target <= 1.0)")
    ax2.tick_params(axis="x", rotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
