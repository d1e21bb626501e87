"""Export a step's tensors to a safetensors file, checksums verified on the way."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from crashsafe.chain import read_step
from crashsafe.errors import CrashsafeError, NoCheckpointError
from crashsafe.storage.stores import open_store

__all__ = ["export_safetensors"]


def export_safetensors(
    directory: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    step: int | None = None,
    prefix: str = "",
    progress: Callable[[int, int], None] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[int, int, int]:
    """Write the arrays of ``step`` (default newest) to ``output``; return (step, count, bytes).

    Tensor names are the dotted state paths. Bytes and python values are not exported.
    """
    from safetensors.numpy import save_file

    store = open_store(directory, storage_options=storage_options)
    try:
        if step is None:
            steps = store.steps()
            if not steps:
                raise NoCheckpointError(f"no committed checkpoint in {directory}")
            step = steps[-1]
        manifest, arrays = read_step(store, step)  # verified, and through delta chains
    finally:
        store.close()
    tensors: dict[str, np.ndarray] = {}
    bf16: list[str] = []
    entries = [
        (e, a)
        for e, a in zip(manifest.payloads, arrays, strict=True)
        if e.kind != "bytes" and e.path.startswith(prefix)
    ]
    for i, (entry, array) in enumerate(entries):
        if entry.dtype.startswith("float8"):
            raise CrashsafeError(f"{entry.path}: float8 tensors cannot be exported to safetensors")
        if entry.dtype == "bfloat16":
            bf16.append(entry.path)
        tensors[entry.path] = array
        if progress is not None:
            progress(i + 1, len(entries))
    if not tensors:
        raise NoCheckpointError(f"step {step} has no tensors under prefix {prefix!r}")
    if bf16:
        _save_with_torch(tensors, bf16, Path(output))
    else:
        save_file(tensors, str(output), metadata={"crashsafe_step": str(step)})
    nbytes = sum(a.nbytes for a in tensors.values())
    return step, len(tensors), nbytes


def _save_with_torch(tensors: dict[str, np.ndarray], bf16: list[str], output: Path) -> None:
    try:
        import torch
        from safetensors.torch import save_file
    except ImportError:
        raise CrashsafeError("exporting bfloat16 tensors needs torch; install crashsafe[torch]") from None
    converted = {}
    for name, array in tensors.items():
        t = torch.from_numpy(array)
        converted[name] = t.view(torch.bfloat16) if name in bf16 else t
    save_file(converted, str(output))
