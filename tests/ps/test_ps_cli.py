"""``crashsafe ps demo``: a real run with a killed server, its summary, and its argument errors."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from crashsafe.cli.app import app


def test_ps_group_is_registered_and_does_not_import_ray() -> None:
    code = "import sys, crashsafe.cli.app; print('ray' in sys.modules, 'crashsafe.ps' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
    result = CliRunner().invoke(app, ["ps", "--help"])
    assert result.exit_code == 0 and "demo" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas", "9"], "needs 8 worker copies"),
        (["--kill-server-at", "100", "--clocks", "100"], "--kill-server-at must be in [0, 99]"),
        (["--workload", "imagenet"], "unknown workload 'imagenet'"),
        (["--spares", "-1"], "spares must be an int >= 0"),
    ],
)
def test_demo_rejects_bad_arguments_before_starting_ray(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["ps", "demo", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


@pytest.mark.timeout(150)
def test_demo_kills_a_server_and_reports_no_loss(ray_session: dict[str, str]) -> None:
    args = [
        "ps",
        "demo",
        "--servers",
        "2",
        "--workers",
        "4",
        "--replicas",
        "2",
        "--kill-server-at",
        "6",
        "--clocks",
        "12",
        "--workload",
        "mf",
    ]
    result = CliRunner().invoke(app, args)
    work = re.search(r"files in (\S+):", result.output)
    try:
        assert result.exit_code == 0, result.output
        text = " ".join(result.output.split())
        assert "failure of server 0 before clock 7: recovered by replica" in text
        assert "updates lost │ 0" in text
        assert "identical to failure-free run │ yes" in text
        assert "SYSTEM_ERROR" not in text and work is not None
        assert f"Ray's messages: {work.group(1)}/ray.log" in text
    finally:
        if work is not None:  # the demo keeps its files for the user; the test does not
            shutil.rmtree(work.group(1), ignore_errors=True)
