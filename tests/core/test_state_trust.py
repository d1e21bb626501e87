"""Issue 12, the state side: what save accepts loads back, what it cannot give back is refused at
save, and restore accepts what the objects' own load_state_dict accepts (real models, real files)."""

from __future__ import annotations

import collections
import enum
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import crashsafe as cs

SAVE_MODES = [pytest.param(True, id="async"), pytest.param(False, id="sync")]


class Phase(int, enum.Enum):
    TRAIN = 1
    EVAL = 2


class Split(enum.StrEnum):
    TRAIN = "train"
    TEST = "test"


class Rate(float, enum.Enum):
    FAST = 0.1


class Perm(enum.IntFlag):
    R = 4
    W = 2


def _manager(directory: Path, async_save: bool, **kwargs: Any) -> cs.CheckpointManager:
    return cs.CheckpointManager(directory, async_save=async_save, **kwargs)


def _bits(tensor: torch.Tensor) -> bytes:
    """The bytes of a tensor's values, C order (conj/neg/zero views materialised)."""
    plain = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())
    return plain.reshape(-1).view(torch.uint8).numpy().tobytes() if plain.numel() else b""


# ---------------------------------------------------- 1. colliding dotted paths


@pytest.mark.parametrize("async_save", SAVE_MODES)
@pytest.mark.parametrize("codec", [None, cs.codecs.Incremental()], ids=["raw", "incremental"])
@pytest.mark.parametrize(
    ("state", "first", "second", "path"),
    [
        (
            {"a.b": torch.ones(4), "a": {"b": torch.zeros(4)}},
            "state['a.b']",
            "state['a']['b']",
            "a.b",
        ),
        ({"opt": {0: np.ones(3), "0": np.zeros(3)}}, "state['opt'][0]", "state['opt']['0']", "opt.0"),
        ({"opt": [b"x"], "opt.0": b"y"}, "state['opt'][0]", "state['opt.0']", "opt.0"),
    ],
)
def test_arrays_with_the_same_dotted_path_are_refused_at_save(
    tmp_path: Path, async_save: bool, codec: Any, state: Any, first: str, second: str, path: str
) -> None:
    with _manager(tmp_path, async_save, codec=codec) as mgr:
        with pytest.raises(cs.UnsupportedStateError) as caught:
            mgr.save(1, state)
        message = str(caught.value)
        assert f"{first} and {second}" in message and f"'{path}'" in message
        assert "Rename one of the keys" in message
        assert mgr.steps() == []


def test_colliding_paths_inside_a_module_state_dict_are_refused(tmp_path: Path) -> None:
    """A model's own dotted keys meet a user key that flattens to the same path."""
    model = torch.nn.Linear(2, 2)
    both = r"state\['m'\]\['weight'\] and state\['m.weight'\]"
    with cs.CheckpointManager(tmp_path) as mgr, pytest.raises(cs.UnsupportedStateError, match=both):
        mgr.save(1, {"m": model, "m.weight": torch.zeros(2, 2)})


@pytest.mark.parametrize("async_save", SAVE_MODES)
def test_same_dotted_path_for_scalars_and_model_keys_round_trips(tmp_path: Path, async_save: bool) -> None:
    """Only array payloads are named by path: scalars with equal dotted paths keep their own keys."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    state = {"a.b": 1, "a": {"b": 2}, 0: "int key", "0": "str key", "model": model}
    with _manager(tmp_path, async_save) as mgr:
        mgr.save(1, state)
        loaded = mgr.load()
    assert loaded["a.b"] == 1 and loaded["a"] == {"b": 2}
    assert loaded[0] == "int key" and loaded["0"] == "str key"
    assert torch.equal(loaded["model"]["0.weight"], model[0].weight.detach())
    assert mgr.manifest().payloads[0].path == "model.0.weight"


# ---------------------------------------------------- 2. every value save accepts loads


@pytest.mark.parametrize("async_save", SAVE_MODES)
def test_enum_and_scalar_subclasses_load_as_plain_values(tmp_path: Path, async_save: bool) -> None:
    state = {
        "phase": Phase.TRAIN,
        "split": Split.TEST,
        "rate": Rate.FAST,
        "perm": Perm.R | Perm.W,
        "by_phase": {Phase.EVAL: "e", Split.TRAIN: "t"},
        "f64": np.float64(0.1),
        "i32": np.int32(-7),
        "np_str": np.str_("héllo"),
        "np_bytes": np.bytes_(b"\x00raw"),
    }
    with _manager(tmp_path, async_save) as mgr:
        mgr.save(1, state)
        mgr.save(2, {"step": 2})  # a later step: the run stays loadable
        loaded = mgr.load(1)
    plain = {"phase": int, "split": str, "rate": float, "perm": int, "np_str": str, "np_bytes": bytes}
    for key, cls in plain.items():
        assert type(loaded[key]) is cls and loaded[key] == state[key], key
    assert loaded["by_phase"] == {2: "e", "train": "t"}
    assert all(type(k) in (int, str) for k in loaded["by_phase"])
    assert type(loaded["f64"]) is np.float64 and loaded["f64"] == np.float64(0.1)
    assert type(loaded["i32"]) is np.int32 and loaded["i32"] == -7


def test_ints_beyond_what_python_reads_back_are_refused(tmp_path: Path) -> None:
    limit = sys.int_info.default_max_str_digits
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"big": -(10**limit - 1)})  # exactly the limit: fine
        assert mgr.load()["big"] == -(10**limit - 1)
        for state in ({"big": 10**limit}, {"keys": {10**limit: 0}}):
            with pytest.raises(cs.UnsupportedStateError, match=f"more than {limit} decimal digits.*to_bytes"):
                mgr.save(2, state)
        assert mgr.steps() == [1]


@pytest.mark.parametrize("async_save", SAVE_MODES)
def test_a_tree_the_reader_would_refuse_is_refused_at_save(tmp_path: Path, async_save: bool) -> None:
    """Two distinct keys that save as the same plain str: the reader's validator decides at save,
    before anything is written."""

    class Key(str):
        __hash__ = object.__hash__  # distinct dict keys that compare equal to "a"

    with cs.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        with pytest.raises(cs.UnsupportedStateError, match="cannot read back.*duplicate keys"):
            mgr.save(1, {"d": {Key("a"): 1, "a": 2}})
        assert mgr.steps() == []
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]


@pytest.mark.parametrize("async_save", SAVE_MODES)
def test_conj_neg_and_zero_tensor_views_save_their_values(tmp_path: Path, async_save: bool) -> None:
    z = torch.randn(5, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    state = {
        "conj": z.conj(),  # conj bit set: .numpy() refuses it
        "neg": z.conj().imag,  # neg bit set
        "zero": torch._efficientzerotensor(3),
        "conj_strided": torch.randn(4, 4, dtype=torch.complex128).conj().t(),
    }
    with _manager(tmp_path, async_save) as mgr:
        mgr.save(1, state)
        loaded = mgr.load()
    for key, tensor in state.items():
        got = loaded[key]
        assert not got.is_conj() and not got.is_neg(), key
        assert got.dtype == tensor.dtype and _bits(got) == _bits(tensor), key
    assert torch.equal(loaded["conj"], torch.conj_physical(z))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (lambda: torch.empty(3, device="meta"), "meta tensor has no data"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensors"),
        (
            lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
            "nested tensors",
        ),
        (lambda: torch.nn.LazyLinear(3), "uninitialized lazy parameter"),
        (lambda: torch.ones(3).as_subclass(_Tagged), "torch.Tensor subclass"),
        (lambda: np.ma.array([1.0, 2.0], mask=[False, True]), "numpy.ndarray subclass.*mask"),
        (lambda: np.array([1, 2]).view(_Unit), "numpy.ndarray subclass"),
        (lambda: np.datetime64("2024-01-01"), "numpy dtype datetime64"),
        (lambda: torch.ones(2, dtype=torch.complex32), "tensor dtype torch.complex32"),
        (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8), "quantized tensors"),
        (lambda: np.ones(2, np.longdouble), "numpy dtype float128"),
        (lambda: np.matrix([[1, 2]]), "numpy.ndarray subclass"),
        (lambda: _Plain.A, "cannot checkpoint a .*_Plain"),
        (lambda: _nested(70), "nesting deeper than 64 levels"),
        (lambda: _released(), "cannot read its bytes"),
    ],
    ids=[
        *("meta", "nested", "jagged", "lazy", "tensor-sub", "masked", "array-sub", "datetime", "chalf"),
        *("quantized", "longdouble", "matrix", "plain-enum", "deep", "released-view"),
    ],
)
def test_values_that_could_not_come_back_are_refused_at_save(
    tmp_path: Path, value: Any, message: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors warn that they are a prototype
        made = value()
    with cs.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(cs.UnsupportedStateError, match=f"state at 'x.*{message}"):
            mgr.save(1, {"x": made})
        assert mgr.steps() == []


class _Plain(enum.Enum):
    """An enum that is not an int/str/float: its members are objects, not values."""

    A = object()


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def _released() -> memoryview:
    view = memoryview(b"data")
    view.release()
    return view


class _Tagged(torch.Tensor):
    """A tensor subclass (it could carry anything crashsafe does not store)."""


class _Unit(np.ndarray[Any, Any]):
    """An ndarray subclass, like a quantity carrying a unit."""


def test_a_failing_state_dict_is_reported_with_its_path(tmp_path: Path) -> None:
    class Broken:
        def state_dict(self) -> Any:
            raise RuntimeError("no state today")

        def load_state_dict(self, state: Any) -> None: ...

    refused = pytest.raises(cs.UnsupportedStateError, match=r"'obj'.*state_dict\(\) raised.*no state today")
    with cs.CheckpointManager(tmp_path) as mgr, refused:
        mgr.save(1, {"obj": Broken()})


# ---------------------------------------------------- 5. restore never casts silently


@pytest.mark.parametrize(
    ("saved", "live"),
    [
        (np.array([2**40 + 5]), np.zeros(1, np.int32)),
        (np.array([3e300]), np.zeros(1, np.float32)),
        (np.array([1.5]), np.zeros(1, np.int64)),
        (np.array([7], np.uint8), np.zeros(1, np.int8)),
        (torch.tensor([2**40 + 5]), np.zeros(1, np.int32)),
        (torch.tensor([1.0], dtype=torch.bfloat16), np.zeros(1, np.uint16)),
        (np.array([3e300]), torch.zeros(1, dtype=torch.float32)),
        (np.array([1, 2], np.int64), torch.zeros(2, dtype=torch.int32)),
    ],
    ids=[
        "int64->int32",
        "f64->f32",
        "f64->int64",
        "u8->i8",
        "tensor->array",
        "bf16->u16",
        "array->tensor",
        "i64->tensor-i32",
    ],
)
def test_restore_refuses_a_dtype_mismatch_and_changes_nothing(tmp_path: Path, saved: Any, live: Any) -> None:
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": saved, "n": 1})
        before = live.copy() if isinstance(live, np.ndarray) else live.clone()
        state = {"n": 0, "x": live}
        with pytest.raises(cs.UnsupportedStateError, match="'x': checkpoint has dtype .*cast the live value"):
            mgr.restore(state)
    assert state["n"] == 0
    assert np.array_equal(live, before) if isinstance(live, np.ndarray) else torch.equal(live, before)


def test_restore_into_arrays_of_the_same_type_is_exact_across_byte_order_and_kind(tmp_path: Path) -> None:
    saved = {
        "i64": np.array([2**40 + 5, -3]),
        "f64": np.array([3e300, -0.0]),
        "t_f32": torch.tensor([1.5, -2.25]),
        "a_i16": np.array([-300, 300], np.int16),
        "scalar": np.float64(2.5),
        "to_tensor": np.float32(-1.5),
    }
    live = {
        "i64": np.zeros(2, ">i8"),  # big-endian of the same type: fine
        "f64": np.zeros(2, ">f8"),
        "t_f32": np.zeros(2, np.float32),  # a saved tensor into a live array of its dtype
        "a_i16": torch.zeros(2, dtype=torch.int16),  # a saved array into a live tensor of its dtype
        "scalar": np.zeros((), np.float64),
        "to_tensor": torch.zeros((), dtype=torch.float32),  # a saved numpy scalar into a 0-d tensor
    }
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, saved)
        ids = {k: id(v) for k, v in live.items()}
        mgr.restore(live)
    assert {k: id(v) for k, v in live.items()} == ids  # copied in place
    assert live["i64"].dtype == np.dtype(">i8") and live["i64"].tolist() == [2**40 + 5, -3]
    assert live["f64"].tolist() == [3e300, -0.0] and np.signbit(live["f64"][1])
    assert live["t_f32"].tolist() == [1.5, -2.25]
    assert live["a_i16"].tolist() == [-300, 300]
    assert live["scalar"] == 2.5 and live["to_tensor"].item() == -1.5


def test_restore_refuses_a_read_only_live_array(tmp_path: Path) -> None:
    live = np.zeros(3)
    live.flags.writeable = False
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": np.ones(3)})
        with pytest.raises(cs.UnsupportedStateError, match="'x': the live array is read-only"):
            mgr.restore({"x": live})


@pytest.mark.parametrize("kind", ["inference", "expanded"])
def test_restore_refuses_a_live_tensor_it_cannot_write_before_changing_anything(
    tmp_path: Path, kind: str
) -> None:
    """A tensor made under inference_mode, or an expanded one, cannot take the saved values; it is
    refused with the rest of the state untouched. Both were found only while writing, after the
    model, the array and (inference) the tensor itself had been overwritten."""
    model = torch.nn.Linear(4, 3)
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model, "a": np.arange(5.0), "t": torch.arange(6.0)})
    if kind == "inference":
        with torch.inference_mode():
            t = torch.zeros(6)
    else:
        t = torch.zeros(1).expand(6)
    live_model, a = torch.nn.Linear(4, 3), np.zeros(5)
    before = [p.detach().clone() for p in live_model.parameters()]
    with pytest.raises(cs.UnsupportedStateError, match=f"'t': the live tensor (was made under|is {kind})"):
        cs.CheckpointManager(tmp_path, read_only=True).restore({"model": live_model, "a": a, "t": t})
    assert all(torch.equal(p, b) for p, b in zip(live_model.parameters(), before, strict=True))
    assert not a.any() and not t.any()


# ---------------------------------------------------- 17. restore accepts what load_state_dict does


def _qat_model() -> torch.nn.Module:
    from torch.ao.quantization import get_default_qat_qconfig, prepare_qat

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3)
    )
    model.train()
    model.qconfig = get_default_qat_qconfig("fbgemm")  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_qat(model)


@pytest.mark.parametrize("async_save", SAVE_MODES)
def test_qat_model_restores_into_a_freshly_prepared_one(tmp_path: Path, async_save: bool) -> None:
    trained = _qat_model()
    optim = torch.optim.SGD(trained.parameters(), lr=0.1)
    x = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        optim.zero_grad()
        trained(x).pow(2).mean().backward()
        optim.step()
    fresh = _qat_model()
    observer = "0.weight_fake_quant.activation_post_process.min_val"
    assert fresh.state_dict()[observer].shape != trained.state_dict()[observer].shape  # resized on load
    with _manager(tmp_path, async_save) as mgr:
        mgr.save(3, {"model": trained, "step": 3})
        live = {"model": fresh, "step": 0}
        assert mgr.restore(live) == 3
    assert live["step"] == 3
    for key, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    trained.eval()
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(x), trained(x))


@pytest.mark.parametrize("async_save", SAVE_MODES)
def test_fresh_lazy_module_restores_from_a_trained_one(tmp_path: Path, async_save: bool) -> None:
    torch.manual_seed(0)
    trained = torch.nn.Sequential(torch.nn.LazyLinear(6), torch.nn.ReLU(), torch.nn.LazyLinear(2))
    x = torch.randn(4, 5)
    trained(x)  # materialises the parameters
    fresh = torch.nn.Sequential(torch.nn.LazyLinear(6), torch.nn.ReLU(), torch.nn.LazyLinear(2))
    with _manager(tmp_path, async_save) as mgr:
        mgr.save(1, {"model": trained})
        mgr.restore({"model": fresh})
    assert not torch.nn.parameter.is_lazy(fresh[0].weight)
    with torch.no_grad():
        assert torch.equal(fresh(x), trained(x))


def test_restore_gives_modules_their_state_dict_versions(tmp_path: Path) -> None:
    """A checkpoint holds no state_dict version metadata; without it torch 'upgrades' the state as if
    it predated versioning, and a quantization observer silently resets its eps to the default."""
    from torch.ao.quantization import MinMaxObserver

    observer = MinMaxObserver(eps=1e-3)
    observer(torch.randn(16))
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"obs": observer})
        fresh = MinMaxObserver(eps=1e-3)
        mgr.restore({"obs": fresh})
    for name in ("eps", "min_val", "max_val"):
        assert torch.equal(getattr(fresh, name), getattr(observer, name)), name


def test_a_refusing_load_state_dict_names_its_path_and_where_restore_stopped(tmp_path: Path) -> None:
    """An object's own load_state_dict judges; the error says what is restored and what is not."""

    class Picky:
        def state_dict(self) -> dict[str, Any]:
            return {"v": torch.ones(2)}

        def load_state_dict(self, state: Any) -> None:
            raise ValueError("picky says no")

    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"step": 1, "obj": Picky(), "w": torch.ones(3), "n": 5})
        live = {"step": 0, "obj": Picky(), "w": torch.zeros(3), "n": 0}
        with pytest.raises(cs.UnsupportedStateError) as caught:
            mgr.restore(live)
    message = str(caught.value)
    assert message.startswith("state at 'obj': Picky.load_state_dict refused the checkpoint: picky says no")
    assert "Restore stopped there" in message
    assert live["step"] == 1  # before it in the state: restored
    assert torch.equal(live["w"], torch.ones(3))  # a plain tensor: read straight into place first
    assert live["n"] == 0  # any other value after it: unchanged


def _two_layers(last: int = 2, bias: bool = True) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, last, bias=bias))


@pytest.mark.parametrize(
    ("live_model", "match"),
    [
        (
            lambda: _two_layers(last=3),
            r"'model\.1\.weight': checkpoint has shape \(2, 8\), the live module \(3, 8\)",
        ),
        (
            lambda: _two_layers(bias=False),
            r"'model\.1\.bias': the checkpoint has it, the live Sequential does not",
        ),
        (
            lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2), torch.nn.Linear(2, 2)),
            r"'model\.2\.bias': the live Sequential has it, the checkpoint does not",
        ),
    ],
    ids=["shape", "unexpected-key", "missing-key"],
)
def test_what_torch_would_refuse_is_refused_before_anything_changes(
    tmp_path: Path, live_model: Callable[[], torch.nn.Module], match: str
) -> None:
    """Module.load_state_dict copies what fits before it raises on what does not; restore checks
    torch's own rules first, so a checkpoint of another architecture changes nothing."""
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"step": 1, "model": _two_layers(), "w": torch.ones(3)})
        model = live_model()
        before = [p.detach().clone() for p in model.parameters()]
        live = {"step": 0, "model": model, "w": torch.zeros(3)}
        with pytest.raises(cs.UnsupportedStateError, match=match) as caught:
            mgr.restore(live)
    assert "nothing was restored" in str(caught.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert live["step"] == 0 and torch.equal(live["w"], torch.zeros(3))


def test_an_optimizer_with_other_parameter_groups_is_refused_before_anything_changes(tmp_path: Path) -> None:
    model = _two_layers()
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)})
        fresh = _two_layers()
        before = [p.detach().clone() for p in fresh.parameters()]
        optim = torch.optim.SGD(
            [{"params": fresh[0].parameters()}, {"params": fresh[1].parameters()}], lr=0.1
        )
        with pytest.raises(cs.UnsupportedStateError, match="'optim.param_groups': checkpoint has 1 groups"):
            mgr.restore({"model": fresh, "optim": optim})
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters(), strict=True))


def test_mismatched_plain_values_are_refused_before_anything_changes(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model, "w": torch.ones(3)})
        fresh = torch.nn.Linear(2, 2)
        before = fresh.weight.detach().clone()
        with pytest.raises(cs.UnsupportedStateError, match="'w': checkpoint has shape"):
            mgr.restore({"model": fresh, "w": torch.zeros(4)})
    assert torch.equal(fresh.weight, before)


Point = collections.namedtuple("Point", "x y")


def test_restore_rebuilds_namedtuples_and_enum_members(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"pt": Point(1, torch.ones(2)), "phase": Phase.EVAL, "split": Split.TEST, "size": (3, 4)})
        live = {"pt": Point(0, torch.zeros(2)), "phase": Phase.TRAIN, "split": Split.TRAIN}
        live["size"] = torch.Size([0, 0])
        tensor = live["pt"].y
        mgr.restore(live)
    assert type(live["pt"]) is Point and live["pt"].x == 1 and live["pt"].y is tensor
    assert torch.equal(tensor, torch.ones(2))
    assert live["phase"] is Phase.EVAL and live["split"] is Split.TEST
    assert type(live["size"]) is torch.Size and live["size"] == (3, 4)


def test_restore_refuses_a_value_that_is_not_a_member_of_the_live_enum(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(2), "phase": 7})
        live = {"w": torch.zeros(2), "phase": Phase.TRAIN}
        with pytest.raises(cs.UnsupportedStateError, match="'phase': the checkpoint holds '7'.*not a value"):
            mgr.restore(live)
    assert torch.equal(live["w"], torch.zeros(2)) and live["phase"] is Phase.TRAIN


# ---------------------------------------------------- 18. what comes back changed (docs/state.md)


def test_documented_changes_on_load(tmp_path: Path) -> None:
    """Each row of the 'comes back changed' table in docs/state.md."""
    base = torch.arange(12.0)
    state = {
        "big_endian": np.arange(4, dtype=">i4"),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "strided": np.arange(10)[::3],
        "point": Point(1, 2),
        "blob": bytearray(b"ab"),
        "view": memoryview(b"cd"),
        "shared_a": base[:6],
        "shared_b": base[3:9],
        "phase": Phase.TRAIN,
        "param": torch.nn.Parameter(torch.ones(2)),
        "ordered": collections.OrderedDict(b=1, a=2),
        "default": collections.defaultdict(list, k=[1]),
        "nan": -float("nan"),
        "np_nan": np.array([-float("nan")]),
        "channels_last": torch.arange(16.0).reshape(1, 2, 2, 4).to(memory_format=torch.channels_last),
        "size": torch.Size([2, 3]),
        "memmap": np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(3,)),
        "module": torch.nn.Linear(1, 1),
        "list_sub": _Items([1, 2]),
    }
    with cs.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, state)
        got = mgr.load()
    assert got["big_endian"].dtype == np.dtype("<i4") and got["big_endian"].tolist() == [0, 1, 2, 3]
    assert got["fortran"].flags.c_contiguous and np.array_equal(got["fortran"], state["fortran"])
    assert got["strided"].flags.c_contiguous and got["strided"].tolist() == [0, 3, 6, 9]
    assert type(got["point"]) is tuple and got["point"] == (1, 2)
    assert got["blob"] == b"ab" and type(got["blob"]) is bytes and got["view"] == b"cd"
    got["shared_a"][3] = -1.0  # the overlap is no longer shared
    assert got["shared_b"][0] == 3.0 and got["shared_a"].untyped_storage().data_ptr() != (
        got["shared_b"].untyped_storage().data_ptr()
    )
    assert type(got["phase"]) is int and got["phase"] == 1
    assert type(got["param"]) is torch.Tensor and not got["param"].requires_grad
    assert type(got["ordered"]) is dict and list(got["ordered"]) == ["b", "a"]
    assert type(got["default"]) is dict and got["default"] == {"k": [1]}
    assert got["nan"] != got["nan"] and not np.signbit(got["nan"])  # a python float NaN: canonical
    assert np.signbit(got["np_nan"][0])  # arrays keep every bit
    assert got["channels_last"].is_contiguous() and torch.equal(got["channels_last"], state["channels_last"])
    assert got["channels_last"].device.type == "cpu"
    assert type(got["size"]) is tuple and got["size"] == (2, 3)
    assert type(got["memmap"]) is np.ndarray
    assert set(got["module"]) == {"weight", "bias"}  # a Stateful comes back as its state_dict
    assert type(got["list_sub"]) is list and got["list_sub"] == [1, 2]


class _Items(list[Any]):
    """A list subclass."""


def test_documented_restore_into_the_original_kinds(tmp_path: Path) -> None:
    """The last column of the table: restore copies in place or rebuilds the live kind."""
    saved = {
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "param": torch.nn.Parameter(torch.arange(3.0)),
        "ordered": collections.OrderedDict(b=1, a=2),
        "items": _Items([1, 2]),
        "memmap": np.arange(3, dtype=np.float32),
        "blob": bytearray(b"ab"),
    }
    live = {
        "fortran": np.asfortranarray(np.zeros((2, 3))),
        "param": torch.nn.Parameter(torch.zeros(3)),
        "ordered": collections.OrderedDict(b=0, a=0),
        "items": _Items([0, 0]),
        "memmap": np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(3,)),
        "blob": bytearray(b"zz"),
    }
    kept = dict(live)
    with cs.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, saved)
        mgr.restore(live)
    assert all(live[k] is v for k, v in kept.items())  # in place
    assert live["fortran"].flags.f_contiguous and np.array_equal(live["fortran"], saved["fortran"])
    assert live["param"].requires_grad and torch.equal(live["param"], saved["param"])
    assert live["ordered"] == {"b": 1, "a": 2} and live["items"] == [1, 2]
    assert live["memmap"].tolist() == [0.0, 1.0, 2.0]
    assert live["blob"] == b"ab"
