"""The shape of the house, recomputed from the import graph of src/ on every run.

Data flows one way (docs/design.md, "The layers"): every module sits in a layer and imports only
from its own layer or lower ones; no import circle, even inside a package; no file over 600 lines.
A module-level import and a function-level (lazy) one count alike: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
MAX_LINES = 600

# Lowest first. A module belongs to the first entry that is it or one of its packages.
LAYERS: list[tuple[str, ...]] = [
    (
        "crashsafe._closing",
        "crashsafe._cuda",
        "crashsafe._faults",
        "crashsafe._log",
        "crashsafe._memory",
        "crashsafe._runtime",
        "crashsafe._torch",
        "crashsafe.errors",
    ),
    ("crashsafe._units", "crashsafe._metrics", "crashsafe.preemption"),
    ("crashsafe.codecs", "crashsafe.policies"),
    ("crashsafe.format",),
    ("crashsafe.state", "crashsafe.storage"),
    (
        "crashsafe.encoding",
        "crashsafe.chain",
        "crashsafe.references",
        "crashsafe.step_facts",
        "crashsafe.copying",
    ),
    ("crashsafe.distributed",),
    (
        "crashsafe.verification",
        "crashsafe.catalog",
        "crashsafe.export",
        "crashsafe.loading",
        "crashsafe.mirroring",
        "crashsafe.tiers",
        "crashsafe.pending",
        "crashsafe.pacing",
        "crashsafe.saving",
        "crashsafe.restoring",
        "crashsafe.mapping",
        "crashsafe.memory_tier",
        "crashsafe.recovery",
    ),
    ("crashsafe.shelf",),
    ("crashsafe.manager",),
    ("crashsafe.workloads", "crashsafe.ps", "crashsafe.integrations", "crashsafe.diff"),
    ("crashsafe.sim",),
    ("crashsafe.cli",),
    ("crashsafe", "crashsafe.__main__"),
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str) -> Iterator[str]:
    """Every crashsafe module ``name`` imports (at any depth of its code)."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).strip(".")
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names
            ]
        else:
            continue
        yield from (t for t in targets if t in MODULES and t != name)


GRAPH = {name: set(_imports(name)) for name in MODULES}


def _layer(name: str) -> int:
    for i, members in enumerate(LAYERS):
        if any(name == m or (m != "crashsafe" and name.startswith(m + ".")) for m in members):
            return i
    raise AssertionError(f"{name} is in no layer: add it to LAYERS")


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        _layer(name)


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    upward = sorted(
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
        for a, targets in GRAPH.items()
        for b in targets
        if _layer(b) > _layer(a)
    )
    assert not upward, "\n".join(upward)


def test_no_import_circle() -> None:
    """Tarjan's strongly connected components: any component with two modules is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    assert not circles, circles


def test_no_file_is_over_600_lines() -> None:
    long = {
        name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long
