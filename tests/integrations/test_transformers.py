"""Hugging Face Trainer with crashsafe: resume after real SIGKILLs (bit-identical), tied weights
stored once and restored shared, policy-driven saves."""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import TrainerCallback
from transformers.utils import logging

import crashsafe as cs
from crashsafe.integrations.transformers import CrashsafeTrainer
from crashsafe.workloads import hf_tiny

from .conftest import kill_after_commits, run_to_end

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
logging.set_verbosity_error()


def _trainer(directory: Path, steps: int, every: int, **kwargs: object) -> CrashsafeTrainer:
    return CrashsafeTrainer(
        model=hf_tiny.tiny_gpt2(),
        args=hf_tiny.training_args(directory, steps, every),
        train_dataset=hf_tiny.TokenData(),
        **kwargs,  # type: ignore[arg-type]
    )


def test_sigkilled_run_resumes_bit_identical(tmp_path: Path) -> None:
    steps = ["--steps", "60", "--every", "3"]
    run_to_end(hf_tiny.main, [str(tmp_path / "whole"), *steps])
    store = tmp_path / "killed" / "crashsafe"
    argv = [str(tmp_path / "killed"), *steps]
    assert kill_after_commits(hf_tiny.main, argv, store, 3, random.Random(os.urandom(2))) == 3
    assert (tmp_path / "killed" / "final.txt").read_text() == (tmp_path / "whole" / "final.txt").read_text()
    assert cs.verify(store).ok


def test_a_run_resumed_at_max_steps_trains_no_further(tmp_path: Path) -> None:
    """A kill after the last step committed, before the run returned: the rerun must not train
    (HF's stop check follows a step: it took one more at learning rate 0, Adam's moments moved)."""
    done = _trainer(tmp_path, 8, 4)
    done.train()
    done.close()
    again = _trainer(tmp_path, 8, 4)
    again.train(resume_from_checkpoint=True)
    again.close()
    assert again.state.global_step == 8
    assert hf_tiny.digest(again.model, again.optimizer) == hf_tiny.digest(done.model, done.optimizer)
    with cs.CheckpointManager(tmp_path / "crashsafe", read_only=True) as mgr:
        assert mgr.steps() == [4, 8]
    longer = _trainer(tmp_path, 12, 4)  # a larger max_steps trains on from the step
    longer.train(resume_from_checkpoint=True)
    longer.close()
    assert longer.state.global_step == 12


def test_tied_weights_are_stored_once_and_load_shared(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, 4, 4)
    trainer.train()
    trainer.close()
    with cs.CheckpointManager(tmp_path / "crashsafe", read_only=True) as mgr:
        paths = [p.path for p in mgr.manifest(4).payloads]
        assert "model.transformer.wte.weight" in paths and "model.lm_head.weight" not in paths
        saved = mgr.load(4)["model"]
        assert saved["lm_head.weight"].data_ptr() == saved["transformer.wte.weight"].data_ptr()
        fresh = {"model": hf_tiny.tiny_gpt2(seed=1)}
        mgr.restore(fresh)
    model = fresh["model"]
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, trainer.model.lm_head.weight)


def test_no_checkpoint_starts_afresh_and_a_policy_decides_when_to_save(tmp_path: Path) -> None:
    trainer = CrashsafeTrainer(
        model=hf_tiny.tiny_gpt2(),
        args=hf_tiny.training_args(tmp_path, 15, 1, save_strategy="no"),  # HF itself never saves
        train_dataset=hf_tiny.TokenData(),
        checkpoint_dir=tmp_path / "c",
        manager_options={"policy": cs.policies.EverySteps(7)},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=True)
    trainer.close()
    with cs.CheckpointManager(tmp_path / "c", read_only=True) as mgr:
        assert mgr.steps() == [7, 14]
        state = mgr.load()
    assert state["trainer_state"].global_step == 14
    assert state["hf_config"]["n_embd"] == 64


def test_a_config_changed_in_training_is_saved_as_it_is_at_each_save(tmp_path: Path) -> None:
    """The config is taken again only when it changed: a new field, a nested dict changed in place
    and an array changed in place (whose comparison has no truth value) each reach the next step."""

    class Edit(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
            config, step = trainer.model.config, trainer.state.global_step
            if step == 5:
                config.task_specific_params = {"x": {"y": 1}}
            elif step == 9:
                config.task_specific_params["x"]["y"] = 2
                config.scale = np.array([1.0, 2.0])
            elif step == 13:
                config.scale[0] = 3.0

    trainer = _trainer(tmp_path, 16, 4, callbacks=[Edit()])
    trainer.train()
    trainer.close()
    with cs.CheckpointManager(tmp_path / "crashsafe", read_only=True, keep_last=None) as mgr:
        saved = {step: mgr.load(step)["hf_config"] for step in mgr.steps()}
    assert sorted(saved) == [4, 8, 12, 16]
    assert saved[4].get("task_specific_params") is None and "scale" not in saved[8]
    assert saved[8]["task_specific_params"] == {"x": {"y": 1}}
    assert saved[12]["task_specific_params"] == {"x": {"y": 2}} and list(saved[12]["scale"]) == [1.0, 2.0]
    assert list(saved[16]["scale"]) == [3.0, 2.0]
