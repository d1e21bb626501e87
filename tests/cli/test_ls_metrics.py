"""``crashsafe ls``'s metric columns: every metric any intact step records ("-" where a step lacks
it), whole numbers shown whole, and a metric named "step" never mistaken for the step."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import crashsafe as cs

from .conftest import invoke_here


def test_ls_shows_each_metric_where_recorded_and_a_step_metric_apart_from_the_step(tmp_path: Path) -> None:
    with cs.CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(2, {"w": np.zeros(3)})  # a step saved where nothing was logged
        mgr.save(4, {"w": np.zeros(3)}, {"loss": 1.25, "step": 3, "global_step": 12000})
    run = invoke_here("ls", str(tmp_path))
    assert run.code == 0, run.err
    lines = run.out.splitlines()
    header = next(line for line in lines if "loss" in line)
    assert header.split()[:5] == ["step", "global_step", "loss", "metric", "step"]

    def cells(step: str) -> list[str]:
        return next(line.split() for line in lines if line.split()[:1] == [step])[:4]

    assert cells("2") == ["2", "-", "-", "-"]
    assert cells("4") == ["4", "12000", "1.25", "3"]  # (12000 was shown as 1.2e+04)
