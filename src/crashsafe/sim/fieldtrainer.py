"""The trainer that the field test kills: the digits CNN under a named save policy.

``python -m crashsafe.sim.fieldtrainer --dir D --log events.jsonl --policy young --mtbf 6 --steps N``
resumes from the newest checkpoint (the policy's clock, cost and fit travel in the state) and logs
JSON lines: ``start``, ``step`` (with loss), ``committed`` (stall, persist), ``done``. A random
``--ballast-mb`` array in the state gives checkpoints a real, measurable cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Train, checkpointing when the policy says so; see the module docstring."""
    began = time.time()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--log", required=True, type=Path)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--mtbf", type=float, required=True, help="seconds")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ballast-mb", type=float, default=32.0)
    args = parser.parse_args(argv)

    import torch

    import crashsafe as cs
    from crashsafe.policies import policy_from_name
    from crashsafe.workloads.digits import DigitsTrainer

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    log = open(args.log, "a", buffering=1)  # noqa: SIM115 - line-buffered for the supervisor

    def emit(**event: Any) -> None:
        log.write(json.dumps({"pid": os.getpid(), "t": time.time(), **event}) + "\n")

    trainer = DigitsTrainer(seed=args.seed)
    policy = policy_from_name(args.policy, mtbf=args.mtbf)
    ballast = np.random.default_rng(args.seed).random(int(args.ballast_mb * 2**20) // 8)
    state = {**trainer.state, "policy": policy, "ballast": ballast}
    trainer.state = state  # the trainer advances state["step"]
    with cs.CheckpointManager(args.dir, keep_last=2, policy=policy) as mgr:
        restored = mgr.restore(state)
        emit(event="start", resumed_from=restored or 0, spawned=began)
        reported = 0
        while trainer.step < args.steps:
            loss = trainer.train_step()
            emit(event="step", step=trainer.step, loss=loss)
            mgr.maybe_save(trainer.step, state, metrics={"loss": loss})
            for s in mgr.stats[reported:]:
                emit(event="committed", step=s.step, stall=s.stall, persist=s.persist)
            reported = len(mgr.stats)
        mgr.wait()
        for s in mgr.stats[reported:]:
            emit(event="committed", step=s.step, stall=s.stall, persist=s.persist)
        emit(event="done", step=trainer.step)
    log.close()


if __name__ == "__main__":
    main(sys.argv[1:])
