"""``crashsafe show``: one step's metrics, info and tensors (path, dtype, shape, codec, bytes)."""

from __future__ import annotations

import datetime
import fnmatch
from typing import Annotated, Any

import typer
from rich.text import Text

from crashsafe.cli._common import (
    Dir,
    JsonOpt,
    OptionsOpt,
    StepOpt,
    age,
    console,
    emit_json,
    fail,
    human_bytes,
    locate,
    parse_options,
    referred,
)
from crashsafe.cli._tables import Column, print_table
from crashsafe.errors import CrashsafeError
from crashsafe.format.manifest import Manifest, PayloadEntry

__all__ = ["show_cmd"]


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "()"


def _codec(codec: dict[str, Any]) -> str:
    params = ",".join(f"{k}={v}" for k, v in codec.items() if k != "id")
    return str(codec["id"]) + (f"({params})" if params else "")


def _payload_json(p: PayloadEntry) -> dict[str, Any]:
    return {
        "path": p.path,
        "kind": p.kind,
        "dtype": p.dtype,
        "shape": list(p.shape),
        "codec": p.codec,
        "base": p.base,
        "ref": p.ref,
        "raw_bytes": p.raw_nbytes,
        "stored_bytes": p.nbytes,
        "rank": p.rank,
        "shard": None if p.shard is None else {"global_shape": list(p.shard[0]), "offset": list(p.shard[1])},
    }


def _pairs(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


PathOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--path",
        "-p",
        help="only the tensors whose path matches this glob, e.g. 'model.*' (repeatable; quote it)",
    ),
]


def show_cmd(
    directory: Dir,
    step: StepOpt = None,
    path: PathOpt = None,
    storage_options: OptionsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a step: the metrics and info it was saved with, and its tensors: path, dtype, shape,
    codec (and delta base, and the earlier step holding the bytes of a tensor it refers to), bytes,
    ratio (with --path, only the paths that match)."""
    from crashsafe.manager import CheckpointManager

    directory = locate(directory)
    try:
        with CheckpointManager(
            directory, read_only=True, storage_options=parse_options(directory, storage_options)
        ) as mgr:
            manifest = mgr.manifest(step)
    except CrashsafeError as exc:
        raise fail(str(exc)) from None
    shown = _matching(manifest.payloads, path)
    if as_json:
        emit_json(
            {
                "location": directory,
                "step": manifest.step,
                "created": manifest.created,
                "world": manifest.world,
                "saved_as": manifest.saved_as,
                "metrics": manifest.metrics,
                "info": manifest.info,
                "raw_bytes": manifest.raw_nbytes,
                "stored_bytes": manifest.stored_nbytes,
                "referenced_bytes": manifest.referenced_nbytes,
                "references": sorted(manifest.references),
                "tensors": [_payload_json(p) for p in shown],
            }
        )
        return
    _summary(directory, manifest)
    _tensors(manifest, shown)
    if path:
        console.print(Text(f"{len(shown)} of {len(manifest.payloads)} tensors match {' or '.join(path)}"))


def _matching(payloads: tuple[PayloadEntry, ...], patterns: list[str] | None) -> list[PayloadEntry]:
    """The payloads whose path matches one of ``patterns`` (globs, case-sensitive, as codec patterns
    are), all without; none matching is an error naming a few of the paths there are."""
    if not patterns:
        return list(payloads)
    shown = [p for p in payloads if any(fnmatch.fnmatchcase(p.path, g) for g in patterns)]
    if not shown:
        some = ", ".join(p.path for p in payloads[:3]) + (", ..." if len(payloads) > 3 else "")
        raise fail(
            f"no tensor path matches {' or '.join(map(repr, patterns))}; the step's paths look like: "
            f"{some or 'none'} (globs match the whole path: 'model.*', '*weight')"
        )
    return shown


def _summary(directory: str, m: Manifest) -> None:
    when = datetime.datetime.fromtimestamp(m.created).isoformat(sep=" ", timespec="seconds")
    held = m.stored_nbytes + m.referenced_nbytes
    ratio = f" ({m.raw_nbytes / held:.2f}x)" if held else ""
    ranks = f", saved by {m.world} ranks" if m.world > 1 else ""
    stored = f"{human_bytes(m.stored_nbytes)} stored{ratio}"
    if m.references:  # what the step owns, and what it refers to in earlier steps (format version 4)
        refers = referred(m.referenced_nbytes, m.references)
        stored = f"owned {human_bytes(m.stored_nbytes)}, referenced {refers}{ratio}"
    lines = [
        f"step {m.step} of {directory}",
        *([f"Lightning checkpoint file {m.saved_as}"] if m.saved_as else []),
        f"saved {when} ({age(m.created)} ago){ranks}",
        f"{len(m.payloads)} tensors, {human_bytes(m.raw_nbytes)} raw, {stored}",
        f"metrics: {_pairs(m.metrics) or 'none (pass metrics= to save)'}",
        f"info: {_pairs(m.info) or 'none'}",
    ]
    for line in lines:
        console.print(Text(line))


def _tensors(m: Manifest, payloads: list[PayloadEntry]) -> None:
    distributed = any(p.rank is not None for p in m.payloads)
    sharded = any(p.shard is not None for p in m.payloads)
    refers = bool(m.references)
    columns = [
        Column("path", folds=True, breaks=".", min_width=40),
        Column("kind", drop=9),
        *([Column("rank", right=True, drop=3)] if distributed else []),
        Column("dtype"),
        Column("shape"),
        *([Column("of global", drop=4)] if sharded else []),
        Column("codec", folds=True, breaks=",(", min_width=20, drop=5),
        Column("delta of", right=True, drop=6),
        *([Column("held by", right=True, drop=3)] if refers else []),
        Column("raw", right=True, drop=8),
        Column("stored", right=True, drop=2),
        Column("ratio", right=True, drop=7),
    ]
    rows = []
    for p in payloads:
        rows.append(
            [
                p.path,
                p.kind,
                *([str(p.rank)] if distributed else []),
                p.dtype,
                _shape(p.shape),
                *([_placement(p)] if sharded else []),
                _codec(p.codec),
                "-" if p.base is None else f"step {p.base}",
                *(["-" if p.ref is None else f"step {p.ref}"] if refers else []),
                human_bytes(p.raw_nbytes),
                human_bytes(p.nbytes),
                f"{p.raw_nbytes / p.nbytes:.2f}x" if p.nbytes else "-",
            ]
        )
    print_table(None, columns, rows)


def _placement(p: PayloadEntry) -> str:
    """Where a shard sits: '@0,4 of 8x8' (empty for a whole array)."""
    if p.shard is None:
        return ""
    return f"@{','.join(map(str, p.shard[1]))} of {_shape(p.shard[0])}"
