"""The command line on object-store URLs and on two tiers (moto on 127.0.0.1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import crashsafe as cs
from crashsafe.cli.app import app

runner = CliRunner()


def _run(tmp_path: Path, url: str, options: dict[str, Any]) -> None:
    with cs.CheckpointManager(
        tmp_path / "local", keep_last=1, mirror=url, storage_options=options, mirror_keep_last=3
    ) as mgr:
        for step in range(1, 5):
            mgr.save(step, {"w": np.full(100, float(step)), "step": step})


def test_ls_shows_both_tiers(tmp_path: Path, bucket: str, options: dict[str, Any]) -> None:
    url = f"s3://{bucket}/run"
    _run(tmp_path, url, options)
    result = runner.invoke(
        app, ["ls", str(tmp_path / "local"), "--mirror", url, "--storage-options", json.dumps(options)]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    rows = {line.split()[0]: line for line in lines if line.split()[:1] != [] and line.split()[0].isdigit()}
    assert set(rows) == {"2", "3", "4"}  # plain text when piped: the step is the first word of its row
    assert "local+mirror" in rows["4"] and "mirror" in rows["3"] and "local" not in rows["3"]


def test_verify_gc_show_and_export_take_urls(tmp_path: Path, bucket: str, options: dict[str, Any]) -> None:
    url = f"s3://{bucket}/run"
    _run(tmp_path, url, options)
    opts = ["--storage-options", json.dumps(options)]
    verified = runner.invoke(app, ["verify", url, *opts])
    assert verified.exit_code == 0 and "all 3 steps intact" in verified.output, verified.output
    shown = runner.invoke(app, ["show", url, "--step", "3", *opts])
    assert shown.exit_code == 0 and "float64" in shown.output, shown.output
    out = tmp_path / "w.safetensors"
    exported = runner.invoke(app, ["export", url, "-o", str(out), *opts])
    assert exported.exit_code == 0 and out.exists(), exported.output
    collected = runner.invoke(app, ["gc", url, "--keep-last", "1", "--force", *opts])
    assert collected.exit_code == 0 and "kept [4]" in collected.output, collected.output
    assert cs.CheckpointManager(url, storage_options=options, read_only=True).steps() == [4]
    bad = runner.invoke(app, ["verify", url, "--storage-options", "{not json"])
    assert bad.exit_code == 2 and "not valid JSON" in bad.output


def test_a_url_that_leads_nowhere_is_an_error_not_an_empty_run(
    tmp_path: Path, bucket: str, options: dict[str, Any]
) -> None:
    """A typo in a URL, a missing bucket or directory: `verify` said "all 0 steps intact" (exit 0, so
    a CI check passed), `gc` created the directory, a reader listed no steps. Each now says the
    location does not exist, and creates nothing."""
    opts = ["--storage-options", json.dumps(options)]
    for url, extra in [
        (f"file://{tmp_path}/typo", []),
        (f"s3://no-such-bucket-{bucket}/run", opts),
        (f"s3://{bucket}/typo", opts),
    ]:
        for command in (["verify", url], ["gc", url], ["ls", url], ["show", url]):
            result = runner.invoke(app, [*command, *extra])
            assert result.exit_code == 2 and "does not exist" in result.output, (command, result.output)
        with pytest.raises(cs.NoCheckpointError, match="does not exist"):
            cs.CheckpointManager(url, storage_options=options if extra else None, read_only=True)
    assert not (tmp_path / "typo").exists()
