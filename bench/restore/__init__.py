"""Restore benchmark: from files to the live model's memory, against the limit and the usual loaders.

States of 64 MiB, 512 MiB and 2 GiB (a model of 8 fp32 parameters), page cache warm and cold
(each method's files evicted with ``posix_fadvise(DONTNEED)`` first), side by side in one run,
methods interleaved (rotated order each repeat), best repeat:

- the limit: ``preadv`` of crashsafe's stored bytes straight into the live parameters (1 and 2
  threads), no checksum: nothing reading these bytes into these tensors is faster;
- ``CheckpointManager.restore`` (raw codec, then zstd), verified;
- ``torch.load(mmap=True)`` + ``load_state_dict``, ``torch.load`` + ``load_state_dict``,
  ``torch.distributed.checkpoint.load`` (in place), safetensors ``load_file`` + ``load_state_dict``;
- zstd decompression only (the stored frames already in memory, one per core): the ceiling of a
  zstd restore.

The demo job's recovery, phase by phase from process start to its first training step, closes
the results (:mod:`bench.restore.recovery`).

    python -m bench restore [--quick] [--repeat N] [--sizes 64,512,2048] [--no-cold] [--runs N]
                            [--recovery-only]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import time

import torch

from bench.restore import recovery, report
from bench.restore.methods import METHODS, RESULTS, WORK, Files, MiB, interleaved, make_model


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench restore")
    parser.add_argument("--quick", action="store_true", help="64 MiB, 1 repeat, not kept")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--sizes", default="64,512,2048", help="state sizes in MiB")
    parser.add_argument("--no-cold", action="store_true", help="warm page cache only")
    parser.add_argument("--runs", type=int, default=5, help="fresh processes timing the demo job's recovery")
    parser.add_argument("--recovery-only", action="store_true", help="only the demo job's recovery breakdown")
    args = parser.parse_args(argv)
    sizes = [64] if args.quick else [int(s) for s in args.sizes.split(",")]
    repeat = args.repeat or (1 if args.quick else 5)
    torch.set_num_threads(2)
    began = time.perf_counter()
    loads = [report.load_average()]
    results: dict[int, dict[str, dict[str, float]]] = {}
    names = list(METHODS)
    for size in [] if args.recovery_only else sizes:
        print(f"-- state {size} MiB", flush=True)
        model = make_model(size * MiB, seed=1)
        reference = make_model(size * MiB, seed=1)
        files = Files(reference)
        rows = {"warm": interleaved(files, model, reference, repeat, cold=False, names=names)}
        if not args.no_cold:
            rows["cold"] = interleaved(files, model, reference, repeat, cold=True, names=names)
        results[size * MiB] = rows
        loads.append(report.load_average())
        del model, reference, files
        gc.collect()
    shutil.rmtree(WORK, ignore_errors=True)
    command = "make bench BENCH=restore"
    out = RESULTS / "restore.md"
    if args.quick or args.recovery_only:  # a look, not a result: restore.md keeps a whole run's
        out = WORK.with_name("restore-look.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    text = ""
    if not args.recovery_only:  # written first: the recovery part cannot lose them
        text = report.markdown(results, command, time.perf_counter() - began, repeat, loads)
        out.write_text(text)
    print("-- the demo job's recovery", flush=True)
    runs = 1 if args.quick else args.runs
    text += "\n" + "\n".join(recovery.markdown(recovery.run(runs), runs))
    out.write_text(text)
    print(text)
    print(f"written to {out}")
