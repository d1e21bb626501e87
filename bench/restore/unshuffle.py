"""Where zstd restore goes beyond decompression: undoing the byte shuffle.

``.venv/bin/python -m bench.restore.unshuffle`` decodes 64 MiB of float32 weights (zstd level 1,
shuffled, as crashsafe's ``Zstd`` codec writes them) six ways, best of 5 each, and prints the
table in bench/results/restore.md. The shuffled stream is plane-major (byte 0 of every element,
then byte 1, ...), so every decoder must scatter each plane across the output once; the codec
does it while it decompresses, a scratch buffer at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import zstandard

from crashsafe.codecs.zstd import Zstd

ELEMENTS = 16 << 20  # 64 MiB of float32


def _best(work: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    weights = (np.random.default_rng(0).standard_normal(ELEMENTS) * 0.02).astype(np.float32)
    codec = Zstd()
    data = bytes(codec.encode(weights))
    out = np.empty_like(weights)
    planes = np.empty(weights.nbytes, dtype=np.uint8)
    columns = out.view(np.uint8).reshape(ELEMENTS, 4)

    def decompress() -> None:
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            view, got = planes.data, 0
            while got < len(view):
                got += reader.readinto(view[got:])

    def shift_or() -> None:
        words, rows = out.view(np.uint32), planes.reshape(4, ELEMENTS)
        for start in range(0, ELEMENTS, 1 << 16):
            part, dest = rows[:, start : start + (1 << 16)], words[start : start + (1 << 16)]
            np.left_shift(part[3], 24, out=dest, dtype=np.uint32, casting="unsafe")
            dest |= part[2].astype(np.uint32) << 16
            dest |= part[1].astype(np.uint32) << 8
            dest |= part[0]

    decompress()
    rows = [
        ("zstd decompression alone, into one buffer", _best(decompress)),
        ("crashsafe's Zstd.decode_into (decompresses and scatters each plane, 1 MiB at a time)",
         _best(lambda: codec.decode_into(data, out))),
        ("then, after decompression: numpy transpose of the planes into place",
         _best(lambda: np.copyto(columns, planes.reshape(4, ELEMENTS).T))),
        ("then, after decompression: torch transpose (copy_ of the transposed view)",
         _best(lambda: torch.from_numpy(columns).copy_(torch.from_numpy(planes).view(4, ELEMENTS).t()))),
        ("then, after decompression: shift-and-or of the 4 planes into uint32, 64 Ki elements at a time",
         _best(shift_or)),
    ]  # fmt: skip
    assert np.array_equal(out, weights)
    base = rows[0][1]
    print("| decoding 64 MiB of float32 (zstd level 1, shuffled) | ms | / decompression alone |")
    print("|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / base:.2f}x |")


if __name__ == "__main__":
    main()
