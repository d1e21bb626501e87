"""What crashsafe's per-tensor checks cost a Hugging Face save's stall: the tiny GPT-2 of
``bench/integrations.py`` trained with ``CrashsafeTrainer`` as it is, with its later-save copy
stripped of every check of a tensor (its dtype, layout and place in memory: how views and tied
weights are found), and with the floor (a clone of every tensor, then ``torch.save`` + fsync on a
thread). The stripped copy is unsound, a measurement only: it tells how much of the gap between
crashsafe and the floor those checks are.

    python -m bench hf_checks [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from bench import integrations

RESULTS = Path(__file__).parent / "results"


def _unchecked_walk(checked: Any) -> Any:
    class Unchecked(checked):  # type: ignore[misc, valid-type]
        def tensor(self, tensor: Any, path: str) -> Any:
            """The staged buffer of ``path`` from an earlier save, with no check of ``tensor``."""
            slot = self.pool._slots.get(path)
            if slot is None or slot.tensor is None:
                return checked.tensor(self, tensor, path)
            self.copies.append((slot.tensor, tensor))
            self.paths.add(path)
            return slot.tensor

    return Unchecked


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench hf_checks")
    parser.add_argument("--repeat", type=int, default=4)
    args = parser.parse_args(argv)
    from transformers.utils import logging

    import crashsafe.state.snapshot as snapshot

    logging.set_verbosity_error()
    torch.set_num_threads(1)
    checked = snapshot._Walk
    kinds = {  # name -> (the run's kind in bench/integrations.py, the copy's walk)
        "HF save_steps": ("HF save_steps", checked),
        "crashsafe": ("crashsafe", checked),
        "crashsafe, its copy without per-tensor checks (unsound)": ("crashsafe", _unchecked_walk(checked)),
        integrations.FLOOR: (integrations.FLOOR, checked),
    }
    stalls: dict[str, list[float]] = {name: [] for name in kinds}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(args.repeat):
            for name, (kind, walk) in kinds.items():
                snapshot._Walk = walk
                try:
                    timings, _ = integrations.hf_run(kind, 60, 4, Path(work) / "run")
                finally:
                    snapshot._Walk = checked
                stalls[name].append(statistics.median(s for s, _, _ in timings))
    best = {name: min(found) for name, found in stalls.items()}
    default, floor = best["HF save_steps"], best[integrations.FLOOR]
    lines = [
        "# What crashsafe's per-tensor checks cost an HF save",
        "",
        f"Produced by `python -m bench hf_checks --repeat {args.repeat}` on "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC. The tiny GPT-2 Trainer run of bench/integrations.md "
        "(60 steps, a save every 4); the stall is the median of a run's saves, best of the runs, the "
        "kinds interleaved. See `bench/hf_checks.py`.",
        "",
        "| checkpointing | stall (best median) | / HF save_steps | / floor | runs |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {best[name] * 1e3:.2f} ms | {best[name] / default:.2f}x | {best[name] / floor:.2f}x "
            f"| {' '.join(f'{s * 1e3:.2f}' for s in stalls[name])} |"
            for name in kinds
        ),
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hf-checks.md").write_text("\n".join(lines))
    print("\n".join(lines))
