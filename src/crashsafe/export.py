"""Export a step's tensors to a safetensors file (or a Hugging Face model folder), checksums verified.

Tensors are named by their dotted state paths; ``prefix`` selects the ones under it and is
stripped, so ``prefix="model."`` gives the names ``model.state_dict()`` has and the file loads with
``load_state_dict(strict=True)``. Views (tied weights) are exported under each of their names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from crashsafe.chain import ChainReader
from crashsafe.distributed.shards import read_sharded
from crashsafe.errors import CrashsafeError, NoCheckpointError
from crashsafe.format.manifest import Manifest
from crashsafe.state.rebuild import array_nodes, unflatten, view_of
from crashsafe.storage.layout import parse_step_name
from crashsafe.storage.stores import open_store

__all__ = ["HF_CONFIG_KEY", "export_hf", "export_safetensors"]

HF_CONFIG_KEY = "hf_config"  # a state's model config (``model.config.to_dict()``), for --hf-dir
Progress = Callable[[int, int], None]


def export_safetensors(
    directory: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    step: int | None = None,
    prefix: str = "",
    keep_prefix: bool = False,
    progress: Progress | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[int, int, int]:
    """Write the tensors of ``step`` (default newest) under ``prefix`` to ``output`` with the prefix
    stripped (kept with ``keep_prefix``); return (step, count, bytes). Bytes and python values are
    not exported."""
    _check_output(Path(output), directory)
    found, manifest, arrays = _read(directory, step, storage_options)
    tensors, bf16 = _tensors(manifest, arrays, prefix, keep_prefix, progress)
    _save(tensors, bf16, Path(output), found)
    return found, len(tensors), sum(a.nbytes for a in tensors.values())


def export_hf(
    directory: str | os.PathLike[str],
    folder: str | os.PathLike[str],
    *,
    step: int | None = None,
    prefix: str = "model.",
    progress: Progress | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[int, int, int, bool]:
    """A folder ``from_pretrained`` reads: ``model.safetensors`` (the tensors under ``prefix``, prefix
    stripped) and, if the state holds ``hf_config``, ``config.json``. Returns (step, count, bytes,
    whether a config was written)."""
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise CrashsafeError(f"{out} exists and is not a directory; give a folder for --hf-dir")
    _check_output(out / "model.safetensors", directory, folder_made_here=True)
    found, manifest, arrays = _read(directory, step, storage_options)
    tensors, bf16 = _tensors(manifest, arrays, prefix, False, progress)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CrashsafeError(f"cannot create the folder {out}: {exc.strerror or exc}") from None
    _save(tensors, bf16, out / "model.safetensors", found)
    tree = manifest.tree
    config = None
    if tree["t"] == "dict" and HF_CONFIG_KEY in tree["keys"]:
        config = unflatten(tree["vals"][tree["keys"].index(HF_CONFIG_KEY)], arrays)
    if isinstance(config, dict):
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    return found, len(tensors), sum(a.nbytes for a in tensors.values()), isinstance(config, dict)


def _read(
    directory: str | os.PathLike[str], step: int | None, storage_options: Mapping[str, Any] | None
) -> tuple[int, Manifest, list[np.ndarray[Any, Any]]]:
    store = open_store(directory, storage_options=storage_options, existing=True)
    try:
        if step is None:
            steps = store.steps()
            if not steps:
                raise NoCheckpointError(f"no committed checkpoint in {directory}")
            step = steps[-1]
        with ChainReader(store) as chains:  # verified, and through delta chains
            manifest = chains.manifest(step)
            arrays: list[Any] = [None] * len(manifest.payloads)
            for _, node in array_nodes(manifest.tree):
                if arrays[node["id"]] is None:
                    arrays[node["id"]] = _whole(chains, manifest, node["id"])
    finally:
        store.close()
    return step, manifest, arrays


def _whole(chains: ChainReader, manifest: Manifest, index: int) -> np.ndarray[Any, Any]:
    """Payload ``index`` decoded (storage dtype); a shard of a distributed step is assembled with
    the other ranks' shards into the whole tensor."""
    entry = manifest.payloads[index]
    if entry.shard is None:
        return chains.decode(manifest.step, entry)  # type: ignore[no-any-return]
    return read_sharded(chains, manifest, entry, None, numpy=True)  # type: ignore[no-any-return]


def _tensors(
    manifest: Manifest,
    arrays: list[np.ndarray[Any, Any]],
    prefix: str,
    keep_prefix: bool,
    progress: Progress | None,
) -> tuple[dict[str, np.ndarray[Any, Any]], set[str]]:
    """The arrays under ``prefix`` by export name (a view becomes a contiguous copy of its values),
    and the names of the bfloat16 ones (stored as uint16)."""
    chosen = [(path, node) for path, node in array_nodes(manifest.tree) if path.startswith(prefix)]
    chosen = [(path, node) for path, node in chosen if manifest.payloads[node["id"]].kind != "bytes"]
    tensors: dict[str, np.ndarray[Any, Any]] = {}
    bf16 = set()
    for i, (path, node) in enumerate(chosen):
        entry = manifest.payloads[node["id"]]
        if entry.dtype.startswith("float8"):
            raise CrashsafeError(f"{path}: float8 tensors cannot be exported to safetensors")
        name = path if keep_prefix else path[len(prefix) :]
        if not name:
            raise CrashsafeError(
                f"{path!r} is the prefix itself: stripped, it has no name. Use --keep-prefix"
            )
        if entry.dtype == "bfloat16":
            bf16.add(name)
        array = arrays[node["id"]]
        tensors[name] = array if node["t"] == "array" else np.ascontiguousarray(view_of(array, node))
        if progress is not None:
            progress(i + 1, len(chosen))
    if not tensors:
        raise NoCheckpointError(f"step {manifest.step} has no tensors under prefix {prefix!r}")
    return tensors, bf16


def _check_output(output: Path, directory: str | os.PathLike[str], folder_made_here: bool = False) -> None:
    """Refuse, before reading anything, a file to export to that is not one (a directory, a FIFO, a
    device: safetensors would replace it with a file) or is a local checkpoint directory's own entry
    (a step, the lock, a temporary) or inside one. An existing regular file is replaced, as ``cp``
    replaces one. Its folder must exist, unless ``folder_made_here`` (``--hf-dir`` makes it)."""
    if output.is_dir() or (output.exists() and not output.is_file()):
        raise CrashsafeError(f"{output} is a directory, a FIFO or a device, not a file; give a file path")
    if not folder_made_here and not output.parent.is_dir():
        raise CrashsafeError(f"the directory of {output} does not exist; create it first")
    root = Path(directory).resolve() if "://" not in str(directory) else None
    where = output.parent.resolve() / output.name
    if root is not None and where.is_relative_to(root):
        name = where.relative_to(root)
        if len(name.parts) != 1 or name.name.startswith(".") or parse_step_name(name.name) is not None:
            raise CrashsafeError(
                f"{output} is one of the checkpoint directory's own entries, or inside one: writing there "
                "could replace a committed step's files. Export somewhere else"
            )


def _save(tensors: dict[str, np.ndarray[Any, Any]], bf16: set[str], output: Path, step: int) -> None:
    """safetensors with the metadata transformers requires (``format: pt``); bfloat16 through torch."""
    from safetensors import SafetensorError

    try:
        _write(tensors, bf16, output, step)
    except (OSError, SafetensorError) as exc:
        raise CrashsafeError(f"writing {output} failed: {exc}") from None


def _write(tensors: dict[str, np.ndarray[Any, Any]], bf16: set[str], output: Path, step: int) -> None:
    metadata = {"format": "pt", "crashsafe_step": str(step)}
    if not bf16:
        from safetensors.numpy import save_file

        save_file(tensors, str(output), metadata=metadata)
        return
    try:
        import torch
        from safetensors.torch import save_file as save_torch
    except ImportError:
        raise CrashsafeError("exporting bfloat16 tensors needs torch; install crashsafe[torch]") from None
    converted = {}
    for name, array in tensors.items():
        t = torch.from_numpy(array)
        converted[name] = t.view(torch.bfloat16) if name in bf16 else t
    save_torch(converted, str(output), metadata=metadata)
