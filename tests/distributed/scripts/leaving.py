"""How the test jobs end: every rank tears down its process group before any rank exits, then
exits at once."""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist


def leave() -> None:
    """Destroy the default group, then wait (on the rendezvous store) until every rank has. Rank 0
    hosts the store, so it leaves last. Then exit at once, skipping the interpreter's teardown
    (as bench/distributed/rank.py does): the job's work is done and reported, and that teardown
    only destroys what torch still holds (FSDP2 modules keep their process groups), where gloo can
    abort a rank whose peers have gone (SIGABRT, 'terminate called without an active exception').
    It did once in a few hundred jobs even after this rendezvous: in CI (stop 24), rank 1 of a
    2-rank FSDP2 job, after rank 0, which waits here for rank 1, had exited 0."""
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
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
