"""The restore benchmark's results as markdown."""

from __future__ import annotations

import os
import platform
import time

import torch

from bench.restore.methods import TENSORS, MiB

LIMIT = "limit: preadv into live (1 thread)"
LIMIT2 = "limit: preadv into live (2 threads)"
MINE = "crashsafe restore"
ZSTD = "crashsafe restore, zstd"
ZSTD_CEILING = "zstd decompression only (ceiling)"
RIVALS = ("torch.load + copy", "dcp.load (in place)")


def load_average() -> float:
    return os.getloadavg()[0]


def ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 0.1 else f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def size_name(size: int) -> str:
    return f"{size // (1024 * MiB)} GiB" if size >= 1024 * MiB else f"{size // MiB} MiB"


def markdown(
    results: dict[int, dict[str, dict[str, float]]],
    command: str,
    elapsed: float,
    repeat: int,
    loads: list[float],
) -> str:
    lines = [
        "# Restore: from files to the live model, against the limit",
        "",
        f"Produced by `{command}` on {time.strftime('%Y-%m-%d')}: {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), 24 GiB, Linux {platform.release()}, ext4 on a "
        f"virtual disk, Python {platform.python_version()}, torch {torch.__version__}; "
        f"{elapsed / 60:.1f} min in all. The state is a model of {TENSORS} fp32 parameters of normal "
        "values, restored into a live model whose parameters already exist (as after "
        "`model = Model()`). Warm: the files are in the page cache. Cold: each method's files are "
        "evicted first (`posix_fadvise(DONTNEED)`), so they come from the disk. "
        f"Best of {repeat} repeats warm (cold: {max(1, repeat - 2)}), methods interleaved in a rotated "
        "order; ratios are taken within the run, because this 2-core machine is shared and noisy "
        f"(load average {' -> '.join(f'{x:.0f}' for x in loads)} during the run).",
        "",
        "The limit reads crashsafe's own stored bytes with `preadv` straight into the live parameters, "
        "at the offsets its manifest gives: no checksum, no decoding, no Python per byte.",
        "",
    ]
    for size, rows in results.items():
        temps = list(rows)
        lines += [f"## {size_name(size)}", ""]
        header = "| method |" + "".join(f" {t} | {t} / limit |" for t in temps)
        lines += [header, "|---|" + "---|---|" * len(temps)]
        for name in rows["warm"]:
            cells = "".join(f" {ms(rows[t][name])} | {rows[t][name] / rows[t][LIMIT]:.2f}x |" for t in temps)
            lines.append(f"| {name} |{cells}")
        lines.append("")
        for temp in temps:
            row = rows[temp]
            mine = row[MINE]
            ratio = mine / row[LIMIT]
            lines.append(
                f"- {temp}: restore = **{ratio:.2f}x the limit** (target <= 1.3x: {verdict(ratio <= 1.3)}; "
                f"{mine / min(row[LIMIT], row[LIMIT2]):.2f}x the faster of the 1- and 2-thread limits); "
                + "; ".join(
                    f"{rival} takes **{row[rival] / mine:.1f}x** as long (target >= 3x: "
                    f"{verdict(row[rival] / mine >= 3)})"
                    for rival in RIVALS
                )
                + f"; zstd restore = **{row[ZSTD] / row[ZSTD_CEILING]:.2f}x** decompression alone"
            )
        lines.append("")
    return "\n".join(lines) + "\n"
