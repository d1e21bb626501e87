"""``crashsafe simulate`` end to end on a small recorded curve."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from crashsafe.cli.app import app
from crashsafe.sim import LossCurve


def test_simulate_prints_a_table_and_writes_a_plot(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    steps = 2000
    losses = 2.3 * np.exp(-np.arange(steps) / 150.0) + 0.05 + 0.01 * rng.random(steps)
    LossCurve(losses, step_time=43.2).to_csv(tmp_path / "run.csv")  # a 24 h run
    plot = tmp_path / "sim.png"
    result = CliRunner().invoke(app, [
        "simulate", "--policy", "young,daly,coci,convergence", "--mtbf", "4h", "--ckpt-cost", "30s",
        "--loss-curve", str(tmp_path / "run.csv"), "--restart", "1min", "--trials", "200", "--steps", "4000",
        "--plot", str(plot),
    ], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    for name in ("young", "daly", "coci", "convergence"):
        assert name in result.output
    assert "1.00x" in result.output  # the first policy against itself
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_model_curve_with_plateau_end(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, [
        "simulate", "--policy", "daly-exact,overhead:0.05", "--mtbf", "1h", "--ckpt-cost", "5s",
        "--job", "6h", "--end", "plateau", "--failures", "weibull:0.8", "--trials", "200",
        "--plot", str(tmp_path / "p.png"),
    ], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "daly-exact" in result.output and (tmp_path / "p.png").exists()


def test_simulate_bad_input_names_the_problem(tmp_path: Path) -> None:
    runner = CliRunner()
    bad = runner.invoke(app, ["simulate", "--mtbf", "-4h", "--ckpt-cost", "30s", "--plot",
                              str(tmp_path / "x.png")])
    assert bad.exit_code == 2 and "mtbf" in bad.output
    unknown = runner.invoke(app, ["simulate", "--mtbf", "4h", "--ckpt-cost", "30s", "--policy", "magic"])
    assert unknown.exit_code == 2 and "unknown policy" in unknown.output
    (tmp_path / "run.csv").write_text("step,loss\n1,1.0\n2,0.9\n3,0.8\n")
    untimed = runner.invoke(app, ["simulate", "--mtbf", "4h", "--ckpt-cost", "30s", "--loss-curve",
                                  str(tmp_path / "run.csv")])
    assert untimed.exit_code == 2 and "--job" in untimed.output
