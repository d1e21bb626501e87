"""Access to torch only when the user already imported it: crashsafe never imports torch itself
for numpy-only states, which keeps `import crashsafe` light."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_tensor", "loaded_torch"]


def loaded_torch() -> Any | None:
    """The torch module if it is imported in this process, else None."""
    return sys.modules.get("torch")


def is_tensor(value: object) -> bool:
    """True for a ``torch.Tensor`` (without importing torch)."""
    torch = loaded_torch()
    return torch is not None and isinstance(value, torch.Tensor)
