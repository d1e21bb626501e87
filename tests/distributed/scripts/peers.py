"""One rank of a job that copies memory-tier parts between ranks (crashsafe.distributed.peers).

Usage: peers.py ROOT TIMEOUT TRANSFERS [MODE]. Rank r's memory is ROOT/mem<r>, its store of rank
o's parts ROOT/mem<r>/rank_<o> (the test wrote the parts before the launch). TRANSFERS is a JSON
list of [owner, step, source, target]. MODE: "die" (rank 2 is SIGKILLed before the exchange),
"hang" (rank 2 sleeps through it), "forge" (rank 0 sends a forged manifest of step 8). Each
surviving rank prints one JSON line: the exchange's seconds and its outcome per transfer.
"""

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist
from leaving import leave

import crashsafe.distributed.peers as peers
from crashsafe.format.manifest import Manifest, dumps
from crashsafe.storage.local import LocalStore


def main() -> None:
    root, timeout, listed = Path(sys.argv[1]), float(sys.argv[2]), json.loads(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else ""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    transfers = [peers.Transfer(*t) for t in listed]
    if mode == "forge" and rank == 0:

        def forged(manifest: Manifest) -> bytes:  # a manifest altered on the way: its checksum fails
            body = dumps(manifest)
            return body.replace(b'"step":8', b'"step":9') if manifest.step == 8 else body

        peers.dumps = forged  # type: ignore[attr-defined]  # (the sender's, on rank 0)
    if rank == 2 and mode == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2 and mode == "hang":
        time.sleep(3 * timeout)
        os._exit(0)
    began = time.monotonic()
    outcome = peers.exchange(
        dist.group.WORLD,
        rank,
        transfers,
        lambda owner: LocalStore(root / f"mem{rank}" / f"rank_{owner}", create=True),
        "copying",
    )
    seconds = time.monotonic() - began
    report = {
        "seconds": seconds,
        "outcome": [[[t.owner, t.step, t.source, t.target], m] for t, m in outcome.items()],
    }
    print(json.dumps(report), flush=True)
    if mode in ("die", "hang"):  # a peer is gone: no teardown together
        sys.stdout.flush()
        os._exit(0)
    leave()


if __name__ == "__main__":
    main()
