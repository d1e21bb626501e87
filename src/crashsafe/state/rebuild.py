"""Rebuild nested state from a validated tree, and copy it into live objects in place."""

from __future__ import annotations

from collections.abc import MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np

from crashsafe._torch import is_tensor
from crashsafe.errors import UnsupportedStateError
from crashsafe.state.tree import format_path, is_stateful

__all__ = ["apply_into", "check_into", "to_value", "unflatten"]


def unflatten(tree: dict[str, Any], values: Sequence[Any]) -> Any:
    """Nested python value described by ``tree``; ``values[i]`` fills ``{"t": "array", "id": i}``.

    Stateful nodes come back as the plain ``state_dict`` they were saved from. ``tree`` must
    already be validated (``crashsafe.format.manifest`` does that).
    """
    t = tree["t"]
    if t == "none":
        return None
    if t in ("bool", "str"):
        return tree["v"]
    if t == "int":
        return int(tree["v"])
    if t == "float":
        return float.fromhex(tree["v"])
    if t == "array":
        return values[tree["id"]]
    if t == "dict":
        return {k: unflatten(v, values) for k, v in zip(tree["keys"], tree["vals"], strict=True)}
    if t == "list":
        return [unflatten(v, values) for v in tree["items"]]
    if t == "tuple":
        return tuple(unflatten(v, values) for v in tree["items"])
    if t == "stateful":
        return unflatten(tree["value"], values)
    raise AssertionError(f"unvalidated tree node {t!r}")


def apply_into(target: Any, saved: Any, parts: tuple[str | int, ...] = ()) -> Any:
    """Load ``saved`` into ``target`` in place where possible; return the value to keep.

    Modules/optimizers get ``load_state_dict``, tensors and arrays are copied into, dicts and lists
    are updated item by item, and immutable values (scalars, tuples) are returned so the parent
    container can replace them.
    """
    where = format_path(parts)
    if is_stateful(target) and not isinstance(target, (dict, list)):
        target.load_state_dict(saved)
        return target
    if is_tensor(target):
        return _copy_tensor(target, saved, where)
    if isinstance(target, np.ndarray):
        saved_arr = np.asarray(saved.numpy() if is_tensor(saved) else saved)
        if saved_arr.shape != target.shape:
            raise UnsupportedStateError(
                f"state at '{where}': checkpoint has shape {saved_arr.shape}, the live array "
                f"{target.shape}; build the array with the saved shape before restoring"
            )
        np.copyto(target, saved_arr, casting="same_kind")
        return target
    if isinstance(target, MutableMapping):
        if not isinstance(saved, dict):
            raise _mismatch(where, target, saved)
        for key in list(target.keys()):
            if key not in saved:
                raise UnsupportedStateError(
                    f"state at '{format_path((*parts, key))}' is not in the checkpoint; remove it "
                    "from the state passed to restore(), or use load() to read what was saved"
                )
            target[key] = apply_into(target[key], saved[key], (*parts, key))
        return target
    if isinstance(target, (MutableSequence, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(target):
            raise _mismatch(where, target, saved)
        items = [apply_into(t, s, (*parts, i)) for i, (t, s) in enumerate(zip(target, saved, strict=True))]
        if isinstance(target, tuple):
            return type(target)(items) if type(target) is tuple else target
        target[:] = items
        return target
    return saved


def check_into(target: Any, saved: Any, parts: tuple[str | int, ...] = (), lenient: bool = False) -> None:
    """Raise what :func:`apply_into` would raise, without changing anything.

    Run first, so a mismatched checkpoint leaves the live state untouched. Inside Stateful objects
    it compares against their current ``state_dict()`` leniently: only tensors and arrays present
    on both sides are checked (their own ``load_state_dict`` judges the rest).
    """
    where = format_path(parts)
    if is_stateful(target) and not isinstance(target, (dict, list)):
        check_into(target.state_dict(), saved, parts, lenient=True)
        return
    if is_tensor(target) or isinstance(target, np.ndarray):
        saved_shape = tuple(saved.shape) if hasattr(saved, "shape") else None
        if saved_shape != tuple(target.shape):
            raise UnsupportedStateError(
                f"state at '{where}': checkpoint has shape {saved_shape}, the live value "
                f"{tuple(target.shape)}; build it with the saved configuration before restoring"
            )
        if is_tensor(target) and is_tensor(saved) and saved.dtype != target.dtype:
            raise UnsupportedStateError(
                f"state at '{where}': checkpoint has dtype {saved.dtype}, the live tensor {target.dtype}; "
                "cast the live tensor or load() the checkpoint and convert it yourself"
            )
        return
    if isinstance(target, MutableMapping) or (lenient and isinstance(target, dict)):
        if not isinstance(saved, dict):
            raise _mismatch(where, target, saved)
        for key in target:
            if key in saved:
                check_into(target[key], saved[key], (*parts, key), lenient)
            elif not lenient:
                raise UnsupportedStateError(
                    f"state at '{format_path((*parts, key))}' is not in the checkpoint; remove it "
                    "from the state passed to restore(), or use load() to read what was saved"
                )
        return
    if isinstance(target, (MutableSequence, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(target):
            if lenient:
                return
            raise _mismatch(where, target, saved)
        for i, (t, s) in enumerate(zip(target, saved, strict=True)):
            check_into(t, s, (*parts, i), lenient)


def _copy_tensor(target: Any, saved: Any, where: str) -> Any:
    import torch

    src = saved if is_tensor(saved) else torch.from_numpy(np.asarray(saved))
    if tuple(src.shape) != tuple(target.shape):
        raise UnsupportedStateError(
            f"state at '{where}': checkpoint has shape {tuple(src.shape)}, the live tensor "
            f"{tuple(target.shape)}; build the model with the saved configuration before restoring"
        )
    if src.dtype != target.dtype:
        raise UnsupportedStateError(
            f"state at '{where}': checkpoint has dtype {src.dtype}, the live tensor {target.dtype}; "
            "cast the live tensor or load() the checkpoint and convert it yourself"
        )
    with torch.no_grad():
        target.copy_(src)
    return target


def _mismatch(where: str, target: Any, saved: Any) -> UnsupportedStateError:
    return UnsupportedStateError(
        f"state at '{where}': the live value is a {type(target).__name__} but the checkpoint holds "
        f"a {type(saved).__name__}; restore into a state with the same structure as the one saved"
    )


def to_value(kind: str, dtype: str, array: np.ndarray[Any, Any], numpy: bool = False) -> Any:
    """Turn a decoded array (storage dtype) into what was saved: tensor, array, scalar or bytes."""
    if kind == "bytes":
        return array.tobytes()
    if kind == "npscalar":
        return array[()]
    if kind == "torch" and not numpy:
        try:
            import torch
        except ImportError:
            raise UnsupportedStateError(
                "this checkpoint holds torch tensors but torch is not installed; install "
                "crashsafe[torch], or call load(..., numpy=True) to get numpy arrays"
            ) from None
        from crashsafe.format.dtypes import torch_dtype

        tensor = torch.from_numpy(array if array.flags.c_contiguous else array.copy())
        wanted = torch_dtype(dtype)
        return tensor if tensor.dtype == wanted else tensor.view(wanted)
    return array
