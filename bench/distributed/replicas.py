"""Why crashsafe hashes replicas: a tensor that each rank holds under the same name, with different
values (per-rank state, or replicas that drifted apart), saved and restored by DCP and by crashsafe.

Run: ``.venv/bin/python -m bench.distributed.replicas`` (2 ranks, gloo on 127.0.0.1). DCP's planner
keeps one rank's copy of a non-DTensor tensor by its name, without reading it, so every rank
restores rank 0's values; crashsafe finds by content that the copies differ and keeps each one.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import crashsafe as cs


def _rank(rank: int, port: int, directory: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo")
    mine = float(rank + 1)
    dcp.save({"x": torch.full((4,), mine)}, checkpoint_id=Path(directory, "dcp"))
    back = {"x": torch.zeros(4)}
    dcp.load(back, checkpoint_id=Path(directory, "dcp"))
    with cs.CheckpointManager(Path(directory, "crashsafe")) as mgr:
        mgr.save(1, {"x": torch.full((4,), mine)})
        ours = {"x": torch.zeros(4)}
        mgr.restore(ours)
    print(f"rank {rank} saved x = {mine}: dcp.load gives {back['x'][0].item()}, crashsafe restore gives "
          f"{ours['x'][0].item()}", flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_rank, args=(port, directory), nprocs=2)


if __name__ == "__main__":
    sys.exit(main())
