"""``crashsafe ps demo`` run as a user runs it: Ray's own messages go to a log file it names, not to
the terminal. Its own module, so the Ray this starts (in a child process) never runs beside the Ray of
another module's ``ray_session``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

# Ray's token-authentication notice and its report on the server the demo kills on purpose.
NOISE = ("Token authentication", "token-auth", "(raylet)", "worker died", "SYSTEM_ERROR", "OOM")


def test_import_crashsafe_ps_does_not_import_ray() -> None:
    code = (
        "import sys, crashsafe, crashsafe.ps; from crashsafe.ps import PSConfig, local_ray, ray_messages_to\n"
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]


def _ray_daemons(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] in ("raylet", "gcs_server") and marker in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


@pytest.mark.timeout(300)
def test_demo_sends_rays_messages_to_the_log_it_names(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env["HOME"] = str(home)  # the token stays in the environment: nothing may land in HOME
    args = ["--servers", "2", "--workers", "4", "--replicas", "2", "--kill-server-at", "3", "--clocks", "8"]
    cmd = [sys.executable, "-m", "crashsafe.cli", "ps", "demo", *args, "--workload", "mf", "--no-compare"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=280)
    said = " ".join(run.stdout.split())
    named = re.search(r"Ray's messages: (\S+)", run.stdout)
    try:
        assert run.returncode == 0, run.stdout + run.stderr
        assert "failure of server 0 before clock 4: recovered by replica" in said
        assert "updates lost │ 0" in said
        for noise in NOISE:
            assert noise not in run.stdout + run.stderr, noise
        assert named is not None, run.stdout
        log = Path(named.group(1))
        assert f"files in {log.parent}: ray.log Ray's own messages" in said
        assert re.search(r"session_[\d_-]+/ Ray's session files", said)
        assert "no checkpoints" in said
        text = log.read_text()
        assert "Token authentication is enabled" in text
        assert "(raylet)" in text and "SYSTEM_ERROR" in text
        assert os.listdir(home) == []
        deadline = time.monotonic() + 20
        while _ray_daemons(str(log.parent)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _ray_daemons(str(log.parent)), "the demo left Ray running"
    finally:
        if named is not None:
            shutil.rmtree(Path(named.group(1)).parent, ignore_errors=True)
