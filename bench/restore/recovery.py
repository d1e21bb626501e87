"""Where the recovery time of the demo's job goes: from process start to the first training step.

The demo's job (``python -m crashsafe.workloads.digits``: a small CNN, Adam, a StepLR schedule and
RNG state, raw codec, keep_last=3) is run once to leave three committed steps; then a fresh
process recovers from them ``--runs`` times, each timing its phases the way the job runs them:
interpreter start (spawn to the first line), imports, the data set, model and optimizer
construction, opening the manager, then ``restore`` split into discovery (listing steps, reading
and validating the manifest), matching the live state, reading + verifying payloads, decoding,
loading into the objects (``load_state_dict``, RNG) and the rest, and the first training step.
The split of ``restore`` comes from timers wrapped around those functions in the child only.

    python -m bench restore --recovery-only [--runs N]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROWS = [
    ("interpreter start", "spawn to the first line of the script (python itself, site)"),
    ("import numpy", ""),
    ("import torch", ""),
    ("import crashsafe", "what `import crashsafe` loads (never the simulator, CLI, Ray, plotting)"),
    ("import the job", "the job's module and scikit-learn's data set loader"),
    ("data set", "`load_digits()` and the split"),
    (
        "torch._dynamo (imported by the first optimizer)",
        "torch's cost of the job's first `torch.optim` object",
    ),
    ("model, optimizer, schedule", "building the live objects restore fills"),
    ("open the manager", "lock, leftovers of torn saves"),
    ("restore: discovery", "listing steps, opening the newest, reading + validating its manifest"),
    ("restore: match the live state", "which payloads go straight into which live tensors"),
    ("restore: check the fit", "`check_into` before anything changes"),
    ("restore: read + verify", "bytes into place, xxh3 chunk by chunk as they land"),
    ("restore: decode", "codecs other than raw (none here)"),
    ("restore: load into objects", "`load_state_dict` of model, optimizer, schedule; RNG states"),
    ("restore: the rest", "tree, values, threads (restore total minus the parts above)"),
    ("first training step", "forward, backward, Adam step of the first batch after restore"),
]


def prepare(directory: Path) -> None:
    """Three committed steps of the demo's job (30 training steps, a save every 10)."""
    log = directory / "events.jsonl"
    cmd = [sys.executable, "-m", "crashsafe.workloads.digits", "--dir", str(directory / "ckpt")]
    subprocess.run([*cmd, "--steps", "30", "--every", "10", "--log", str(log)], check=True, env=_env())


def _env() -> dict[str, str]:
    src = Path(__file__).resolve().parents[2] / "src"
    return {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def measure(directory: Path, runs: int) -> dict[str, float]:
    """The median seconds of each phase over ``runs`` fresh recoveries."""
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        spawned = time.time()
        out = subprocess.run(
            [sys.executable, __file__, str(directory / "ckpt"), repr(spawned)],  # not via bench/: no imports
            capture_output=True,
            text=True,
            env=_env(),
        )
        if out.returncode != 0:
            raise RuntimeError(f"the recovering job failed ({out.returncode}):\n{out.stderr[-3000:]}")
        phases = json.loads(out.stdout.strip().splitlines()[-1])
        for name, seconds in phases.items():
            samples.setdefault(name, []).append(seconds)
    return {name: statistics.median(values) for name, values in samples.items()}


def run(runs: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="crashsafe-recovery-") as tmp:
        prepare(Path(tmp))
        return measure(Path(tmp), runs)


def markdown(phases: dict[str, float], runs: int) -> list[str]:
    total = phases["total"]
    restore = phases["restore"]
    lines = [
        "## Recovery of the demo's job, end to end",
        "",
        f"`crashsafe demo`'s job (digits CNN + Adam + StepLR + RNG, raw codec, keep_last=3, "
        f"{phases['state bytes'] / 1024:.0f} KiB of arrays) recovering from its newest of 3 steps in a fresh "
        f"process: the median of {runs} runs (page cache warm). Restore itself is "
        f"**{restore * 1e3:.1f} ms of {total:.2f} s** ({restore / total:.1%}); the rest is Python, "
        "torch and the job's own start-up.",
        "",
        "| phase | time | share | what |",
        "|---|---|---|---|",
    ]
    for name, what in ROWS:
        seconds = phases.get(name, 0.0)
        lines.append(f"| {name} | {seconds * 1e3:.1f} ms | {seconds / total:.1%} | {what} |")
    lines += [f"| **total** | **{total * 1e3:.0f} ms** | 100% | spawn to the end of the first step |", ""]
    return lines


# ----------------------------------------------------------------------------- the child


def _child(directory: str, spawned: float) -> None:
    phases: dict[str, float] = {"interpreter start": time.time() - spawned}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - mark
        mark = now

    import numpy as np

    lap("import numpy")
    import torch

    lap("import torch")
    import crashsafe

    lap("import crashsafe")
    import sklearn.datasets  # noqa: F401 - the job's data set loader

    from crashsafe.workloads import digits
    from crashsafe.workloads.supervised import deterministic_torch

    lap("import the job")
    data = digits._load(0)
    lap("data set")
    import torch._dynamo  # what the first torch.optim optimizer imports

    lap("torch._dynamo (imported by the first optimizer)")
    digits._load = lambda seed: data  # type: ignore[assignment] - built once, above
    deterministic_torch()
    trainer = digits.DigitsTrainer(seed=0)
    lap("model, optimizer, schedule")
    manager = crashsafe.CheckpointManager(directory, keep_last=3, codec={"model.*": "raw", "*": "raw"})
    lap("open the manager")
    timers = _instrument(phases)
    began = time.perf_counter()
    assert manager.restore(trainer.state) == 30
    restore = time.perf_counter() - began
    timers()
    parts = sum(v for k, v in phases.items() if k.startswith("restore: "))
    phases["restore: the rest"] = restore - parts
    phases["restore"] = restore
    mark = time.perf_counter()
    trainer.train_step()
    lap("first training step")
    manager.close()
    phases["total"] = time.time() - spawned
    arrays = [t for t in trainer.model.state_dict().values()]
    arrays += [t for s in trainer.optim.state.values() for t in s.values()]
    phases["state bytes"] = float(sum(t.numel() * t.element_size() for t in arrays if torch.is_tensor(t)))
    del np
    print(json.dumps(phases))


def _instrument(phases: dict[str, float]) -> Callable[[], None]:
    """Accumulate the time spent in restore's parts into ``phases``; returns the undo."""
    import crashsafe.loading as loading
    import crashsafe.restoring as restoring
    from crashsafe.codecs.base import Codec
    from crashsafe.storage.reader import StepReader

    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - begin

        patched.append((owner, name, original))
        setattr(owner, name, timed)

    wrap(loading, "listed_steps", "restore: discovery")
    wrap(StepReader, "__init__", "restore: discovery")
    wrap(restoring, "live_destinations", "restore: match the live state")
    wrap(restoring, "check_into", "restore: check the fit")
    for name in ("read_into", "read_stored", "check_stored"):
        wrap(StepReader, name, "restore: read + verify")
    for name in ("decode", "decode_into"):
        wrap(Codec, name, "restore: decode")
    wrap(restoring, "apply_into", "restore: load into objects")

    def undo() -> None:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)

    return undo


if __name__ == "__main__":
    _child(sys.argv[1], float(sys.argv[2]))
