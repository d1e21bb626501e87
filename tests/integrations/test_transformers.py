"""Hugging Face Trainer with crashsafe: resume after real SIGKILLs (bit-identical), tied weights
stored once and restored shared, policy-driven saves, a LoRA fine-tune whose frozen base is saved
once."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainerCallback
from transformers.utils import logging as hf_logging
from typer.testing import CliRunner

import crashsafe as cs
from crashsafe.cli.app import app
from crashsafe.integrations.transformers import CrashsafeTrainer
from crashsafe.state.unchanged import MIN_BYTES
from crashsafe.workloads import hf_tiny

from .conftest import kill_after_commits, run_to_end

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
hf_logging.set_verbosity_error()


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


def _craft_step(directory: Path, step: int, change: Callable[[dict[str, Any]], None]) -> None:
    """Save ``step`` as a copy of the newest step with ``change`` made to it (a store another program
    or another transformers wrote)."""
    with cs.CheckpointManager(directory, keep_last=None, async_save=False) as mgr:
        state = mgr.load()
        change(state)
        mgr.save(step, state)


def test_a_step_that_cannot_resume_a_trainer_is_refused_naming_what_it_lacks(tmp_path: Path) -> None:
    """A step without ``trainer_state`` (KeyError) or whose trainer_state has a field this
    transformers does not know (TypeError): each a crashsafe error saying what is wrong."""
    done = _trainer(tmp_path, 4, 4)
    done.train()
    done.close()
    store = tmp_path / "crashsafe"

    def future(state: dict[str, Any]) -> None:
        state["trainer_state"] = {**dataclasses.asdict(state["trainer_state"]), "from_the_future": 1}

    cases = [
        (lambda state: state.pop("trainer_state"), "lacks 'trainer_state'.*not saved by CrashsafeTrainer"),
        (lambda state: state.pop("optimizer"), "lacks 'optimizer'"),
        (future, r"fields this transformers \(.*\) does not know: from_the_future"),
        (lambda state: state.update(trainer_state=[1]), "trainer_state is a list, not HF's TrainerState"),
    ]
    for change, problem in cases:
        _craft_step(store, 8, change)
        again = _trainer(tmp_path, 12, 4)
        with pytest.raises(cs.CrashsafeError, match=problem):
            again.train(resume_from_checkpoint=True)
        again.close()
        with cs.CheckpointManager(store, keep_last=None) as mgr:
            mgr.delete([8])


def test_steps_record_what_was_logged_at_them_and_ls_shows_one_step_column(tmp_path: Path) -> None:
    """HF logs every 4 steps, saves every 2: a step saved where nothing was logged records no
    metrics (it repeated the last log's), and no metric named "step" (HF's log entries carry one,
    which `crashsafe ls` showed beside the step, disagreeing with it). The step is HF's global step."""
    trainer = CrashsafeTrainer(
        model=hf_tiny.tiny_gpt2(),
        args=hf_tiny.training_args(tmp_path, 8, 2, logging_steps=4),
        train_dataset=hf_tiny.TokenData(),
    )
    trainer.train()
    trainer.close()
    with cs.CheckpointManager(tmp_path / "crashsafe", read_only=True) as mgr:
        assert mgr.steps() == [2, 4, 6, 8]  # keep_last is save_total_limit (None): all kept
        metrics = {step: mgr.manifest(step).metrics for step in mgr.steps()}
        assert all(mgr.load(step)["trainer_state"].global_step == step for step in mgr.steps())
    assert metrics[2] == metrics[6] == {}
    logged = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    for step in (4, 8):
        assert "step" not in metrics[step] and metrics[step]["loss"] == logged[step]["loss"]
    result = CliRunner().invoke(app, ["ls", str(tmp_path / "crashsafe")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = [line.split() for line in result.output.splitlines()]
    header = next(words for words in lines if "loss" in words)
    assert header.count("step") == 1
    loss = header.index("loss")
    rows = {words[0]: words for words in lines if words[:1] in (["2"], ["4"])}
    assert rows["2"][loss] == "-" and rows["4"][loss] == f"{logged[4]['loss']:.4g}"


def test_the_trainer_spells_out_hfs_parameters() -> None:
    """``CrashsafeTrainer(*args, **kwargs)`` hid HF's parameters from IDEs and type checkers."""
    ours = inspect.signature(CrashsafeTrainer).parameters
    hf = inspect.signature(Trainer).parameters
    assert not [p for p in ours.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert list(ours) == [*hf, "checkpoint_dir", "manager_options"]
    assert all(ours[name].default == p.default and ours[name].kind == p.kind for name, p in hf.items())
    assert ours["checkpoint_dir"].kind is inspect.Parameter.KEYWORD_ONLY


def test_a_resume_is_told_through_hfs_trainer_logger(tmp_path: Path) -> None:
    done = _trainer(tmp_path, 4, 4)
    done.train()
    done.close()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    hf_logger = logging.getLogger("transformers.trainer")
    hf_logger.addHandler(handler)
    level = hf_logger.level
    hf_logger.setLevel(logging.INFO)
    try:
        again = _trainer(tmp_path, 4, 4)
        again.train(resume_from_checkpoint=True)
        again.close()
    finally:
        hf_logger.removeHandler(handler)
        hf_logger.setLevel(level)
    mine = [r.getMessage() for r in records if r.getMessage().startswith("crashsafe:")]
    assert mine == [f"crashsafe: resumed from step 4 ({tmp_path / 'crashsafe'}, {mine[0].split(', ')[-1]}"]


def test_a_second_trainer_on_one_directory_is_told_to_close_the_first(tmp_path: Path) -> None:
    first = _trainer(tmp_path, 4, 4)
    held = r"in this very process .*a CrashsafeTrainer.*trainer\.close\(\)"
    with pytest.raises(cs.LockedError, match=held):
        _trainer(tmp_path, 4, 4)
    first.close()
    _trainer(tmp_path, 4, 4).close()


def test_a_memory_tier_it_would_never_restore_from_is_refused(tmp_path: Path) -> None:
    """The trainer resumes through ``load`` (the persistent tier): a memory tier given in
    ``manager_options`` would be saved to and never restored from, so it is refused, naming the way
    out, before any directory is made."""
    memory = tmp_path / "mem"
    with pytest.raises(cs.InvalidArgumentError, match=r"memory=.*restore\(\)"):
        _trainer(tmp_path, 4, 4, manager_options={"memory": cs.MemoryTier(memory)})
    assert not memory.exists()


def _lora(seed: int) -> Any:
    """A 2-layer Llama of width 256 (frozen weights of 256 and 512 KiB) with LoRA on q and v (peft)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    return get_peft_model(LlamaForCausalLM(config), lora)


class _Steps(TrainerCallback):  # type: ignore[misc]
    """Records the optimizer steps a run trains; stops it after step ``stop``."""

    def __init__(self, stop: int | None = None) -> None:
        self.stop = stop
        self.trained: list[int] = []

    def on_step_end(self, args: object, state: Any, control: Any, **kwargs: object) -> None:
        self.trained.append(state.global_step)
        if state.global_step == self.stop:
            control.should_training_stop = True


def _fine_tune(directory: Path, steps: _Steps, seed: int = 0, **kwargs: Any) -> CrashsafeTrainer:
    trainer = CrashsafeTrainer(
        model=_lora(seed), args=hf_tiny.training_args(directory, 8, 2), train_dataset=hf_tiny.TokenData(),
        callbacks=[steps], **kwargs,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=True)
    trainer.close()
    return trainer


def _references(directory: Path) -> dict[int, dict[str, int]]:
    with cs.CheckpointManager(directory / "crashsafe", read_only=True) as mgr:
        manifests = {step: mgr.manifest(step) for step in mgr.steps()}
    return {step: {p.path: p.ref for p in m.payloads if p.ref is not None} for step, m in manifests.items()}


def test_a_lora_fine_tune_saves_its_frozen_base_once_and_resumes_bit_identical(tmp_path: Path) -> None:
    """After the first save each step refers to the frozen base and owns only the trainable part
    (adapters, Adam's moments, scheduler, RNG, trainer state); a fresh model and trainer resume from
    a run stopped half-way and end bit for bit where the uninterrupted run did."""
    whole = _fine_tune(tmp_path / "whole", _Steps())
    model, optimizer = whole.model, whole.optimizer
    named = dict(model.named_parameters())
    frozen = {f"model.{n}" for n, p in named.items() if not p.requires_grad and p.nbytes >= MIN_BYTES}
    base = sum(p.nbytes for p in named.values() if not p.requires_grad)
    moments = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    trainable = sum(p.nbytes for p in named.values() if p.requires_grad) + sum(t.nbytes for t in moments)
    assert len(frozen) == 16 and trainable < base // 20  # embeddings, head, 7 projections a layer
    references = _references(tmp_path / "whole")
    assert references[2] == {} and all(references[s] == dict.fromkeys(frozen, 2) for s in (4, 6, 8))
    with cs.CheckpointManager(tmp_path / "whole" / "crashsafe", read_only=True) as mgr:
        owned = {step: mgr.manifest(step).stored_nbytes for step in mgr.steps()}
        assert all(torch.equal(mgr.load(8)["model"][k], v) for k, v in model.state_dict().items())
    assert owned[2] > base
    assert all(trainable < owned[s] < 1.5 * trainable + 32 * 1024 for s in (4, 6, 8))

    stopped = _Steps(stop=4)
    _fine_tune(tmp_path / "resumed", stopped)
    later = _Steps()
    again = _fine_tune(tmp_path / "resumed", later, seed=1)  # another init: the step's weights must win
    assert stopped.trained == [1, 2, 3, 4] and later.trained == [5, 6, 7, 8]
    assert hf_tiny.digest(again.model, again.optimizer) == hf_tiny.digest(model, optimizer)
    references = _references(tmp_path / "resumed")  # a new process proves nothing yet: step 6 owns all
    assert references[6] == {} and references[8] == dict.fromkeys(frozen, 6)
    assert cs.verify(tmp_path / "resumed" / "crashsafe").ok

    _fine_tune(tmp_path / "off", _Steps(stop=4), manager_options={"unchanged": False})
    assert _references(tmp_path / "off") == {2: {}, 4: {}}
