"""Run benchmarks: ``python -m bench [name ...]``; results land in ``bench/results/``.

Each benchmark is a module ``bench/<name>.py`` or package ``bench/<name>/`` with ``main(argv)``.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

ORDER = ["core", "compression", "shelf", "policies", "ps"]


def main(argv: list[str]) -> None:
    here = Path(__file__).parent
    found = {m.name for m in pkgutil.iter_modules([str(here)]) if not m.name.startswith("_")}
    wanted = [a for a in argv if not a.startswith("-")] or [n for n in ORDER if n in found]
    for name in wanted:
        if name not in found:
            raise SystemExit(f"no benchmark named {name!r}; have {sorted(found)}")
        print(f"=== bench {name}", flush=True)
        importlib.import_module(f"bench.{name}").main([a for a in argv if a.startswith("-")])


if __name__ == "__main__":
    main(sys.argv[1:])
