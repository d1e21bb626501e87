"""Round-trip properties of every codec, over random arrays and random chains of saves.

Lossless codecs give back the exact bytes; lossy delta codecs decode to exactly the
reconstruction their encoder tracked; non-finite values are never zeroed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from crashsafe.codecs import LC, Codec, DeltaCodec, Incremental, Raw, Reference, Scar, TopN, Zstd, get_codec
from crashsafe.errors import CodecError

LOSSY: list[DeltaCodec] = [
    LC(bits=2),
    LC(bits=3),
    LC(bits=3, rep="mean"),
    Scar(budget=0.1),
    TopN(budget=0.05),
]
FLOAT_TYPES = [np.float16, np.float32, np.float64, np.uint16]  # uint16 storage = bfloat16
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=24)


def same_bits(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def walk(start: np.ndarray[Any, Any], seed: int, steps: int, specials: bool) -> list[np.ndarray[Any, Any]]:
    """A training-like sequence: small heavy-tailed updates, a few unchanged or zeroed entries,
    and (if ``specials``) NaN/Inf appearing and disappearing."""
    rng = np.random.default_rng(seed)
    out = [start]
    for _ in range(steps):
        prev = out[-1]
        if prev.dtype == np.uint16:  # bfloat16 bits: move in float32 space, round by truncation
            f = (prev.astype(np.uint32) << 16).view(np.float32)
            f = f + rng.standard_t(3, prev.shape).astype(np.float32) * 1e-2
            nxt = (f.view(np.uint32) >> 16).astype(np.uint16)
        else:
            with np.errstate(all="ignore"):
                noise = rng.standard_t(3, prev.shape) * 10.0 ** rng.integers(-6, 0)
                nxt = (prev.astype(np.float64) + noise * (rng.random(prev.shape) < 0.7)).astype(prev.dtype)
        if specials and nxt.size:
            flat = nxt.reshape(-1)
            pick = rng.integers(0, flat.size, size=2)
            if nxt.dtype == np.uint16:
                flat[pick] = rng.choice(np.array([0x7FC0, 0x7F80, 0xFF80], dtype=np.uint16), size=2)
            else:
                flat[pick] = rng.choice(np.array([np.nan, np.inf, -np.inf]), size=2)
        out.append(np.array(nxt, copy=True))
    return out


def finite_start(dtype: Any) -> st.SearchStrategy[np.ndarray[Any, Any]]:
    if dtype == np.uint16:
        return hnp.arrays(np.float32, shapes, elements=st.floats(-1e3, 1e3, width=32)).map(
            lambda a: (a.view(np.uint32) >> 16).astype(np.uint16)
        )
    width = np.dtype(dtype).itemsize * 8
    return hnp.arrays(dtype, shapes, elements=st.floats(-1e3, 1e3, width=width))


def run_chain(codec: DeltaCodec, arrays: list[np.ndarray[Any, Any]]) -> list[Reference]:
    """Encode a chain as the manager does; decode it as a restore does; compare at every step."""
    enc: Reference | None = None
    dec: Reference | None = None
    decoded = []
    for i, array in enumerate(arrays):
        data, enc = codec.encode_delta(array, None if i == 0 else enc)
        dec = codec.decode_delta(bytes(data), array.dtype, array.shape, None if i == 0 else dec)
        assert same_bits(dec.array, enc.array), f"{codec} step {i}: decode differs from the encoder's state"
        decoded.append(Reference(dec.array.copy(), dec.memo))
    return decoded


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", LOSSY, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_TYPES, ids=lambda d: "bf16" if d == np.uint16 else np.dtype(d).name)
@SETTINGS
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_lossy_decode_equals_tracked_reconstruction(
    codec: DeltaCodec, dtype: Any, data: st.DataObject, seed: int
) -> None:
    start = data.draw(finite_start(dtype))
    arrays = walk(start, seed, steps=4, specials=True)
    decoded = run_chain(codec, arrays)
    assert same_bits(decoded[0].array, arrays[0]), "a full payload is lossless"
    if isinstance(codec, LC):
        for array, ref in zip(arrays, decoded, strict=True):
            special = (array & 0x7F80) == 0x7F80 if array.dtype == np.uint16 else ~np.isfinite(array)
            assert np.array_equal(ref.array[special].view(np.uint8), array[special].view(np.uint8)), (
                "non-finite values must be stored exactly, never zeroed"
            )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.uint8, np.bool_, np.complex64])
@SETTINGS
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_incremental_is_bit_exact(dtype: Any, data: st.DataObject, seed: int) -> None:
    start = data.draw(hnp.arrays(dtype, shapes))
    rng = np.random.default_rng(seed)
    arrays = [start]
    for _ in range(5):
        flips = rng.integers(0, 256, size=start.nbytes, dtype=np.uint8) * (rng.random(start.nbytes) < 0.2)
        raw = arrays[-1].reshape(-1).view(np.uint8) ^ flips.astype(np.uint8)
        nxt = raw.view(dtype).reshape(start.shape)
        arrays.append(nxt)
    for codec in (Incremental(full_every=3), Incremental(level=5)):
        decoded = run_chain(codec, arrays)
        for array, ref in zip(arrays, decoded, strict=True):
            assert same_bits(ref.array, array)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", [Raw(), Zstd(), Zstd(5, shuffle=False), Incremental(), *LOSSY], ids=str)
@SETTINGS
@given(array=hnp.arrays(np.float32, shapes, elements=st.floats(width=32)))
def test_plain_encode_decode_is_exact(codec: Codec, array: np.ndarray[Any, Any]) -> None:
    """``encode``/``decode`` (no reference) write a self-contained payload; even lossy codecs'
    full payloads are lossless, NaN payload bits included."""
    restored = codec.decode(bytes(codec.encode(array)), array.dtype, array.shape)
    assert same_bits(restored, array)
    assert restored.flags.writeable


@pytest.mark.parametrize("codec", [Raw(), Zstd(level=3), Incremental(full_every=7, level=2), *LOSSY], ids=str)
def test_config_round_trips_through_json(codec: Codec) -> None:
    import json

    config = json.loads(json.dumps(codec.get_config()))
    assert get_codec(config) == codec


@pytest.mark.parametrize(
    "config",
    [
        {"id": "lc", "bits": 4},
        {"id": "lc", "rep": "median"},
        {"id": "lc", "full_every": 0},
        {"id": "incremental", "level": 99},
        {"id": "scar", "budget": 0},
        {"id": "topn", "budget": 1.5},
        {"id": "lc", "surprise": 1},
    ],
)
def test_bad_configs_are_refused_with_a_codec_error(config: dict[str, Any]) -> None:
    with pytest.raises(CodecError, match="invalid parameters"):
        get_codec(config)


@pytest.mark.parametrize("codec", LOSSY, ids=str)
def test_lossy_codecs_refuse_non_float_arrays(codec: DeltaCodec) -> None:
    with pytest.raises(CodecError, match="lossless codec"):
        codec.encode(np.arange(10, dtype=np.int32))


@pytest.mark.parametrize("codec", [Incremental(), *LOSSY], ids=str)
def test_a_delta_payload_needs_its_base(codec: DeltaCodec) -> None:
    a = np.linspace(0, 1, 100, dtype=np.float32)
    _, ref = codec.encode_delta(a, None)
    data, _ = codec.encode_delta(a + np.float32(0.5), ref)
    with pytest.raises(CodecError, match="read it through its chain"):
        codec.decode(bytes(data), a.dtype, a.shape)
    with pytest.raises(CodecError):
        codec.decode_delta(bytes(data), a.dtype, (10, 10), Reference(np.zeros(100, np.float32)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", [Incremental(), *LOSSY], ids=str)
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), flips=st.integers(1, 8))
def test_damaged_payloads_raise_codec_errors_not_crashes(codec: DeltaCodec, seed: int, flips: int) -> None:
    """Checksums keep damage away from decoders; decoders still treat payloads as untrusted data:
    damage gives a CodecError or an array of the right shape, never another exception."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((64, 40)).astype(np.float32)
    b = a + (rng.standard_normal(a.shape) * 1e-3 * (rng.random(a.shape) < 0.5)).astype(np.float32)
    _, ref = codec.encode_delta(a, None)
    data = bytearray(codec.encode_delta(b, Reference(ref.array.copy(), ref.memo))[0])
    for pos in rng.integers(0, len(data), size=flips):
        data[pos] ^= 1 << int(rng.integers(0, 8))
    try:
        out = codec.decode_delta(bytes(data), a.dtype, a.shape, Reference(ref.array.copy(), ref.memo))
    except CodecError:
        return
    assert out.array.shape == a.shape and out.array.dtype == a.dtype


_TIED_CHAIN = """
import sys, numpy as np
from crashsafe.codecs import Scar, TopN
ref = {}
for codec in (Scar(budget=0.3), TopN(budget=0.3)):
    reference = None
    for k in range(4):  # every row moves by the same amount: all ties
        array = np.full((64, 8), float(k), dtype=np.float32)
        payload, reference = codec.encode_delta(array, reference)
        sys.stdout.write(payload.hex() + "\\n")
"""


def test_top_n_choices_are_the_same_on_every_cpu() -> None:
    """Tied rows and elements go to the lower index, whichever algorithm numpy's argpartition picks
    for the CPU (AVX-512 machines once chose other tied rows than AVX2 ones, so the bytes written
    depended on the machine). Here: with and without numpy's AVX-512 kernels, the same bytes."""
    import os
    import subprocess
    import sys

    runs = []
    for disabled in ("", "X86_V4 AVX512_ICL"):
        env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": disabled}
        out = subprocess.run([sys.executable, "-c", _TIED_CHAIN], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout)
    assert runs[0] == runs[1] and runs[0].count("\n") == 8
