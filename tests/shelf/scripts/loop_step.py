"""Open a shelf made by ``loop_state_a`` (tests/shelf/test_shelf_loop.py) and run one loop iteration
that turns it into state B.

Usage: loop_step.py PATH DURABILITY. With CRASHSAFE_KILL_AT=shelf_loop_<point> the process SIGKILLs
itself at that point of the loop's protocol; "committed" is printed if it was not killed.
"""

from __future__ import annotations

import sys
import warnings

from crashsafe.shelf import Shelf

path, durability = sys.argv[1], sys.argv[2]
warnings.simplefilter("ignore")
with Shelf(path, durability=durability) as shelf:  # type: ignore[arg-type]
    loop = shelf.loop("x", "y", "it", "loss", "done")
    out = loop.begin()
    out["x"][:] = 9.0
    out["y"][:] = 7
    loop.commit({"x": out["x"], "y": out["y"], "it": 2, "loss": 0.25, "done": True})
print("committed", flush=True)
