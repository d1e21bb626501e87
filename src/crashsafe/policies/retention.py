"""The retention a manager applies: ``keep=`` as given, or the ``keep_last``/``keep_every`` shorthands."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Final

from crashsafe.policies.errors import PolicyError
from crashsafe.policies.keep import KeepEvery, KeepLast, KeepPolicy, KeepUnion

__all__ = ["UNSET", "KeepSpec", "Unset", "retention_policy"]

KeepSpec = KeepPolicy | Sequence[KeepPolicy] | None


class Unset(enum.Enum):
    """The default of ``keep_last``: not given (then it is the manager's default unless ``keep=``)."""

    UNSET = "unset"

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = Unset.UNSET


def retention_policy(
    keep: KeepSpec,
    keep_last: int | Unset | None,
    keep_every: int | None,
    prefix: str = "",
    *,
    default_last: int | None = None,
) -> KeepPolicy | None:
    """The policy ``keep`` (a list is the union), or ``KeepLast(keep_last) | KeepEvery(keep_every)``
    with ``keep_last`` defaulting to ``default_last``; None keeps every step. ``prefix`` names the
    arguments in errors (``"mirror_"``)."""
    if keep is not None:
        if keep_last is not UNSET or keep_every is not None:
            raise PolicyError(
                f"pass either {prefix}keep= or {prefix}keep_last/{prefix}keep_every, not both: "
                f"{prefix}keep=KeepLast(3) | KeepEvery(1000) says what the shorthands say"
            )
        if isinstance(keep, KeepPolicy):
            return keep
        if not isinstance(keep, (list, tuple)) or not keep:
            raise PolicyError(
                f"{prefix}keep= takes a keep policy or a non-empty list of them (their union), got {keep!r}"
            )
        return KeepUnion(*keep)
    last = default_last if keep_last is UNSET else keep_last
    for name, value in (("keep_last", last), ("keep_every", keep_every)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PolicyError(f"{prefix}{name} must be None or an int >= 1, got {value!r}")
    if last is None:
        return None
    return KeepLast(last) if keep_every is None else KeepLast(last) | KeepEvery(keep_every)
