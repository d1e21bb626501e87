"""Rebuild nested state from a validated tree, and copy it into live objects in place."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import pathlib
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np

from crashsafe._torch import is_tensor, loaded_torch
from crashsafe.errors import UnsupportedStateError
from crashsafe.format.dtypes import torch_dtype_name
from crashsafe.state.torch_fit import misfit
from crashsafe.state.tree import format_path, is_stateful, numpy_dtype_name

__all__ = ["apply_into", "array_nodes", "check_into", "live_class", "to_value", "unflatten", "view_of"]


def unflatten(tree: dict[str, Any], values: Sequence[Any]) -> Any:
    """Nested python value described by ``tree``; ``values[i]`` fills ``{"t": "array", "id": i}``.

    Stateful nodes come back as the plain ``state_dict`` they were saved from; views share memory
    with the array they look into; enum members and dataclasses come back as themselves when their
    class is already imported, else as their value and a dict of their fields. ``tree`` must
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
    if t == "view":
        return view_of(values[tree["id"]], tree)
    return _plain_value(tree, values)


def array_nodes(
    tree: dict[str, Any], parts: tuple[str | int, ...] = ()
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted path, node) of every array and view node of a validated tree, in tree order: the
    names ``flatten`` gave them (``crashsafe export`` names tensors so)."""
    t = tree["t"]
    if t in ("array", "view"):
        yield format_path(parts), tree
    elif t in ("dict", "namespace", "dataclass"):
        for key, child in zip(tree["keys"], tree["vals"], strict=True):
            yield from array_nodes(child, (*parts, key))
    elif t in ("list", "tuple"):
        for i, child in enumerate(tree["items"]):
            yield from array_nodes(child, (*parts, i))
    elif t in ("stateful", "enum"):
        yield from array_nodes(tree["value"], parts)


def _plain_value(tree: dict[str, Any], values: Sequence[Any]) -> Any:
    """The values frameworks put in checkpoints: torch dtypes and devices, paths, namespaces,
    enum members and dataclasses."""
    t = tree["t"]
    if t in ("dtype", "device"):
        torch = _torch_for(f"a torch.{t}")
        return getattr(torch, tree["v"]) if t == "dtype" else torch.device(tree["v"])
    if t == "path":
        return _PATHS[tree["class"]](tree["v"])
    if t == "enum":
        value = unflatten(tree["value"], values)
        cls = live_class(tree["class"])
        members = cls.__members__ if isinstance(cls, type) and issubclass(cls, enum.Enum) else {}
        return members.get(tree["name"], value)
    fields = {k: unflatten(v, values) for k, v in zip(tree["keys"], tree["vals"], strict=True)}
    if t == "namespace":
        return argparse.Namespace(**fields)
    if t == "dataclass":
        return _dataclass(live_class(tree["class"]), fields)
    raise AssertionError(f"unvalidated tree node {t!r}")


# A concrete path of another system's flavour cannot be built here: it comes back as the pure one.
_PATHS: dict[str, type[pathlib.PurePath]] = {
    "PurePosixPath": pathlib.PurePosixPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
    "PosixPath": pathlib.PurePosixPath if os.name == "nt" else pathlib.PosixPath,
    "WindowsPath": pathlib.WindowsPath if os.name == "nt" else pathlib.PureWindowsPath,
}


def live_class(name: str) -> object:
    """The class ``module:qualname`` names if its module is already imported, else None.

    Nothing is imported and no attribute hook runs: only module and class dicts are read, so a
    forged name can at most pick an object this process already holds.
    """
    module, _, qualname = name.partition(":")
    found: object = sys.modules.get(module)
    for part in qualname.split("."):
        namespace = getattr(found, "__dict__", None) if found is not None else None
        found = namespace.get(part) if isinstance(namespace, Mapping) else None
    return found


def _dataclass(cls: object, fields: dict[str, Any]) -> Any:
    """An instance of dataclass ``cls`` holding ``fields``, built as pickle does (no __init__ or
    __post_init__ runs); the dict of fields if ``cls`` is not a dataclass with exactly these."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__new__ is object.__new__):
        return fields
    if [f.name for f in dataclasses.fields(cls)] != list(fields):
        return fields
    obj = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj


def view_of(base: Any, node: dict[str, Any]) -> Any:
    """The view a validated view node describes, into ``base`` (tensor or array), sharing its memory."""
    offset, shape, stride = node["offset"], node["shape"], node["stride"]
    if is_tensor(base):
        return base.as_strided(shape, stride, base.storage_offset() + offset)
    flat = base.reshape(-1)  # a view of a C-contiguous array (a copy otherwise: same values)
    itemsize = flat.dtype.itemsize
    return np.lib.stride_tricks.as_strided(flat[offset:], shape, [s * itemsize for s in stride])


def _torch_for(what: str) -> Any:
    """The torch module, or the error that says it is needed to read ``what``."""
    torch = loaded_torch()
    if torch is None:
        try:
            import torch
        except ImportError:
            raise UnsupportedStateError(
                f"this checkpoint holds {what}, which needs torch to read; install crashsafe[torch]"
            ) from None
    return torch


def apply_into(target: Any, saved: Any, parts: tuple[str | int, ...] = ()) -> Any:
    """Load ``saved`` into ``target`` in place where possible; return the value to keep.

    Modules/optimizers get ``load_state_dict``, tensors and arrays are copied into, dicts, lists and
    bytearrays are updated in place, tuples (namedtuples too) and enum members are rebuilt, and
    other immutable values are returned so the parent container can replace them. Run
    :func:`check_into` first: then only a Stateful's own ``load_state_dict`` (or a live value that
    refuses writes) can fail half-way, and the error says so.
    """
    where = format_path(parts)
    if is_stateful(target) and not isinstance(target, (dict, list)):
        _load_stateful(target, saved, where)
        return target
    if _is_array(target):
        _check_array(target, saved, where)
        return _copy_array(target, saved, where)
    if isinstance(target, enum.Enum):
        return _enum_member(target, saved, where)
    if isinstance(target, bytearray):
        _check_container(target, saved, parts)
        target[:] = saved
        return target
    if isinstance(target, MutableMapping):
        _check_container(target, saved, parts)
        for key in list(target.keys()):
            target[key] = apply_into(target[key], saved[key], (*parts, key))
        return target
    if isinstance(target, (MutableSequence, tuple)):
        _check_container(target, saved, parts)
        items = [apply_into(t, s, (*parts, i)) for i, (t, s) in enumerate(zip(target, saved, strict=True))]
        if isinstance(target, tuple):
            return _rebuild_tuple(target, items, where)
        target[:] = items
        return target
    return saved


def check_into(target: Any, saved: Any, parts: tuple[str | int, ...] = ()) -> None:
    """Raise what :func:`apply_into` would raise before changing anything, as far as it can know.

    Run first, so a mismatched checkpoint leaves the live state untouched. Stateful objects are
    judged by their own ``load_state_dict`` (QAT observers resize their buffers, lazy modules
    materialise their parameters); only what torch's default rules would refuse anyway is
    refused here first (:mod:`crashsafe.state.torch_fit`).
    """
    where = format_path(parts)
    if is_stateful(target) and not isinstance(target, (dict, list)):
        found = misfit(target, saved)
        if found is not None:
            key, reason = found
            raise UnsupportedStateError(
                f"state at '{format_path((*parts, key))}': {reason}. {type(target).__name__}.load_state_dict "
                "would refuse it after changing what came before; nothing was restored. Build it with the "
                "saved configuration, or load() the checkpoint to inspect it"
            )
        return
    if _is_array(target):
        _check_array(target, saved, where)
    elif isinstance(target, enum.Enum):
        _enum_member(target, saved, where)
    elif isinstance(target, bytearray):
        _check_container(target, saved, parts)
    elif isinstance(target, MutableMapping):
        _check_container(target, saved, parts)
        for key in target:
            check_into(target[key], saved[key], (*parts, key))
    elif isinstance(target, (MutableSequence, tuple)):
        _check_container(target, saved, parts)
        for i, (t, s) in enumerate(zip(target, saved, strict=True)):
            check_into(t, s, (*parts, i))


def _is_array(value: object) -> bool:
    return is_tensor(value) or isinstance(value, np.ndarray)


def _dtype_name(value: Any) -> str | None:
    """Manifest dtype name of a tensor, array or numpy scalar (byte order ignored), else None."""
    if is_tensor(value):
        return torch_dtype_name(value.dtype)
    if isinstance(value, (np.ndarray, np.generic)):
        return numpy_dtype_name(value.dtype)
    return None


def _check_array(target: Any, saved: Any, where: str) -> None:
    """Refuse a saved value that is not an array of the live array's shape and element type."""
    if not (_is_array(saved) or isinstance(saved, np.generic)):
        raise _mismatch(where, target, saved)
    if tuple(saved.shape) != tuple(target.shape):
        raise UnsupportedStateError(
            f"state at '{where}': checkpoint has shape {tuple(saved.shape)}, the live value "
            f"{tuple(target.shape)}; build it with the saved configuration before restoring"
        )
    saved_dtype, live_dtype = _dtype_name(saved), _dtype_name(target)
    if saved_dtype != live_dtype:
        raise UnsupportedStateError(
            f"state at '{where}': checkpoint has dtype {saved_dtype}, the live value "
            f"{live_dtype or target.dtype}; cast the live value to {saved_dtype}, or load() the "
            "checkpoint and convert it yourself"
        )
    if isinstance(target, np.ndarray) and not target.flags.writeable:
        raise UnsupportedStateError(
            f"state at '{where}': the live array is read-only; pass a writeable array to restore"
        )
    if is_tensor(target):
        _check_writable_tensor(target, where)


def _check_writable_tensor(target: Any, where: str) -> None:
    """Refuse, before anything changes, a live tensor restore cannot write into: one made under
    ``torch.inference_mode()``, or an expanded one (elements sharing memory)."""
    import torch

    if target.is_inference() and not torch.is_inference_mode_enabled():
        raise UnsupportedStateError(
            f"state at '{where}': the live tensor was made under torch.inference_mode(), so it cannot be "
            "written to; create it outside inference mode (or .clone() it there) before restoring"
        )
    if any(size > 1 and stride == 0 for size, stride in zip(target.shape, target.stride(), strict=True)):
        raise UnsupportedStateError(
            f"state at '{where}': the live tensor is expanded (its elements share memory), so the saved "
            "values cannot go into it; give it memory of its own (.clone()) before restoring"
        )


def _copy_array(target: Any, saved: Any, where: str) -> Any:
    """Copy ``saved`` (already checked: same shape and element type) into ``target``."""
    if saved is target:  # restore read it straight into place
        return target
    try:
        if is_tensor(target):
            import torch

            src = saved if is_tensor(saved) else torch.from_numpy(np.asarray(saved))  # 0-d stays 0-d
            with torch.no_grad():
                target.copy_(src)
        else:
            np.copyto(target, saved.numpy() if is_tensor(saved) else saved, casting="equiv")
    except (RuntimeError, ValueError, TypeError) as exc:  # e.g. an inference-mode or overlapping tensor
        raise _stopped(where, f"copying into the live {type(target).__name__} failed: {exc}") from exc
    return target


def _load_stateful(target: Any, saved: Any, where: str) -> None:
    torch = loaded_torch()
    if torch is not None and isinstance(target, torch.nn.Module) and isinstance(saved, dict):
        saved = _with_versions(target, saved)
    try:
        target.load_state_dict(saved)
    except Exception as exc:
        what = f"{type(target).__name__}.load_state_dict refused the checkpoint: {exc}"
        raise _stopped(where, what) from exc


def _with_versions(module: Any, saved: dict[str, Any]) -> OrderedDict[str, Any]:
    """``saved`` with the live submodules' state_dict versions, which a checkpoint does not store.

    Without them torch takes the state for one from before versioning and "upgrades" it (quantization
    observers reset their ``eps``, for one). The versions are the ones ``module.state_dict()`` records.
    """
    versioned = OrderedDict(saved)
    versions = {name: {"version": m._version} for name, m in module.named_modules(remove_duplicate=False)}
    setattr(versioned, "_metadata", versions)  # noqa: B010 - OrderedDict declares no such attribute
    return versioned


def _stopped(where: str, what: str) -> UnsupportedStateError:
    """A failure in the middle of restore: say what failed and what state the live objects are in."""
    return UnsupportedStateError(
        f"state at '{where}': {what.rstrip('. ')}. Restore stopped there: the values before it in the "
        "state (and whatever this one took before failing) hold the checkpoint's values, and so do the "
        "tensors and arrays restore read straight into place; the other values after it are unchanged. "
        "Restore into objects built with the saved configuration, or load() the checkpoint to inspect it"
    )


def _enum_member(target: enum.Enum, saved: Any, where: str) -> enum.Enum:
    """The member of the live value's enum that ``saved`` (its plain value) stands for."""
    try:
        return type(target)(saved)
    except Exception:
        raise UnsupportedStateError(
            f"state at '{where}': the checkpoint holds {str(saved)[:100]!r}, which is not a value of "
            f"the live enum {type(target).__qualname__}; restore into a state whose enum has that "
            "value, or load() the checkpoint to read it"
        ) from None


def _rebuild_tuple(target: tuple[Any, ...], items: list[Any], where: str) -> tuple[Any, ...]:
    """A tuple of the live value's type (namedtuple, torch.Size, ...) holding the restored items."""
    cls = type(target)
    if cls is tuple:
        return tuple(items)
    make = getattr(cls, "_make", None)  # namedtuples take their fields one by one
    try:
        return make(items) if callable(make) else cls(items)
    except Exception as exc:
        raise _stopped(where, f"rebuilding the live {cls.__qualname__} failed: {exc!r}") from exc


def _check_container(target: Any, saved: Any, parts: tuple[str | int, ...]) -> None:
    """Refuse a saved value that lacks a key of the live dict, a sequence of another length, or
    anything but bytes for a live bytearray."""
    where = format_path(parts)
    if isinstance(target, bytearray):
        if not isinstance(saved, bytes):
            raise _mismatch(where, target, saved)
    elif isinstance(target, MutableMapping):
        if not isinstance(saved, dict):
            raise _mismatch(where, target, saved)
        for key in target:
            if key not in saved:
                raise UnsupportedStateError(
                    f"state at '{format_path((*parts, key))}' is not in the checkpoint; remove it "
                    "from the state passed to restore(), or use load() to read what was saved"
                )
    elif not isinstance(saved, (list, tuple)) or len(saved) != len(target):
        raise _mismatch(where, target, saved)


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
