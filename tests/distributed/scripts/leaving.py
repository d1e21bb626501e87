"""How the test jobs end: every rank tears down its process group before any rank exits."""

from __future__ import annotations

import time

import torch.distributed as dist


def leave() -> None:
    """Destroy the default group, then wait (on the rendezvous store) until every rank has. A rank
    that exits while a peer is still tearing down its gloo pairs can make that peer abort at exit
    (SIGABRT, 'terminate called without an active exception'; seen about once in a full test run
    on a loaded machine, after a barrier). Rank 0 hosts the store, so it leaves last."""
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    store.add("torn-down", 1)
    while store.add("torn-down", 0) < world:
        time.sleep(0.005)
    if rank == 0:
        while store.add("gone", 0) < world - 1:  # the others no longer use the store
            time.sleep(0.005)
    else:
        store.add("gone", 1)
