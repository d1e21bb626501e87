"""What torch's own loaders would refuse, found before ``restore`` changes anything.

``Module.load_state_dict`` copies every parameter that fits before it reports the ones that do
not, so a checkpoint of another architecture would leave a model half restored. Where torch's
default rules apply unchanged, they are checked first: the shapes of the parameters and persistent
buffers of modules that use the default loader, and (when no module has a loader, hook or extra
state of its own) missing and unexpected keys. Modules with their own loaders or hooks (QAT
observers, lazy modules, FSDP) decide for themselves. For optimizers, the parameter-group sizes
that ``Optimizer.load_state_dict`` checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from crashsafe._torch import loaded_torch

__all__ = ["misfit"]


def misfit(target: Any, saved: Any) -> tuple[str, str] | None:
    """(key, reason) for the first thing in ``saved`` that torch would refuse for ``target``, or
    None when it fits or only ``target``'s own loader can tell."""
    torch = loaded_torch()
    if torch is None or not isinstance(saved, Mapping):
        return None
    if isinstance(target, torch.nn.Module):
        return _module_misfit(torch, target, saved)
    if isinstance(target, torch.optim.Optimizer):
        return _optimizer_misfit(target, saved)
    return None


def _module_misfit(torch: Any, module: Any, saved: Mapping[Any, Any]) -> tuple[str, str] | None:
    base = torch.nn.Module
    modules = list(module.named_modules(remove_duplicate=False))
    if any(m._load_state_dict_pre_hooks for _, m in modules):
        return None  # a pre-hook may rewrite what is loaded
    own_rules = False
    expected: set[str] = set()
    for prefix, m in modules:
        cls = type(m)
        if cls._load_from_state_dict is not base._load_from_state_dict:
            own_rules = True
            continue
        own_rules |= bool(m._load_state_dict_post_hooks) or cls.set_extra_state is not base.set_extra_state
        buffers = {k: v for k, v in m._buffers.items() if k not in m._non_persistent_buffers_set}
        for name, live in {**m._parameters, **buffers}.items():
            if live is None:
                continue
            key = f"{prefix}.{name}" if prefix else name
            expected.add(key)
            if key in saved and not torch.nn.parameter.is_lazy(live):
                reason = _tensor_misfit(torch, live, saved[key])
                if reason is not None:
                    return key, reason
    if own_rules:
        return None
    missing = sorted(expected.difference(saved))
    if missing:
        return missing[0], f"the live {type(module).__name__} has it, the checkpoint does not"
    unexpected = sorted(str(k) for k in saved if k not in expected)
    if unexpected:
        return unexpected[0], f"the checkpoint has it, the live {type(module).__name__} does not"
    return None


def _tensor_misfit(torch: Any, live: Any, value: Any) -> str | None:
    """torch's default rule for one parameter: a tensor of the same shape (a 1-element 1-d value
    also fills a 0-d parameter); the dtype may differ (it is cast)."""
    if not isinstance(value, torch.Tensor):
        return f"checkpoint holds a {type(value).__name__}, not a tensor"
    shape, live_shape = tuple(value.shape), tuple(live.shape)
    if shape != live_shape and not (live_shape == () and shape == (1,)):
        return f"checkpoint has shape {shape}, the live module {live_shape}"
    return None


def _optimizer_misfit(optimizer: Any, saved: Mapping[Any, Any]) -> tuple[str, str] | None:
    groups = saved.get("param_groups")
    if not isinstance(groups, (list, tuple)) or len(groups) != len(optimizer.param_groups):
        count = len(groups) if isinstance(groups, (list, tuple)) else "no"
        return (
            "param_groups",
            f"checkpoint has {count} groups, the live optimizer {len(optimizer.param_groups)}",
        )
    for i, (group, live) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        params = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(params, (list, tuple)) or len(params) != len(live["params"]):
            return f"param_groups.{i}", (
                f"checkpoint's group has {len(params) if isinstance(params, (list, tuple)) else 'no'} "
                f"parameters, the live optimizer's {len(live['params'])}"
            )
    return None
