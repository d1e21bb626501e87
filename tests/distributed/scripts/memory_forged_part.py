"""One rank of a 2-rank job with a memory tier on hosts a and b. Usage: memory_forged_part.py DISK
MEMORY MODE. MODE "save": saves steps 1 to 3 (x = 10 * step + rank), nothing persistent. MODE
"restore": restores; rank 1 is a hostile peer that, asked for rank 0's part, sends its own (rank
1's, and so labelled). Each rank prints "restored STEP X0" or the error restore raised."""

import sys
from pathlib import Path

import torch.distributed as dist
from leaving import leave
from memory_pair import save_or_restore

import crashsafe as cs
import crashsafe.distributed.peers as peers
from crashsafe.storage.local import LocalStore

disk, memory, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
tier = cs.MemoryTier(memory / "ab"[rank], persist_every=100, host="ab"[rank])
if mode == "restore" and rank == 1:
    sending = peers._Sending._read
    mine = LocalStore(memory / "b" / "rank_1")
    peers._Sending._read = lambda self, store: sending(self, mine)  # type: ignore[method-assign]
save_or_restore(disk, tier, mode)
leave()
