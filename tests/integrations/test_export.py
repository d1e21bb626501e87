"""Exports people can load: GPT-2 and BERT saved by crashsafe, exported with the prefix stripped,
load with ``load_state_dict(strict=True)`` and with ``from_pretrained``, tied weights tied."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import crashsafe as cs
from crashsafe.cli.app import app
from crashsafe.workloads import hf_tiny

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
