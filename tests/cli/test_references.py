"""The commands on steps that refer to earlier steps' bytes (format version 4): ``ls``, ``show`` and
``verify`` tell the bytes a step owns from those it refers to, and in which step they are; their
--json documents fit the schema crashsafe ships."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..refsteps import commit_references
from .conftest import assert_fits, check_json, invoke, invoke_here


def _referring(run: tuple[Path, list[str]], tmp_path: Path) -> Path:
    """A copy of the run whose step 4 refers to every payload of step 3."""
    directory = tmp_path / "refs"
    shutil.copytree(run[0], directory)
    commit_references(directory, 4, 3)
    return directory


def test_ls_and_verify_tell_owned_bytes_from_referenced_ones(
    run: tuple[Path, list[str]], tmp_path: Path
) -> None:
    directory = _referring(run, tmp_path)
    doc = check_json(invoke_here("ls", str(directory), "--json").out, "ls")
    three, four = doc["steps"][2], doc["steps"][3]
    assert three["references"] == [] and three["referenced_bytes"] == 0
    assert four["references"] == [3] and four["bases"] == [3] and four["ok"]
    assert four["stored_bytes"] < 100 and four["referenced_bytes"] == three["stored_bytes"]
    verified = check_json(invoke_here("verify", str(directory), "--json").out, "verify")
    assert verified["ok"] and verified["steps"][3]["references"] == [3]
    listed = invoke("ls", str(directory), columns=120)
    assert listed.code == 0 and "refers to" in listed.out
    row = next(line for line in listed.out.splitlines() if line.split()[:1] == ["4"])
    assert "(step 3)" in row and "ok" in row
    assert_fits(invoke("ls", str(directory)).out)
    text = invoke_here("verify", str(directory)).out
    assert "step 4" in text and "refers to" in text and "(step 3)" in text


def test_show_names_the_step_holding_each_referenced_tensor(
    run: tuple[Path, list[str]], tmp_path: Path
) -> None:
    directory = _referring(run, tmp_path)
    doc = check_json(invoke_here("show", str(directory), "--json").out, "show")
    assert doc["step"] == 4 and doc["references"] == [3] and doc["referenced_bytes"] > doc["stored_bytes"]
    assert {t["ref"] for t in doc["tensors"]} == {3}
    plain = check_json(invoke_here("show", str(directory), "--json", "--step", "3").out, "show")
    assert plain["references"] == [] and {t["ref"] for t in plain["tensors"]} == {None}
    shown = invoke("show", str(directory), columns=160)
    assert shown.code == 0 and "held by" in shown.out
    assert "owned 0 B, referenced" in shown.out and "(step 3)" in shown.out
    assert_fits(invoke("show", str(directory)).out)
