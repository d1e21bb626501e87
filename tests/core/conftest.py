"""Fixtures for the core engine tests: real models, real subprocesses, real files."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
SRC = HERE.parent.parent / "src"


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONUNBUFFERED": "1"}
    env.update(extra)
    return env


@pytest.fixture
def run_child() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run a script from tests/core/scripts with arguments; return the completed process."""

    def run(script: str, *args: Any, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(HERE / "scripts" / script), *map(str, args)],
            env=child_env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


@pytest.fixture
def spawn() -> Callable[..., subprocess.Popen[str]]:
    """Start a script from tests/core/scripts with piped text output."""

    def start(script: str, *args: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, str(HERE / "scripts" / script), *map(str, args)],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    return start


@pytest.fixture
def torch_state() -> dict[str, Any]:
    """A small real model + Adam + scheduler after a few steps, with RNG and step."""
    import torch

    import crashsafe as cs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2)
    x = torch.randn(8, 12)
    for _ in range(3):
        optim.zero_grad()
        model(x).pow(2).mean().backward()
        optim.step()
        sched.step()
    return {"model": model, "optim": optim, "sched": sched, "rng": cs.RNGState(), "step": 3}


def fresh_torch_state() -> dict[str, Any]:
    """The same architecture, untrained: a restore target."""
    import torch

    import crashsafe as cs

    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2)
    return {"model": model, "optim": optim, "sched": sched, "rng": cs.RNGState(), "step": 0}


@pytest.fixture
def fresh_state() -> Callable[[], dict[str, Any]]:
    return fresh_torch_state
