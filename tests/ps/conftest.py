"""One local Ray per test module (ray.init costs seconds), bound to 127.0.0.1, started with HOME and
Ray's temp dir pointed at fresh directories so that nothing lands in the real home, and a check at
teardown that no Ray process of ours is left behind and the fake HOME stayed empty."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from crashsafe.ps import PSConfig, PSJob, local_ray

SHAPE = {"servers": 2, "workers": 4}


def _ours(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["name"] in ("raylet", "gcs_server") and marker in cmd:
            found.append(proc)
    return found


@pytest.fixture(scope="module")
def ray_session() -> Iterator[dict[str, str]]:
    """A loopback Ray; yields the fake HOME and the Ray temp dir. Restores the environment after.

    Ray's processes (GCS, raylet, and every worker and actor they spawn) inherit the fake HOME from
    ``ray.init``; the test process gets its real HOME back right away, so other tests are unaffected.
    """
    saved = dict(os.environ)
    real_token = Path(os.path.expanduser("~")) / ".ray" / "auth_token"
    token_existed = real_token.exists()
    home = tempfile.mkdtemp(prefix="cs-home-")
    temp_dir = tempfile.mkdtemp(prefix="cs-ray-")  # short: Ray's socket paths must fit in 107 bytes
    os.environ["HOME"] = home
    try:
        with local_ray(num_cpus=2, temp_dir=temp_dir):
            if "HOME" in saved:
                os.environ["HOME"] = saved["HOME"]
            yield {"home": home, "temp_dir": temp_dir}
        deadline = time.monotonic() + 20
        while _ours(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _ours(temp_dir)
        assert not left, f"Ray processes left behind: {[(p.pid, p.name()) for p in left]}"
        assert os.listdir(home) == [], f"Ray wrote into HOME: {os.listdir(home)}"
        assert token_existed or not real_token.exists(), "an auth token was written into the real home"
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def job(ray_session: dict[str, str]) -> Iterator[PSJob]:
    """Two servers and four workers, reused by every test of a module (each run reconfigures them)."""
    with PSJob(PSConfig(**SHAPE)) as ps_job:
        yield ps_job
