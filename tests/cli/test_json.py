"""--json through the console script: one strict JSON document on stdout, valid against the schema
crashsafe ships (crashsafe/cli/schema.json), for every command, on a local directory and an S3 URL;
errors on stderr with a non-zero exit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import crashsafe as cs

from .conftest import ROOT, SCHEMA, assert_fits, check_json, first_column, invoke, train


def test_ls_verify_show_json(run: tuple[Path, list[str]]) -> None:
    directory, paths = run
    reports = cs.verify(directory).steps
    listed = invoke("ls", str(directory), "--json", "--metric", "loss")
    assert listed.code == 0, listed.err
    doc = check_json(listed.out, "ls")
    assert [s["step"] for s in doc["steps"]] == [1, 2, 3]
    assert [s["metrics"] for s in doc["steps"]] == [r.metrics for r in reports]
    best = min(reports, key=lambda r: r.metrics["loss"]).step
    assert doc["metric"] == {"name": "loss", "mode": "min", "best_step": best}
    assert all(s["tiers"] == {"local": {"ok": True, "problem": None}} for s in doc["steps"])
    verified = check_json(invoke("verify", str(directory), "--json").out, "verify")
    assert verified["ok"] and [s["raw_bytes"] for s in verified["steps"]] == [r.raw_bytes for r in reports]
    shown = check_json(invoke("show", str(directory), "--json", "--step", "2").out, "show")
    assert shown["step"] == 2 and shown["world"] == 1 and [t["path"] for t in shown["tensors"]] == paths
    assert shown["metrics"] == reports[1].metrics and shown["info"]["crashsafe"] == cs.__version__
    assert {t["codec"]["id"] for t in shown["tensors"] if t["path"].startswith("model.")} == {"zstd"}


def test_verify_json_of_a_damaged_checkpoint_exits_1(run: tuple[Path, list[str]], tmp_path: Path) -> None:
    directory = tmp_path / "bad"
    shutil.copytree(run[0], directory)
    (directory / "step_000000000001" / "manifest.json").write_text("{}")
    verified = invoke("verify", str(directory), "--json")
    assert verified.code == 1 and "1 of 3 steps damaged" in verified.err
    doc = check_json(verified.out, "verify")
    assert not doc["ok"] and [s["ok"] for s in doc["steps"]] == [False, True, True]
    assert "manifest" in doc["steps"][0]["problem"]
    listed = check_json(invoke("ls", str(directory), "--json").out, "ls")
    assert listed["steps"][0]["tiers"]["local"]["ok"] is False


def test_gc_and_export_json(run: tuple[Path, list[str]], tmp_path: Path) -> None:
    directory = tmp_path / "copy"
    shutil.copytree(run[0], directory)
    out = tmp_path / "m.safetensors"
    exported = check_json(
        invoke("export", str(directory), "-o", str(out), "--prefix", "model.", "--json").out, "export"
    )
    assert exported["step"] == 3 and exported["output"] == str(out) and out.stat().st_size > exported["bytes"]
    collected = check_json(invoke("gc", str(directory), "--keep-last", "1", "--force", "--json").out, "gc")
    assert collected == {"location": str(directory), "deleted": [1, 2], "leftovers": [], "kept": [3]}


def test_simulate_json(tmp_path: Path) -> None:
    ran = invoke(
        "simulate", "--mtbf", "4h", "--ckpt-cost", "30s", "--policy", "young,every:1", "--trials", "50",
        "--steps", "1000", "--plot", str(tmp_path / "s.png"), "--json",
    )  # fmt: skip
    assert ran.code == 0, ran.err
    doc = check_json(ran.out, "simulate")
    assert [p["policy"] for p in doc["policies"]] == ["young", "every:1"]
    assert doc["policies"][0]["vs_first"]["mean"] == pytest.approx(1.0)
    assert (tmp_path / "s.png").exists() and doc["plot"] == str((tmp_path / "s.png").resolve())


def test_errors_go_to_stderr_and_leave_stdout_empty(run: tuple[Path, list[str]], tmp_path: Path) -> None:
    directory, _ = run
    for args in (
        ["ls", str(tmp_path / "nope")],
        ["show", str(directory), "--step", "99"],
        ["verify", str(tmp_path / "nope")],
        ["diff", str(directory), "1", "99"],
        ["gc", str(tmp_path / "nope")],
        ["ls", "memory://nowhere/run", "--storage-options", "[1]"],
    ):
        failed = invoke(*args, "--json")
        assert failed.code == 2 and failed.out == "", args
        assert failed.err.startswith("error:"), (args, failed.err)


def test_every_command_on_an_s3_url(tmp_path: Path, bucket: str, options: dict[str, Any]) -> None:
    """ls, verify, show, diff (S3 against local), export and gc on an S3 URL (moto on 127.0.0.1),
    each once: JSON valid against the schema, tables at 80 columns."""
    url, opts = f"s3://{bucket}/run", ["--storage-options", json.dumps(options)]
    paths = train(url, steps=2, storage_options=options)
    train(tmp_path / "local", steps=2)
    listed = check_json(invoke("ls", url, *opts, "--json").out, "ls")
    assert [s["step"] for s in listed["steps"]] == [1, 2] and listed["location"] == url
    tables = {cmd: invoke(cmd, url, *opts) for cmd in ("verify", "show")}
    for table in tables.values():
        assert table.code == 0, table.err
        assert_fits(table.out)
    assert "all 2 steps intact" in tables["verify"].out
    assert [p for p, _ in first_column(tables["show"].out, "path")] == paths
    same = invoke("diff", url, str(tmp_path / "local"), *opts, "--json")
    assert same.code == 0, same.err
    doc = check_json(same.out, "diff")
    assert doc["identical"] and doc["counts"]["identical"] == len(doc["paths"])
    assert [p["path"] for p in doc["paths"] if p["kind"] == "tensor"] == paths
    out = tmp_path / "m.safetensors"
    exported = check_json(invoke("export", url, *opts, "-o", str(out), "--json").out, "export")
    assert exported["step"] == 2 and out.exists()
    collected = check_json(invoke("gc", url, *opts, "--keep-last", "1", "--force", "--json").out, "gc")
    assert collected == {"location": url, "deleted": [1], "leftovers": [], "kept": [2]}


def test_the_schema_is_strict(run: tuple[Path, list[str]]) -> None:
    """The documented schema catches a renamed, missing or extra key (so the tests above would)."""
    import jsonschema

    doc = json.loads(invoke("ls", str(run[0]), "--json").out)
    for broken in (
        {**doc, "extra": 1},
        {k: v for k, v in doc.items() if k != "mirror"},
        {**doc, "steps": [{**doc["steps"][0], "stored": 1}]},
        {**doc, "steps": [{k: v for k, v in doc["steps"][0].items() if k != "tiers"}]},
    ):
        with pytest.raises(jsonschema.ValidationError):
            check_json(json.dumps(broken), "ls")


def _keys(node: Any) -> set[str]:
    """Every property name anywhere in a schema."""
    if isinstance(node, list):
        return set().union(*map(_keys, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    own = set(node["properties"]) if isinstance(node.get("properties"), dict) else set()
    return own | set().union(*map(_keys, node.values()))


def test_the_docs_name_every_key_and_command() -> None:
    """docs/cli.md describes every key of every document the schema defines."""
    docs = (ROOT / "docs" / "cli.md").read_text()
    keys = _keys(SCHEMA)
    assert {"best_step", "global_shape", "mean_abs", "vs_first"} <= keys
    assert not [k for k in sorted(keys) if f"`{k}`" not in docs]
    for command in ("ls", "verify", "show", "diff", "gc", "export", "simulate"):
        assert command in SCHEMA["$defs"] and f"- **`{command}`**" in docs
