"""Server-side optimizers (SGD, Adagrad, Adam) applied to the touched rows of a shard.

Only correctly rounded IEEE operations (+, -, *, /, sqrt) are used, so applying the same
gradients to the same rows gives bit-identical results however the rows are batched; that is
what lets a rebuilt server replay updates and match a failure-free run exactly. Adam keeps its
bias-correction powers per element (``b1p``, ``b2p``) instead of computing ``beta ** t``.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["DEFAULT_LR", "STATE_NAMES", "init_state", "step"]

F32 = NDArray[np.float32]
STATE_NAMES: dict[str, tuple[str, ...]] = {"sgd": (), "adagrad": ("acc",), "adam": ("m", "v", "b1p", "b2p")}
DEFAULT_LR = {"sgd": 0.5, "adagrad": 0.1, "adam": 0.01}
_B1, _B2, _EPS = np.float32(0.9), np.float32(0.999), np.float32(1e-8)
_ONE = np.float32(1.0)


def init_state(optimizer: str, shape: tuple[int, ...]) -> dict[str, F32]:
    """Fresh optimizer state for a table slab of ``shape``."""
    return {
        name: (np.ones if name.endswith("p") else np.zeros)(shape, dtype=np.float32)
        for name in STATE_NAMES[optimizer]
    }


def step(
    optimizer: str, lr: float, values: F32, state: dict[str, F32], rows: NDArray[np.int64], grad: F32
) -> None:
    """Apply one update with gradient ``grad`` to ``values[rows]`` (and the state rows) in place."""
    rate = np.float32(lr)
    if optimizer == "sgd":
        values[rows] -= rate * grad
    elif optimizer == "adagrad":
        acc = state["acc"][rows] + grad * grad
        state["acc"][rows] = acc
        values[rows] -= rate * grad / (np.sqrt(acc) + _EPS)
    else:
        b1p = state["b1p"][rows] * _B1
        b2p = state["b2p"][rows] * _B2
        m = _B1 * state["m"][rows] + (_ONE - _B1) * grad
        v = _B2 * state["v"][rows] + (_ONE - _B2) * (grad * grad)
        state["b1p"][rows], state["b2p"][rows], state["m"][rows], state["v"][rows] = b1p, b2p, m, v
        values[rows] -= rate * (m / (_ONE - b1p)) / (np.sqrt(v / (_ONE - b2p)) + _EPS)
