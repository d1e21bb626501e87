"""One rank of a 2-rank job with a memory tier on hosts a and b. Usage: memory_swapped.py DISK MEMORY
MODE. MODE "save": saves steps 1 to 3 (x = 10 * step + rank). MODE "restore": restores, and rank 0's
own copy of step 3 is damaged after the ranks listed it and before they restore it (its manifest
flipped). Each rank prints "restored STEP X0" or the error restore raised."""

import sys
from pathlib import Path

import torch.distributed as dist
from leaving import leave
from memory_pair import save_or_restore

import crashsafe as cs
import crashsafe.recovery as recovery

disk, memory, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
tier = cs.MemoryTier(memory / "ab"[rank], persist_every=100, host="ab"[rank])
if mode == "restore" and rank == 0:
    pull, damaged = recovery._pull, []

    def damaging(memory, step, *rest):  # type: ignore[no-untyped-def]
        source = pull(memory, step, *rest)
        manifest = Path(memory.own.location) / f"step_{step:012d}" / "manifest.json"
        if step == 3 and not damaged:  # (once: the copy pulled in its place stays intact)
            damaged.append(step)
            raw = bytearray(manifest.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            manifest.write_bytes(bytes(raw))
        return source

    recovery._pull = damaging
save_or_restore(disk, tier, mode)
leave()
