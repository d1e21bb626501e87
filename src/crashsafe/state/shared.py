"""Find the tensors of a state that look into another saved tensor's memory (tied weights, views).

Each such tensor is stored as a view of that tensor (its *anchor*: contiguous, of the same dtype and
device, holding every element of the view), so it is written once and comes back sharing memory.
Tensors overlap only if they share a storage, so one sort by address finds them all; what does not
fit that shape (another dtype, a conj/neg bit, no contiguous tensor covering the rest) is stored on
its own, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["View", "find_views"]


@dataclass(frozen=True)
class View:
    """Tensor ``i`` is ``anchor.as_strided(shape, stride, offset)`` (elements, relative to the anchor)."""

    anchor: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def find_views(tensors: Sequence[Any]) -> dict[int, View]:
    """For ``tensors`` (None where a leaf is not a plain tensor), the ones that are views of another."""
    spans = []  # (start, end, index): byte addresses [start, end) of each tensor's elements
    for i, t in enumerate(tensors):
        if t is not None and t.nbytes:
            start = t.data_ptr()
            spans.append((start, start + t.nbytes if t.is_contiguous() else _strided_end(t, start), i))
    spans.sort()
    views: dict[int, View] = {}
    group: list[tuple[int, int, int]] = []
    end = 0
    for span in spans:
        if group and span[0] >= end:
            views.update(_overlapping(group, tensors))
            group = []
        end = max(end, span[1]) if group else span[1]
        group.append(span)
    views.update(_overlapping(group, tensors))
    return views


def _strided_end(tensor: Any, start: int) -> int:
    last: int = sum((d - 1) * s for d, s in zip(tensor.shape, tensor.stride(), strict=True))
    return start + (last + 1) * int(tensor.element_size())


def _overlapping(group: list[tuple[int, int, int]], tensors: Sequence[Any]) -> dict[int, View]:
    """Views among tensors whose memory overlaps (so one storage, unless two devices reuse an address)."""
    views: dict[int, View] = {}
    if len(group) > 1:
        for device in {tensors[i].device for _, _, i in group}:
            views.update(_group_views([s for s in group if tensors[s[2]].device == device], tensors))
    return views


def _group_views(group: list[tuple[int, int, int]], tensors: Sequence[Any]) -> dict[int, View]:
    """Within tensors that overlap in memory on one device: the largest contiguous one is the anchor,
    and every other one that lies inside it, with its dtype, becomes a view of it."""
    anchors = [s for s in group if _plain(tensors[s[2]]) and tensors[s[2]].is_contiguous()]
    if len(group) < 2 or not anchors:
        return {}
    start, end, index = max(anchors, key=lambda s: (tensors[s[2]].numel(), -s[2]))
    anchor = tensors[index]
    views = {}
    for s_start, s_end, i in group:
        t = tensors[i]
        inside = start <= s_start and s_end <= end and (s_start - start) % anchor.element_size() == 0
        if i == index or not inside or t.dtype != anchor.dtype or not _plain(t) or t.numel() > anchor.numel():
            continue
        offset = (s_start - start) // anchor.element_size()
        views[i] = View(index, offset, tuple(t.shape), tuple(t.stride()))
    return views


def _plain(tensor: Any) -> bool:
    """Its elements are the bytes in memory (no lazy conj/neg bit)."""
    return not (tensor.is_conj() or tensor.is_neg())
