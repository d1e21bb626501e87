"""Create a shelf, commit ITERATIONS loop iterations, then assign another variable: the shelf's
third metadata write (its first two: the variables' assignment and the loop's start).

Usage: loop_then_assign.py PATH ITERATIONS. With CRASHSAFE_KILL_AT=shelf_mid_meta:3 the process
SIGKILLs itself halfway through that write; "assigned" is printed if it was not killed.
"""

from __future__ import annotations

import sys

import numpy as np

from crashsafe.shelf import Shelf

path, iterations = sys.argv[1], int(sys.argv[2])
with Shelf(path, size="16MiB") as shelf:
    shelf.update({"x": np.zeros(1000), "it": 0})
    loop = shelf.loop("x", "it")
    for it in range(1, iterations + 1):
        out = loop.begin()
        out["x"][:] = it
        loop.commit({"x": out["x"], "it": it})
    shelf["other"] = 5
print("assigned", flush=True)
