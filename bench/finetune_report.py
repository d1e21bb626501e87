"""The report of ``python -m bench finetune``: the table, the targets of issue 29, the plot."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

ADAPTER_CS = "crashsafe, adapter alone (ideal)"
DEFAULT_CS = "crashsafe default (whole state)"
FULL_CS = "crashsafe unchanged=False (today's full save)"
DCP = "dcp.async_save (whole state)"
WIDTH, RANK, BATCH = 2048, 8, 16  # the layers, the adapters' rank, the batch (bench/finetune.py)


def ms(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.{1 if seconds < 0.1 else 0}f} ms"


def _spread(values: list[float]) -> str:
    return f"{ms(statistics.median(values))} ({ms(min(values))}–{ms(max(values))})"


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def table(result: dict[str, Any]) -> list[str]:
    lines = [
        "| saver | first save: stall / durable | stall, steady | durable, steady | bytes per step: first "
        "/ steady | restore (whole state) | read limit | restore / read limit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["rows"].items():
        if name in result["skipped"]:
            lines.append(f"| {name} | {result['skipped'][name]} | | | | | | |")
            continue
        first = f"{ms(statistics.median(row['first stall']))} / {ms(statistics.median(row['first durable']))}"
        restore = (
            [
                ms(row["restore"]),
                f"{ms(row['read limit'])} ({_mb(row['read bytes'])})",
                _ratio(row["restore"], row["read limit"]),
            ]
            if "restore" in row
            else ["-", "-", "-"]
        )
        lines.append(
            f"| {name} | {first} | {_spread(row['stall'])} | {_spread(row['durable'])} "
            f"| {_mb(row['first owned'])} / {_mb(row['owned'])} | " + " | ".join(restore) + " |"
        )
    return lines


def targets(result: dict[str, Any], size: str, gpu: bool) -> list[str]:
    """The ratios issue 29 targets, from this run's rows."""
    rows = result["rows"]
    ours, ideal, dcp = rows[DEFAULT_CS], rows[ADAPTER_CS], rows[DCP]

    def med(row: dict[str, Any], key: str) -> float:
        return float(statistics.median(row[key]))

    stall, durable = (
        _ratio(med(ours, "stall"), med(ideal, "stall")),
        _ratio(med(ours, "durable"), med(ideal, "durable")),
    )
    return [
        f"- crashsafe default vs the adapter-alone crashsafe save: stall **{stall}**, durable **{durable}** "
        "(target <= 1.5x each; medians of the steady saves)",
        f"- dcp.async_save of the whole state stalls **{_ratio(med(dcp, 'stall'), med(ours, 'stall'))}** "
        f"as long as crashsafe default, and takes **{_ratio(med(dcp, 'durable'), med(ours, 'durable'))}** "
        f"as long to be durable (target >= 20x each at the 2 GB base; this is the {size} size)",
        f"- bytes each steady step of crashsafe default owns: {_mb(ours['owned'])} = "
        f"**{_ratio(ours['owned'], result['trainable'])} the trainable part's raw size** "
        f"({_mb(result['trainable'])}: adapters + AdamW moments + step; target <= 1.1x); its first step "
        "owns the base as well",
        f"- crashsafe default's restore of the whole state: **{_ratio(ours['restore'], ours['read limit'])} "
        "the read limit** (target <= 1.3x)",
        f"- the floor of a sound rule: reading the frozen base once ({_hash_name(gpu)}) takes "
        f"{ms(result['read base'])}; with the adapter-alone save's stall that is "
        f"**{_ratio(result['read base'] + med(ideal, 'stall'), med(ideal, 'stall'))}** its stall "
        "(docs/unchanged.md: no rule sound against writes torch does not count reads less)",
    ]


def _hash_name(gpu: bool) -> str:
    if gpu:
        return "the device fingerprint"
    from crashsafe.state.unchanged import HASHING_THREADS

    return f"xxh3 on {HASHING_THREADS} threads"


def _device_name(gpu: bool) -> str:
    return torch.cuda.get_device_name() if gpu else "the CPU"


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace, took: float,
           load: tuple[float, float], feature: bool) -> str:  # fmt: skip
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.device(args.device).type == "cuda"
    when = (
        "**with** the feature (`CheckpointManager(unchanged=...)` exists)"
        if feature
        else "**before the feature**: this crashsafe has no `unchanged=` option, so every save copies and "
        "writes the frozen base (today's full save); to be re-run once it lands"
    )
    lines = [
        "# Fine-tuning: what a save costs when the base is frozen (issue 29)",
        "",
        f"Command: `{args.command}`. Machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{memory:.0f} GiB memory, torch {torch.__version__}, model on {_device_name(gpu)}; checkpoints in "
        f"`{args.work}`; the run took "
        f"{took:.0f} s; 1-minute load average {load[0]:.2f} at the start, {load[1]:.2f} at the end (a "
        f"shared machine: the savers were interleaved, repeat by repeat). Run {when}.",
        "",
        f"Model: N frozen `Linear({WIDTH}, {WIDTH})` layers (fp32) with rank-{RANK} LoRA adapters (A "
        f"{RANK}x{WIDTH}, B {WIDTH}x{RANK}, trainable) and AdamW over the adapters only. Each saver runs "
        f"{args.saves} saves, {args.steps} real training step(s) before each (forward, backward, AdamW; "
        f"batch {BATCH}); {args.repeat} repeat(s). *Stall*: the save call (what the training loop waits "
        "for). *Durable*: from the call until the step is committed (crashsafe `wait()`, DCP's future; "
        "torch.save: written and fsynced), nothing else running. First save (crashsafe allocates its "
        "staging then) apart; steady: median (min–max) of the other saves of every repeat. *Bytes per "
        "step*: what the step owns on disk (crashsafe: its manifest's data files, bytes it refers to in "
        "an earlier step not counted; others: their files). *Restore*: the newest step into a fresh "
        "model + optimizer (crashsafe `restore`, `torch.load(mmap=True)` + `load_state_dict`, `dcp.load` "
        f"+ `set_state_dict`), checked equal to the saved state, page cache warm, best of {args.best}. "
        "*Read limit*: plain reads of the files that restore needs (crashsafe: what `keep_last=1` "
        "retention keeps, the newest step and any step it depends on) into memory, best of "
        f"{args.best}; a copy out of the mapped page cache (`torch.load(mmap=True)`) may beat it. The "
        "adapter-alone rows save adapters + AdamW state + step only: the ideal, not a restorable whole "
        "state.",
        "",
    ]
    for size, result in results.items():
        lines += [
            f"## {_mb(result['base'])} frozen base ({result['layers']} layers of {result['width']}; size "
            f"{size}); trainable part {_mb(result['trainable'])}",
            "",
        ]
        lines += [*table(result), "", *targets(result, size, gpu), ""]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in results[next(iter(results))]["rows"] if all(results[s]["rows"][n] for s in results)]
    panels = {
        "stall": "stall per save (s)",
        "durable": "durable per save (s)",
        "owned": "bytes per step (MB)",
    }
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.8))
    width = 0.8 / len(results)
    for j, result in enumerate(results.values()):
        for ax, key in zip(axes, panels, strict=True):
            rows = [result["rows"][n] for n in names]
            values = [r["owned"] / 1e6 if key == "owned" else statistics.median(r[key]) for r in rows]
            ax.barh(
                [i + j * width for i in range(len(names))], values, width, label=f"{_mb(result['base'])} base"
            )
    for ax, label in zip(axes, panels.values(), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(label + ", log")
        ax.set_yticks([i + 0.4 - width / 2 for i in range(len(names))], names if ax is axes[0] else [])
        ax.invert_yaxis()
    axes[0].tick_params(axis="y", labelsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle("A LoRA fine-tune's checkpoint: steady saves (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
