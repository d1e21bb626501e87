"""Run benchmarks: ``python -m bench [name ...]``; results land in ``bench/results/``.

Each benchmark is a module ``bench/<name>.py`` or package ``bench/<name>/`` with ``main(argv)``.
The names come first; everything from the first option on goes to each benchmark as it is
(``python -m bench storage --repeat 2 --only commit``).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

ORDER = [  # make bench runs them in this order
    "core",
    "compression",
    "shelf",
    "policies",
    "ps",
    "storage",
    "integrations",
    "restore",
    "distributed",
    "memory_tier",
]


def main(argv: list[str]) -> None:
    here = Path(__file__).parent
    found = {m.name for m in pkgutil.iter_modules([str(here)]) if not m.name.startswith("_")}
    first_option = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    names, options = argv[:first_option], argv[first_option:]
    wanted = names or [n for n in ORDER if n in found]
    for name in wanted:
        if name not in found:
            raise SystemExit(f"no benchmark named {name!r}; have {sorted(found)}")
        print(f"=== bench {name}", flush=True)
        importlib.import_module(f"bench.{name}").main(options)


if __name__ == "__main__":
    main(sys.argv[1:])
