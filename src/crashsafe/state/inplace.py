"""Where restore can put a payload straight into the live state: the memory of its tensors and arrays.

A payload is read (or decoded) into a live tensor or array only where nothing between the
checkpoint and that memory could change what ends up there, so the result is exactly what
``apply_into`` would have copied: a plain CPU or CUDA tensor or a numpy array at the same place in
the state, of the saved element type and shape, C-contiguous, writable, overlapping no other
destination (a CUDA tensor takes a payload saved whole, through pinned bounce buffers);
inside a module only if every loader of its submodules is torch's own (no hooks, no overrides but
the normalisation layers' key upgrades) and inside an optimizer only if it has no load hooks. A
live DTensor takes the saved shards of its array into the memory of its local tensor, its *box* in
the global tensor (a checkpoint of N ranks restored by M). Every other payload is read into fresh
memory and copied in, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crashsafe._cuda import is_cuda
from crashsafe._torch import is_tensor, loaded_torch
from crashsafe.errors import CrashsafeError
from crashsafe.format.dtypes import storage_dtype, torch_dtype_name
from crashsafe.format.manifest import PayloadEntry
from crashsafe.state.tree import is_dtensor, is_stateful, local_shard

__all__ = ["Box", "Destination", "live_destinations"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) of a part of a global tensor

_MODULE_METHODS = (
    "_load_from_state_dict",
    "state_dict",
    "load_state_dict",
    "set_extra_state",
    "get_extra_state",
)
_MODULE_HOOKS = ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_state_dict_hooks",
                 "_state_dict_pre_hooks")  # fmt: skip
_FSDP2_HOOKS = {  # (module, qualified name) of FSDP2's state-dict hooks in torch 2.13
    # before saving and loading: put the sharded parameters in place of unsharded ones
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group",
     "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"),
    # after loading: re-pad the shard buffer of the parameter object the module now holds
    ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam.__init__.<locals>.<lambda>"),
}  # fmt: skip
_OPTIMIZER_HOOKS = ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
                    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks")  # fmt: skip


@dataclass(frozen=True)
class Destination:
    """A live tensor or array a payload goes into: ``value`` stands for the saved value in the state
    restore rebuilds (it *is* the live object), ``out`` is its memory in the payload's storage dtype;
    for a live DTensor, ``box`` is where ``out`` (its local tensor) sits in the global tensor. A
    CUDA tensor's memory is ``device`` instead (flat uint8), and ``out`` is an empty placeholder."""

    value: Any
    out: np.ndarray[Any, Any]
    box: Box | None = None
    device: Any = None


def live_destinations(
    state: Any, tree: dict[str, Any], payloads: Sequence[PayloadEntry]
) -> dict[int, Destination]:
    """payload id -> the live tensor or array that payload can be read straight into, for the array
    nodes of a validated ``tree`` whose place in the live ``state`` holds one (see the module doc)."""
    found: dict[int, Destination] = {}
    _walk(state, tree, payloads, found)
    return _without_overlaps(found)


def _walk(
    live: Any, node: dict[str, Any], payloads: Sequence[PayloadEntry], found: dict[int, Destination]
) -> None:
    t = node["t"]
    if t == "array":
        destination = _destination(live, payloads[node["id"]])
        if destination is not None:
            found[node["id"]] = destination
    elif t == "dict" and isinstance(live, Mapping) and not _is_object(live):
        for key, child in zip(node["keys"], node["vals"], strict=True):
            if key in live:
                _walk(live[key], child, payloads, found)
    elif t in ("list", "tuple") and isinstance(live, (list, tuple)) and len(live) == len(node["items"]):
        for item, child in zip(live, node["items"], strict=True):
            _walk(item, child, payloads, found)
    elif t == "stateful" and _is_object(live) and _plain_loader(live):
        try:
            inner = live.state_dict()
        except Exception:
            return  # restore reports it, as before
        _walk(inner, node["value"], payloads, found)


def _is_object(value: Any) -> bool:
    return is_stateful(value) and not isinstance(value, (dict, list))


def _destination(live: Any, entry: PayloadEntry) -> Destination | None:
    """Where the payload can go in ``live``, or None if it cannot go straight into it. A shard goes
    into the part of the live tensor its box meets (the whole tensor, or a live DTensor's box)."""
    if entry.raw_nbytes == 0:
        return None
    whole = entry.shape if entry.shard is None else entry.shard[0]
    if is_dtensor(live):
        if entry.kind != "torch" or tuple(live.shape) != whole:
            return None
        try:
            local, shard = local_shard(live.detach(), ())
        except CrashsafeError:  # a Partial placement: it loads its own way
            return None
        out = _memory_of(local, entry.kind, entry.dtype, tuple(local.shape))
        return None if out is None else Destination(live, out, (shard.offset, tuple(local.shape)))
    if is_cuda(live):
        device = _device_memory(live, entry, whole)
        return None if device is None else Destination(live, np.empty(0, np.uint8), None, device)
    out = _memory_of(live, entry.kind, entry.dtype, whole)
    if out is None:
        return None
    return Destination(live, out, None if entry.shard is None else ((0,) * len(whole), whole))


def _memory_of(live: Any, kind: str, dtype_name: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any] | None:
    """The live tensor's or array's memory as an array of the given storage dtype and shape, or
    None if it is not plain, writable, C-contiguous CPU memory of exactly that type."""
    dtype = storage_dtype(dtype_name)
    if is_tensor(live):
        torch = loaded_torch()
        assert torch is not None
        if type(live) not in (torch.Tensor, torch.nn.Parameter) or kind != "torch":
            return None  # a subclass (uninitialized, quantized ...) loads its own way
        if (
            live.device.type != "cpu"
            or live.layout != torch.strided
            or not live.is_contiguous()
            or live.is_inference()
            or live.is_conj()
            or live.is_neg()
            or torch_dtype_name(live.dtype) != dtype_name
            or tuple(live.shape) != shape
        ):
            return None
        raw: np.ndarray[Any, Any] = live.detach().reshape(-1).view(torch.uint8).numpy()
        return raw.view(dtype).reshape(shape)
    if type(live) is np.ndarray and kind == "numpy":
        fits = live.dtype == dtype and live.shape == shape
        if fits and live.flags.c_contiguous and live.flags.writeable:
            return live
    return None


def _device_memory(live: Any, entry: PayloadEntry, shape: tuple[int, ...]) -> Any:
    """A live CUDA tensor's memory as a flat uint8 tensor, for a payload saved whole, or None if it is
    not a plain, contiguous tensor of exactly the payload's type (as :func:`_memory_of` asks)."""
    torch = loaded_torch()
    assert torch is not None
    if (
        type(live) not in (torch.Tensor, torch.nn.Parameter)
        or entry.kind != "torch"
        or entry.shard is not None
        or live.layout != torch.strided
        or not live.is_contiguous()
        or live.is_inference()
        or live.is_conj()
        or live.is_neg()
        or torch_dtype_name(live.dtype) != entry.dtype
        or tuple(live.shape) != shape
    ):
        return None
    return live.detach().reshape(-1).view(torch.uint8)


def _span(d: Destination) -> tuple[str, int, int]:
    """(memory space, start, end) of a destination's memory."""
    if d.device is not None:
        start = d.device.data_ptr()
        return str(d.device.device), start, start + d.device.numel()
    return "cpu", d.out.ctypes.data, d.out.ctypes.data + d.out.nbytes


def _without_overlaps(found: dict[int, Destination]) -> dict[int, Destination]:
    """Drop destinations whose memory overlaps another's (two places of the state sharing memory
    that the checkpoint holds apart): those are copied in order, as before."""
    spans = sorted((*_span(d), i) for i, d in found.items())
    clash: set[int] = set()
    space, reach, widest = "", -1, -1  # the memory space, the furthest end so far in it, and whose
    for where, start, end, i in spans:
        if where != space:
            space, reach, widest = where, -1, -1
        if start < reach:  # overlaps the widest span before it (and any other it meets was marked)
            clash |= {i, widest}
        if end > reach:
            reach, widest = end, i
    return {i: d for i, d in found.items() if i not in clash}


def _plain_loader(obj: Any) -> bool:
    """Whether ``obj`` is a module or optimizer that loads its state with torch's own code, so
    values already in its tensors' memory are loaded exactly as if they came from fresh memory."""
    torch = loaded_torch()
    if torch is None:
        return False
    if isinstance(obj, torch.nn.Module):
        norm = torch.nn.modules.batchnorm._NormBase  # overrides only to upgrade old keys
        base = torch.nn.Module
        for _, module in obj.named_modules(remove_duplicate=False):
            cls = type(module)
            own = [m for m in _MODULE_METHODS if getattr(cls, m) is not getattr(base, m)]
            if own and not (
                own == ["_load_from_state_dict"] and cls._load_from_state_dict is norm._load_from_state_dict
            ):
                return False
            hooks = [hook for name in _MODULE_HOOKS for hook in getattr(module, name, {}).values()]
            if not all(map(_harmless, hooks)):
                return False
        return True
    if isinstance(obj, torch.optim.Optimizer):
        cls, base_optimizer = type(obj), torch.optim.Optimizer
        if (
            cls.load_state_dict is not base_optimizer.load_state_dict
            or cls.state_dict is not base_optimizer.state_dict
        ):
            return False
        return not any(getattr(obj, hooks, None) for hooks in _OPTIMIZER_HOOKS)
    return False


def _harmless(hook: Any) -> bool:
    """A hook that reads only which parameter objects a module has, never their values: FSDP2's."""
    return (getattr(hook, "__module__", None), getattr(hook, "__qualname__", None)) in _FSDP2_HOOKS
