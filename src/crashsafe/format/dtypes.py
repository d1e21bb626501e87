"""The closed set of element types a checkpoint may hold, by name.

Names are stable strings written into the manifest. Types numpy lacks (bfloat16, float8) are stored
as unsigned integers of the same width and reinterpreted by torch on load.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["DTYPES", "FLOAT_DTYPES", "storage_dtype", "torch_dtype", "torch_dtype_name"]

# name -> numpy dtype the bytes are stored (and exposed without torch) as.
DTYPES: dict[str, np.dtype[Any]] = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
    # torch-only types, stored as raw unsigned integers of the same width
    "bfloat16": np.dtype(np.uint16),
    "float8_e4m3fn": np.dtype(np.uint8),
    "float8_e5m2": np.dtype(np.uint8),
    "float8_e4m3fnuz": np.dtype(np.uint8),
    "float8_e5m2fnuz": np.dtype(np.uint8),
}

FLOAT_DTYPES = frozenset({"float16", "float32", "float64", "bfloat16"})

if sys.byteorder != "little":  # pragma: no cover - every platform torch supports today is LE
    raise ImportError("crashsafe writes little-endian checkpoints and needs a little-endian host")


def storage_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype that holds the bytes of element type ``name``."""
    return DTYPES[name]


def torch_dtype_name(dtype: Any) -> str | None:
    """Manifest name of a ``torch.dtype``, or None if crashsafe does not store it."""
    name = str(dtype).removeprefix("torch.")
    return name if name in DTYPES else None


def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` for a manifest name (imports torch)."""
    import torch

    return getattr(torch, name)
