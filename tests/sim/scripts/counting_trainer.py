"""A trainer without torch for the supervisor's tests: ``state["w"]`` counts its steps.

``counting_trainer.py DIR LOG STEPS [SLEEP]`` trains through crashsafe.workloads.supervised's loop with a
real CheckpointManager (a save every 5 steps), sleeping SLEEP seconds a step; ``fail`` as STEPS exits 3.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from crashsafe.manager import CheckpointManager
from crashsafe.workloads.supervised import train_logged


class Counter:
    def __init__(self, pause: float) -> None:
        self.pause = pause
        self.state: dict[str, Any] = {"w": np.zeros(4), "step": 0}

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def train_step(self) -> float:
        time.sleep(self.pause)
        self.state["w"] = self.state["w"] + 1.0
        self.state["step"] = self.step + 1
        return 1.0 / self.step


def main() -> None:
    spawned = time.time()
    directory, log, steps = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if steps == "fail":
        print("this trainer cannot train", file=sys.stderr)
        sys.exit(3)
    trainer = Counter(float(sys.argv[4]) if len(sys.argv) > 4 else 0.005)
    with CheckpointManager(directory, keep_last=2, async_save=False) as mgr:
        train_logged(trainer, mgr, log, int(steps), spawned=spawned, save_every=5,
                     done=lambda: {"w": float(trainer.state["w"][0])})


if __name__ == "__main__":
    main()
