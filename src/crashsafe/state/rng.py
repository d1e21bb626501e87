"""A Stateful for the process's random number generators: python, numpy and torch (CPU + CUDA).

Put ``cs.RNGState()`` in the saved state for bit-exact resume of anything random (dropout, data
augmentation, sampling).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from crashsafe._torch import loaded_torch
from crashsafe.errors import UnsupportedStateError

__all__ = ["RNGState"]


class RNGState:
    """Saves and restores python's ``random``, numpy's global RNG and torch's RNGs."""

    def __init__(self, *, python: bool = True, numpy: bool = True, torch: bool = True) -> None:
        self.python = python
        self.numpy = numpy
        self.torch = torch

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.python:
            version, internal, gauss = random.getstate()
            state["python"] = {
                "version": version,
                "internal": np.array(internal, dtype=np.uint32),
                "gauss_next": gauss,
            }
        if self.numpy:
            state["numpy"] = np.random.get_state(legacy=False)
        torch = loaded_torch()
        if self.torch and torch is not None:
            state["torch"] = torch.get_rng_state()
            if torch.cuda.is_available():
                state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise UnsupportedStateError("RNGState expects the dict its state_dict() produced")
        if self.python and "python" in state_dict:
            py = state_dict["python"]
            internal = tuple(int(x) for x in np.asarray(py["internal"]).tolist())
            random.setstate((int(py["version"]), internal, py["gauss_next"]))
        if self.numpy and "numpy" in state_dict:
            np_state = dict(state_dict["numpy"])
            np_state["state"] = dict(np_state["state"])
            np_state["state"]["key"] = np.asarray(np_state["state"]["key"], dtype=np.uint32)
            np.random.set_state(np_state)
        torch = loaded_torch()
        if self.torch and torch is not None and "torch" in state_dict:
            torch.set_rng_state(_as_byte_tensor(torch, state_dict["torch"]))
            if "torch_cuda" in state_dict and torch.cuda.is_available():
                torch.cuda.set_rng_state_all([_as_byte_tensor(torch, s) for s in state_dict["torch_cuda"]])


def _as_byte_tensor(torch: Any, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(torch.uint8)
    return torch.from_numpy(np.asarray(value, dtype=np.uint8).copy())
