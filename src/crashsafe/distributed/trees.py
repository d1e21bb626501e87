"""A distributed step read by one plain process: rank 0's tree, said so when the ranks' differ.

Each rank of a distributed step saves its own tree. The shards of a DTensor are one array, which a
plain process assembles whole, so ranks that saved only shards and values they all held alike
saved one state; so did ranks whose ``RNGState`` differs (each rank draws its own by design). A
rank that saved its own value under a path (rank-local tensors), or other keys or python values,
saved another: a load in one process gets rank 0's, and a
:class:`~crashsafe.errors.CrashsafeWarning` names the ranks and paths it leaves behind.
"""

from __future__ import annotations

import json
from typing import Any

from crashsafe._log import warn
from crashsafe.errors import CrashsafeWarning
from crashsafe.format.manifest import Manifest
from crashsafe.format.tree import ARRAY_NODES

__all__ = ["plain_tree"]

_NAMED = 5  # ranks and paths a warning names
_RNG = "crashsafe.state.rng.RNGState"  # the class a saved RNGState's node names


def plain_tree(manifest: Manifest) -> dict[str, Any]:
    """Rank 0's tree, for a process that is not one of the step's ranks; with a warning when
    another rank saved a state other than rank 0's."""
    if manifest.world > 1:
        first = _comparable(manifest.tree, manifest)
        apart = [r for r in range(1, manifest.world) if _comparable(manifest.tree_of(r), manifest) != first]
        if apart:
            warn(_message(manifest, apart), CrashsafeWarning)
    return manifest.tree


def _message(manifest: Manifest, apart: list[int]) -> str:
    mine = _arrays(manifest.tree, manifest)
    paths: set[str] = set()
    for rank in apart:
        theirs = _arrays(manifest.tree_of(rank), manifest)
        paths |= {path for path in mine.keys() | theirs.keys() if mine.get(path) != theirs.get(path)}
    what = f"its own values of {_names(sorted(paths))}" if paths else "other keys or python values"
    return (
        f"step {manifest.step} was saved by {manifest.world} ranks, and rank {_names(apart)} saved {what} "
        f"beside rank 0's: a load in one process returns rank 0's state. Restore the step with a "
        f"distributed manager of {manifest.world} ranks to give each rank its own"
    )


def _names(items: list[Any]) -> str:
    shown = ", ".join(repr(i) if isinstance(i, str) else str(i) for i in items[:_NAMED])
    return shown + (f" and {len(items) - _NAMED} more" if len(items) > _NAMED else "")


def _held(manifest: Manifest, index: int) -> tuple[Any, ...]:
    """What a payload holds, comparable across ranks: a shard stands for the whole array it is part
    of (a plain process assembles it), any other payload for its stored bytes."""
    entry = manifest.payloads[index]
    if entry.shard is not None:
        return ("shard", entry.path, entry.shard[0])
    return (entry.dtype, entry.shape, entry.xxh3, entry.base, json.dumps(entry.codec, sort_keys=True))


def _comparable(node: Any, manifest: Manifest) -> Any:
    """A (validated) rank's tree with each array node's payload id replaced by what it holds, and
    its RNG states left out: each rank draws its own by design (dropout masks, data order)."""
    if isinstance(node, dict):
        if node.get("t") == "stateful" and node.get("class") == _RNG:
            return _RNG
        if node.get("t") in ARRAY_NODES:
            return {**node, "id": _held(manifest, node["id"])}
        return {key: _comparable(value, manifest) for key, value in node.items()}
    if isinstance(node, list):
        return [_comparable(value, manifest) for value in node]
    return node


def _arrays(node: Any, manifest: Manifest) -> dict[str, tuple[Any, ...]]:
    """The payload path of each array a tree uses (not of its RNG states), and what it holds."""
    if isinstance(node, dict):
        if node.get("t") == "stateful" and node.get("class") == _RNG:
            return {}
        if node.get("t") in ARRAY_NODES:
            return {manifest.payloads[node["id"]].path: _held(manifest, node["id"])}
        return {p: h for value in node.values() for p, h in _arrays(value, manifest).items()}
    if isinstance(node, list):
        return {p: h for value in node for p, h in _arrays(value, manifest).items()}
    return {}
