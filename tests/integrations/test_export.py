"""Exports people can load: GPT-2 and BERT saved by crashsafe, exported with the prefix stripped,
load with ``load_state_dict(strict=True)`` and with ``from_pretrained``, tied weights tied."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import crashsafe as cs
from crashsafe.cli.app import app
from crashsafe.storage.layout import step_dir
from crashsafe.workloads import hf_tiny

from ..hostile import within

runner = CliRunner()
MODELS: dict[str, Callable[[int], Any]] = {"gpt2": hf_tiny.tiny_gpt2, "bert": hf_tiny.tiny_bert}
TIED = {
    "gpt2": [("lm_head.weight", "transformer.wte.weight")],
    "bert": [("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight")],
}


def _saved(tmp_path: Path, kind: str) -> tuple[Any, Path]:
    model = MODELS[kind](0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # not the initial weights
    directory = tmp_path / "ckpt"
    with cs.CheckpointManager(directory) as mgr:
        mgr.save(3, {"model": model, "hf_config": model.config.to_dict(), "step": 3})
    return model.eval(), directory


def _outputs(model: Any) -> torch.Tensor:
    tokens = torch.arange(16).reshape(2, 8)
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=tokens).logits
    return logits


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_export_loads_strictly_into_the_model_it_came_from(tmp_path: Path, kind: str) -> None:
    model, directory = _saved(tmp_path, kind)
    out = tmp_path / "model.safetensors"
    result = runner.invoke(app, ["export", str(directory), "-o", str(out), "--prefix", "model."])
    assert result.exit_code == 0, result.output
    tensors = load_file(out)
    assert set(tensors) == set(model.state_dict())
    fresh = MODELS[kind](1).eval()
    fresh.load_state_dict(tensors, strict=True)
    assert torch.equal(_outputs(fresh), _outputs(model))
    for tied, source in TIED[kind]:
        assert fresh.get_parameter(tied) is fresh.get_parameter(source)  # still tied after the load


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_hf_dir_loads_with_from_pretrained(tmp_path: Path, kind: str) -> None:
    model, directory = _saved(tmp_path, kind)
    folder = tmp_path / "hf"
    result = runner.invoke(app, ["export", str(directory), "--hf-dir", str(folder)])
    assert result.exit_code == 0, result.output
    assert "config.json" in result.output
    assert json.loads((folder / "config.json").read_text())["model_type"] == model.config.model_type
    loaded = type(model).from_pretrained(folder).eval()
    assert torch.equal(_outputs(loaded), _outputs(model))
    for tied, source in TIED[kind]:
        assert loaded.get_parameter(tied) is loaded.get_parameter(source)


def test_keep_prefix_and_clear_errors(tmp_path: Path) -> None:
    model, directory = _saved(tmp_path, "gpt2")
    out = tmp_path / "full.safetensors"
    kept = runner.invoke(
        app, ["export", str(directory), "-o", str(out), "--prefix", "model.", "--keep-prefix"]
    )
    assert kept.exit_code == 0, kept.output
    assert set(load_file(out)) == {f"model.{k}" for k in model.state_dict()}
    both = runner.invoke(app, ["export", str(directory), "-o", str(out), "--hf-dir", str(tmp_path / "x")])
    assert both.exit_code != 0 and "one of --output FILE and --hf-dir FOLDER" in both.output
    none = runner.invoke(app, ["export", str(directory), "-o", str(out), "--prefix", "nothing."])
    assert none.exit_code != 0 and "no tensors under prefix 'nothing.'" in none.output


# ----------------------------------------------------------------------------- what stands at an output


def _numpy_run(directory: Path) -> Path:
    """A committed step with a model tensor and an ``hf_config``: what --hf-dir exports."""
    with cs.CheckpointManager(directory, async_save=False) as mgr:
        mgr.save(1, {"model": {"w": np.arange(16.0)}, "hf_config": {"model_type": "gpt2", "n_layer": 1}})
    return directory


def _plant(kind: str, where: Path, victim: Path) -> None:
    if kind == "symlink":
        os.symlink(victim, where)
    elif kind == "fifo":
        os.mkfifo(where)
    else:
        os.link(victim, where)  # a hard link: a regular file that is also the committed manifest


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["symlink", "fifo", "hardlink"])
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "-o"])
def test_export_never_writes_through_what_stands_at_an_output(tmp_path: Path, kind: str, name: str) -> None:
    """A config.json linked to a committed step's manifest was written through (the step then failed
    verification); a FIFO there hung the export. A link, FIFO or directory is refused untouched; a
    regular file is replaced by a rename, so even a hard link to a manifest leaves the manifest whole."""
    ckpt = _numpy_run(tmp_path / "ckpt")
    victim = step_dir(ckpt, 1) / "manifest.json"
    before = victim.read_bytes()
    folder = tmp_path / "hf"
    folder.mkdir()
    target = folder / ("out.safetensors" if name == "-o" else name)
    _plant(kind, target, victim)
    args = ["-o", str(target)] if name == "-o" else ["--hf-dir", str(folder)]
    result = within(20, lambda: runner.invoke(app, ["export", str(ckpt), *args]))
    assert victim.read_bytes() == before and cs.verify(ckpt).ok
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no private folder left
    if kind == "hardlink":
        assert result.exit_code == 0, result.output
        assert not os.path.samefile(target, victim) and os.stat(victim).st_nlink == 1
        written = target if name == "-o" else folder / "model.safetensors"
        assert set(load_file(written)) == ({"model.w"} if name == "-o" else {"w"})
    else:
        what = "a symbolic link" if kind == "symlink" else "a FIFO"
        assert result.exit_code == 2 and f"is {what}, not a file" in result.output, result.output
        assert target.is_symlink() if kind == "symlink" else target.is_fifo()
        assert sorted(p.name for p in folder.iterdir()) == [target.name]  # nothing else was written


def test_export_of_a_symlink_loop_is_a_clear_error(tmp_path: Path) -> None:
    """It was a RuntimeError traceback ("Symlink loop from ...")."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    ckpt = _numpy_run(tmp_path / "ckpt")
    cases = [
        ["export", str(loop), "-o", str(tmp_path / "x.safetensors")],
        ["export", str(loop), "--hf-dir", str(tmp_path / "hf")],
        ["export", str(ckpt), "-o", str(loop)],
        ["export", str(ckpt), "-o", str(loop / "x.safetensors")],
        ["export", str(ckpt), "--hf-dir", str(loop)],
    ]
    for args in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "error:" in result.output, (args, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert loop.is_symlink() and cs.verify(ckpt).ok


@pytest.mark.parametrize("how", [["-o", "out.safetensors"], ["--hf-dir", "hf"]])
def test_export_without_safetensors_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: list[str]
) -> None:
    """A plain ``pip install crashsafe`` has the command but not safetensors (it comes with the torch
    extra): export read the whole step, then failed on a ModuleNotFoundError traceback."""
    ckpt = _numpy_run(tmp_path / "ckpt")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors fails, as where missing
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["export", str(ckpt), *how])
    assert result.exit_code == 2 and "pip install 'crashsafe[torch]'" in " ".join(result.output.split())
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing written, no folder made
