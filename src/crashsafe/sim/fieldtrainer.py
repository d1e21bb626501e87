"""The trainer that the field test kills: the digits CNN under a named save policy.

``python -m crashsafe.sim.fieldtrainer --dir D --log events.jsonl --policy young --mtbf 6 --steps N``
resumes from the newest checkpoint (the policy's clock, cost and fit travel in the state), offers a
save every step for the policy to decide, and logs the events of :mod:`crashsafe.workloads.eventlog`.
A random ``--ballast-mb`` array in the state gives checkpoints a real, measurable cost.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Train, checkpointing when the policy says so; see the module docstring."""
    spawned = time.time()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--log", required=True, type=Path)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--mtbf", type=float, required=True, help="seconds")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ballast-mb", type=float, default=32.0)
    args = parser.parse_args(argv)

    from crashsafe.manager import CheckpointManager
    from crashsafe.policies.names import policy_from_name
    from crashsafe.workloads.digits import DigitsTrainer
    from crashsafe.workloads.supervised import deterministic_torch, train_logged

    deterministic_torch()
    trainer = DigitsTrainer(seed=args.seed)
    policy = policy_from_name(args.policy, mtbf=args.mtbf)
    ballast = np.random.default_rng(args.seed).random(int(args.ballast_mb * 2**20) // 8)
    trainer.state = {**trainer.state, "policy": policy, "ballast": ballast}  # it advances state["step"]
    with CheckpointManager(args.dir, keep_last=2, policy=policy) as mgr:
        train_logged(trainer, mgr, args.log, args.steps, spawned=spawned)


if __name__ == "__main__":
    main(sys.argv[1:])
