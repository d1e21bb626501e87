"""What a shelf stores a value as: numeric arrays as native-endian ndarrays, ``str``/``bytes`` as
bytes, scalars as plain Python values; anything else is refused with the reason."""

from __future__ import annotations

from typing import Any

import numpy as np

from crashsafe._torch import is_tensor
from crashsafe.errors import UnsupportedStateError
from crashsafe.shelf.meta import DTYPE_NAMES, NUMERIC_DTYPES, scalar_ok

__all__ = ["coerce", "native_dtype", "same_scalar"]

# what empty()/reserve() accept as a dtype, resolved without numpy's dtype machinery
_DTYPE_ARGS: dict[Any, tuple[np.dtype[Any], str]] = {
    key: (dt, name) for name, dt in NUMERIC_DTYPES.items() for key in (name, dt, dt.type)}
_NATIVE_IDS = frozenset(map(id, DTYPE_NAMES))  # numpy's builtin dtypes are singletons: a quick test
_SCALAR_TYPES = (bool, int, float, complex)  # bool first: it is an int too
_PLAIN_SCALARS = frozenset([*_SCALAR_TYPES, type(None)])


def native_dtype(dtype: Any) -> tuple[np.dtype[Any], str]:
    """(dtype, its shelf name) of a native numeric ``dtype`` argument; anything else is refused."""
    try:
        return _DTYPE_ARGS[dtype]
    except (KeyError, TypeError):
        pass
    dt = np.dtype(dtype)
    dtype_name = DTYPE_NAMES.get(dt)
    if dtype_name is None:
        raise UnsupportedStateError(f"dtype {dt} is not a native numeric dtype; a shelf holds bool, int, "
                                    "uint, float and complex arrays")
    return dt, dtype_name


def same_scalar(a: Any, b: Any) -> bool:
    """Are two stored scalars the same value of the same type (NaN equals NaN)?"""
    return type(a) is type(b) and (a == b or (a != a and b != b))


def coerce(name: str, value: Any) -> tuple[str, str, Any]:
    """(name, kind, data): arrays as ndarrays of a numeric dtype, str/bytes as bytes, scalars as
    plain Python values (a subclass such as an ``IntEnum`` is stored as its base type)."""
    if not isinstance(name, str) or not name:
        raise UnsupportedStateError(f"shelf variable names are non-empty strings, got {name!r}")
    if type(value) in _PLAIN_SCALARS:
        return name, "scalar", value
    if isinstance(value, np.ndarray) and (id(value.dtype) in _NATIVE_IDS or value.dtype in DTYPE_NAMES):
        return name, "array", value
    return name, *_coerce_other(name, value)


def _coerce_other(name: str, value: Any) -> tuple[str, Any]:
    if scalar_ok(value):
        base = next(t for t in _SCALAR_TYPES if isinstance(value, t))  # (None took the fast path)
        return "scalar", base(value)
    if isinstance(value, str):
        try:
            return "str", value.encode()
        except UnicodeEncodeError as exc:
            raise UnsupportedStateError(f"shelf[{name!r}]: the string is not valid Unicode ({exc.reason} at "
                                        f"position {exc.start}); store it as bytes") from None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes", bytes(value)
    if is_tensor(value):
        value = value.detach().cpu()
        try:
            value = value.numpy()
        except TypeError as exc:
            raise UnsupportedStateError(f"shelf[{name!r}]: torch dtype {value.dtype} has no numpy "
                                        f"equivalent ({exc}); convert it first") from None
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        raise UnsupportedStateError(
            f"shelf[{name!r}]: cannot store a {type(value).__name__}; a shelf holds numpy arrays (or "
            "torch tensors), bool/int/float/complex/None, str and bytes"
        )
    native = value.dtype.newbyteorder("=")
    if native.name not in NUMERIC_DTYPES or NUMERIC_DTYPES[native.name] != native:
        raise UnsupportedStateError(
            f"shelf[{name!r}]: dtype {value.dtype} is not numeric; a shelf holds bool, int, uint, float "
            "and complex arrays"
        )
    return "array", value if value.dtype == native else value.astype(native)
