"""The torchrun example as the README writes it: trains, and a second run (on another number of
ranks) resumes from the first one's newest step."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from .conftest import SRC, free_port

ROOT = SRC.parent


def _readme_command() -> list[str]:
    """The torchrun command of the README's distributed section, continuation lines joined."""
    text = (ROOT / "README.md").read_text()
    found = re.search(
        r"^(OMP_NUM_THREADS=1 torchrun .*?examples/distributed_train\.py.*?)$",
        text.replace("\\\n", " "),
        re.M,
    )
    assert found, "the README shows the torchrun example"
    return shlex.split(found.group(1))


def _run(command: list[str], port: int, nproc: int, *more: str) -> str:
    env_part, torchrun, *args = command
    args = [
        {
            "--master-port=29511": f"--master-port={port}",
            "--nproc-per-node=2": f"--nproc-per-node={nproc}",
        }.get(a, a)
        for a in args
    ]
    env = {**os.environ, env_part.split("=")[0]: env_part.split("=")[1], "PYTHONPATH": str(SRC)}
    assert torchrun == "torchrun"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args, *more],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_readme_torchrun_example_trains_and_resumes_on_another_world_size(tmp_path: Path) -> None:
    command = _readme_command()
    first = _run(command, free_port(), 2, "--dir", str(tmp_path / "run"), "--steps", "40", "--pause", "0")
    assert "2 ranks, fsdp: starting at step 0" in first and "done: step 40" in first
    again = _run(command, free_port(), 1, "--dir", str(tmp_path / "run"), "--steps", "60", "--pause", "0")
    assert "1 ranks, fsdp: starting at step 40" in again and "done: step 60" in again
