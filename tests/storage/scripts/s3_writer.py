"""Save steps to an S3 location in a loop until killed.

Usage: s3_writer.py ENDPOINT URL SEED. Prints "ready" after the first commit. Step n holds arrays
filled with n, so a reader can check each step is whole; sizes vary so kills land anywhere in an
upload (small packed shards, large multipart payloads, the manifest).
"""

import sys

import numpy as np

from crashsafe.codecs.incremental import Incremental
from crashsafe.manager import CheckpointManager

endpoint, url, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = {
    "key": "testing",
    "secret": "testing",
    "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
}
rng = np.random.default_rng(seed)
with CheckpointManager(
    url, storage_options=options, keep_last=3, codec={"small.*": Incremental(full_every=3)}
) as mgr:
    first = mgr.latest_step()
    start = 0 if first is None else first + 1
    for step in range(start, start + 10_000):
        big = int(rng.integers(1, 9)) << 16  # 256 KiB..2 MiB of float32
        state = {
            "big": np.full(big, float(step), dtype=np.float32),
            "small": {f"t{i}": np.full(1000, float(step)) for i in range(20)},
            "step": step,
        }
        mgr.save(step, state)
        if step == start:
            mgr.wait()
            print("ready", flush=True)
