"""Open a shelf made by ``state_a`` and change it to state B in one transaction.

Usage: shelf_change.py PATH TX_MODE DURABILITY. With CRASHSAFE_KILL_AT=shelf_<point> the process
SIGKILLs itself at that point of the protocol; "committed" is printed if it was not killed.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np

from crashsafe.shelf import Shelf

path, tx_mode, durability = sys.argv[1], sys.argv[2], sys.argv[3]
warnings.simplefilter("ignore")
with Shelf(path, tx_mode=tx_mode, durability=durability) as shelf:  # type: ignore[arg-type]
    print("recovered", shelf.recovered is not None, flush=True)
    with shelf.transaction():
        a = shelf["a"]
        half = len(a) // 2
        a[:half] = 9.0  # a torn in-place write until the rest follows
        shelf["b"] = np.full(shelf["b"].shape, 7, np.int32)
        del shelf["c"]
        shelf["d"] = np.arange(5)
        shelf["n"] = 2
        shelf["s"] = "B"
        shelf.resize("e", 10)
        a[half:] = 9.0
print("committed", flush=True)
