"""Property (docs/design.md, rule 10): for any generated state, either ``save`` refuses it at the call with
UnsupportedStateError, or the step commits and ``load`` returns the documented round-trip of the
input (docs/state.md), bitwise for arrays. Raw sync and async, zstd, and Incremental over two saves."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import pathlib
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import crashsafe as cs


class Phase(int, enum.Enum):
    TRAIN = 1


class Split(enum.StrEnum):
    TEST = "test"


class Rate(float, enum.Enum):
    FAST = 0.1


class Perm(enum.IntFlag):
    R = 4
    W = 2


class Color(enum.Enum):  # a plain enum: comes back as its member
    RED = (1, "r")
    NONE = None


@dataclasses.dataclass(frozen=True)
class Config:
    lr: float
    name: str
    dtype: torch.dtype


class Tied(tuple[torch.Tensor, torch.Tensor]):
    """(base, a view of base): stored once, must load back sharing memory."""

    kind: str


def tied(tensor: torch.Tensor, kind: str) -> Tied:
    base = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())
    flat = base.view(-1)
    views = {"same": base, "flat": flat, "tail": flat[1:], "t": base.t() if base.ndim <= 2 else base.mT}
    pair = Tied((base, views[kind]))
    pair.kind = kind
    return pair


Point = collections.namedtuple("Point", "x y")

NUMPY_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128"]  # fmt: skip
TORCH_DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
                torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
                torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
                torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]  # fmt: skip
MAX_DIGITS = sys.int_info.default_max_str_digits
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


def _raw(data: st.DataObject, n: int, bool_: bool) -> bytes:
    """``n`` arbitrary bytes: every bit pattern (NaN payloads, -0.0, subnormals); bools 0 or 1."""
    raw = data.draw(st.binary(min_size=n, max_size=n))
    return bytes(b & 1 for b in raw) if bool_ else raw


@st.composite
def numpy_arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = draw(SHAPES)
    raw = _raw(draw(st.data()), int(np.prod(shape)) * dtype.itemsize, dtype == np.bool_)
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if draw(st.booleans()):
        array = array.astype(dtype.newbyteorder(">"))  # same values, big-endian
    layout = draw(st.sampled_from(["c", "fortran", "reversed", "transposed"]))
    if layout == "fortran":
        return np.asfortranarray(array)
    if layout == "reversed" and array.ndim:
        return array[::-1]
    return array.T if layout == "transposed" else array


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(SHAPES)
    size = torch.empty((), dtype=dtype).element_size()
    raw = _raw(draw(st.data()), int(np.prod(shape)) * size, dtype == torch.bool)
    tensor = torch.tensor(list(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    view = draw(st.sampled_from(["plain", "transposed", "conj", "neg", "parameter"]))
    if view == "transposed":
        return tensor.t() if tensor.ndim <= 2 else tensor.transpose(0, 2)
    if view == "conj" and dtype.is_complex:
        return tensor.conj()  # conj bit set
    if view == "neg" and dtype.is_complex:
        return tensor.conj().imag  # neg bit set
    if view == "parameter":
        return torch.nn.Parameter(tensor, requires_grad=False)
    return tensor


def numpy_scalars() -> st.SearchStrategy[np.generic]:
    return numpy_arrays().map(lambda a: np.asarray(a).reshape(-1)[:1]).filter(len).map(lambda a: a[0])


surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts = st.text(st.one_of(st.characters(exclude_categories=()), surrogates), max_size=6)
huge_ints = st.builds(  # around the most decimal digits python reads back
    lambda digits, sign: sign * 10 ** (digits - 1),
    st.integers(MAX_DIGITS - 2, MAX_DIGITS + 2),
    st.sampled_from([1, -1]),
)
ALL_TORCH_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
DEVICES = [torch.device("cpu"), torch.device("cuda", 3), torch.device("meta"), torch.device("xla:1")]
framework_values = st.one_of(  # what Lightning and HF put into checkpoints
    st.sampled_from(ALL_TORCH_DTYPES),
    st.sampled_from(DEVICES),
    st.builds(pathlib.PurePosixPath, texts),
    st.builds(pathlib.PosixPath, texts.filter(lambda t: "\x00" not in t)),
    st.builds(pathlib.PureWindowsPath, texts),
    st.sampled_from(list(Color)),
    st.builds(Config, st.floats(), texts, st.sampled_from(ALL_TORCH_DTYPES)),
    st.dictionaries(st.sampled_from(["a", "b", "c.d"]), st.integers() | texts, max_size=3).map(
        lambda kv: argparse.Namespace(**kv)
    ),
    st.builds(tied, tensors(), st.sampled_from(["same", "flat", "tail", "t"])),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    huge_ints,
    st.sampled_from([Phase.TRAIN, Split.TEST, Rate.FAST, Perm.R | Perm.W]),
    st.floats(),  # NaN (with payloads), inf, -0.0
    texts,
    texts.map(np.str_),
    st.binary(max_size=8),
    st.binary(max_size=8).map(bytearray),
    numpy_arrays(),
    numpy_scalars(),
    tensors(),
    framework_values,
)
# Small key sets so that dotted paths collide ("a.b" vs a/b, 0 vs "0") and keys hold dots/surrogates.
keys = st.sampled_from(["a", "b", "a.b", "", "0", 0, 1, Phase.TRAIN, Split.TEST, "\ud800"])


def _containers(kids: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.builds(Point, kids, kids),
        st.dictionaries(keys, kids, max_size=3),
        st.dictionaries(keys, kids, max_size=3).map(collections.OrderedDict),
    )


states = st.dictionaries(keys, st.recursive(leaves, _containers, max_leaves=8), max_size=4)


# ------------------------------------------------------------------ the documented round-trip


class Refused(Exception):
    """The documented behaviour is a refusal at save."""


def documented(state: Mapping[Any, Any]) -> dict[Any, Any]:
    """What ``load()`` returns for ``state`` per docs/state.md; Refused where save must refuse."""
    owners: dict[str, tuple[Any, ...]] = {}
    result: dict[Any, Any] = _expect(state, (), owners)
    return result


def _expect(value: Any, parts: tuple[Any, ...], owners: dict[str, tuple[Any, ...]]) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, np.generic) and not isinstance(value, np.str_):
        _own(parts, owners)
        return np.asarray(value).astype(value.dtype.newbyteorder("="))[()]
    if isinstance(value, int):
        if abs(int(value)) >= 10**MAX_DIGITS:
            raise Refused
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (torch.dtype, torch.device, pathlib.PurePath)):
        return value
    if isinstance(value, Color):
        _expect(value.value, parts, owners)
        return value
    if isinstance(value, argparse.Namespace):
        return argparse.Namespace(**{k: _expect(v, (*parts, k), owners) for k, v in vars(value).items()})
    if isinstance(value, Config):
        fields = {
            f.name: _expect(getattr(value, f.name), (*parts, f.name), owners)
            for f in dataclasses.fields(value)
        }
        return Config(**fields)
    if isinstance(value, str):
        return "".join(value)  # a plain str
    if isinstance(value, (bytes, bytearray)):
        _own(parts, owners)
        return bytes(value)
    if isinstance(value, torch.Tensor):
        _own(parts, owners)
        return torch.empty(value.shape, dtype=value.dtype).copy_(value.detach())
    if isinstance(value, np.ndarray):
        _own(parts, owners)
        return np.array(value, dtype=value.dtype.newbyteorder("="), order="C")
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            plain = int(key) if isinstance(key, int) else "".join(key)
            out[plain] = _expect(item, (*parts, plain), owners)
        return out
    items = [_expect(v, (*parts, i), owners) for i, v in enumerate(value)]
    return items if isinstance(value, list) else tuple(items)


def _own(parts: tuple[Any, ...], owners: dict[str, tuple[Any, ...]]) -> None:
    """Arrays are stored under their dotted path: two arrays on one path are refused."""
    if owners.setdefault(".".join(map(str, parts)), parts) != parts:
        raise Refused


def same(expected: Any, got: Any) -> bool:
    """Equal in value and exact type; arrays and tensors bit for bit; NaN equals NaN."""
    if type(got) is not type(expected):
        return False
    if isinstance(expected, np.ndarray | np.generic):
        return bool(expected.dtype == got.dtype and expected.shape == got.shape) and (
            expected.tobytes() == got.tobytes()
        )
    if isinstance(expected, torch.Tensor):
        return expected.dtype == got.dtype and expected.shape == got.shape and _bits(expected) == _bits(got)
    if isinstance(expected, float):
        return expected.hex() == got.hex() or (expected != expected and got != got)
    if isinstance(expected, argparse.Namespace):
        return same(vars(expected), vars(got))
    if isinstance(expected, Config):
        return all(same(getattr(expected, f.name), getattr(got, f.name)) for f in dataclasses.fields(Config))
    if isinstance(expected, dict):
        return [(type(k), k) for k in expected] == [(type(k), k) for k in got] and all(
            same(expected[k], got[k]) for k in expected
        )
    if isinstance(expected, list | tuple):
        return len(expected) == len(got) and all(map(same, expected, got))
    return bool(expected == got)


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def perturbed(value: Any) -> Any:
    """The same structure with every array's bits changed: a second save for delta codecs."""
    if isinstance(value, Tied):
        return tied(perturbed(value[0]), value.kind)
    if isinstance(value, torch.Tensor):
        plain = torch.empty(value.shape, dtype=value.dtype).copy_(value.detach())
        if plain.dtype == torch.bool:
            return ~plain
        if plain.numel():
            plain.reshape(-1).view(torch.uint8).bitwise_xor_(0x5A)
        return plain
    if isinstance(value, np.ndarray):
        plain = np.array(value, order="C")
        if plain.dtype == np.bool_:
            return ~plain
        plain.reshape(-1).view(np.uint8)[...] ^= 0x5A
        return plain
    if isinstance(value, Mapping):
        return {k: perturbed(v) for k, v in value.items()}
    if isinstance(value, list | tuple) and not isinstance(value, Point):
        return type(value)(perturbed(v) for v in value)
    return value


# ------------------------------------------------------------------ the properties


def _save_and_compare(directory: Path, saves: list[Mapping[Any, Any]], **manager: Any) -> None:
    try:
        expected = [documented(state) for state in saves]
    except Refused:
        event("refused at save")
        with cs.CheckpointManager(directory, **manager) as mgr:
            with pytest.raises(cs.UnsupportedStateError):
                mgr.save(0, saves[0])
            assert mgr.steps() == []
        return
    event("committed and loaded back")
    with cs.CheckpointManager(directory, **manager) as mgr:
        for step, state in enumerate(saves):
            mgr.save(step, state)
        for step, want in enumerate(expected):
            got = mgr.load(step)
            assert same(want, got), (want, got)
            _assert_still_tied(saves[step], got)


def _assert_still_tied(saved: Any, got: Any) -> None:
    """Every Tied pair of the saved state loads back as two tensors sharing one storage."""
    if isinstance(saved, Tied):
        if saved[1].numel():  # an empty view has no memory to share
            assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()
    elif isinstance(saved, Mapping):
        for key, value in saved.items():
            _assert_still_tied(value, got[key if type(key) in (int, str) else _plain(key)])
    elif isinstance(saved, (list, tuple)):
        for s, g in zip(saved, got, strict=True):
            _assert_still_tied(s, g)


def _plain(key: Any) -> Any:
    return int(key) if isinstance(key, int) else "".join(key)


PROPERTY = settings(max_examples=40, deadline=None)
MANAGERS: dict[str, Callable[[], dict[str, Any]]] = {
    "raw-async": lambda: {"async_save": True},
    "raw-sync": lambda: {"async_save": False},
    "zstd": lambda: {"codec": "zstd"},
}


@pytest.mark.parametrize("manager", sorted(MANAGERS))
@PROPERTY
@given(state=states)
def test_save_refuses_or_load_returns_the_documented_value(
    tmp_path_factory: pytest.TempPathFactory, manager: str, state: dict[Any, Any]
) -> None:
    _save_and_compare(tmp_path_factory.mktemp("prop"), [state], **MANAGERS[manager]())


@PROPERTY
@given(state=states)
def test_incremental_two_saves_load_back_exactly(
    tmp_path_factory: pytest.TempPathFactory, state: dict[Any, Any]
) -> None:
    directory = tmp_path_factory.mktemp("prop")
    _save_and_compare(directory, [state, perturbed(state)], codec=cs.codecs.Incremental())
