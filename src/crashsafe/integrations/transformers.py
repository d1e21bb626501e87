"""Hugging Face transformers: a ``Trainer`` whose checkpoints are crashsafe steps (docs/integrations.md).

``CrashsafeTrainer(model, args, ...)`` is a ``transformers.Trainer``: wherever HF would write a
``checkpoint-N`` folder (``save_steps``, ``save_strategy``), it saves model, optimizer, scheduler,
GradScaler, RNG states, the trainer state and the model config as crashsafe step N instead: the
loop waits only for a memcpy, the step commits atomically, and loads are verified, falling back to
the newest intact step. ``trainer.train(resume_from_checkpoint=True)`` resumes from it through HF's
own resume path (data position included: HF skips the batches already trained), so a resumed run
matches an uninterrupted one bit for bit on CPU. With ``policy=`` in ``manager_options`` the
crashsafe policy (and SIGTERM) decides when to save instead of ``save_steps``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.optim.lr_scheduler import LambdaLR
from transformers import (
    EvalPrediction,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from crashsafe._log import through
from crashsafe.errors import CrashsafeError, InvalidArgumentError
from crashsafe.manager import CheckpointManager
from crashsafe.state.rebuild import apply_into, check_into
from crashsafe.state.rng import RNGState
from crashsafe.storage.lock import held_by

__all__ = ["CrashsafeTrainer", "CrashsafeTrainerMixin"]

_LOG = logging.getLogger("transformers.trainer")  # where HF's Trainer logs its own checkpoints
_RESUMED = ("model", "optimizer", "scheduler", "rng", "trainer_state")  # what a resume needs of a step
_TRAINER_HOLDS = "a CrashsafeTrainer, which holds its checkpoint_dir until its close(): call trainer.close()"


class CrashsafeTrainerMixin:
    """Makes a ``Trainer`` (or a subclass: ``class T(CrashsafeTrainerMixin, SFTTrainer)``) checkpoint
    with crashsafe.

    Args:
        checkpoint_dir: where the steps go (default ``<output_dir>/crashsafe``; a URL works).
        manager_options: for :class:`~crashsafe.CheckpointManager` (``codec``, ``policy``,
            ``save_on_sigterm``, ``mirror``, ...); ``keep_last`` defaults to ``save_total_limit``.
    """

    def __init__(
        self,
        *args: Any,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        manager_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        hf = self._hf()
        if hf.args.load_best_model_at_end:
            raise CrashsafeError(
                "load_best_model_at_end reads HF checkpoint folders, which CrashsafeTrainer does not "
                "write; turn it off and load the step you want with CheckpointManager.restore"
            )
        options = {"keep_last": hf.args.save_total_limit, **(manager_options or {})}
        if options.get("memory") is not None:
            raise InvalidArgumentError(
                "manager_options has memory=, but CrashsafeTrainer resumes through load(), from the "
                "persistent tier, never from a memory tier: drop memory=, or train with a "
                "CheckpointManager(memory=...) and its restore() (docs/memory.md)"
            )
        output = Path(hf.args.output_dir or "trainer_output")
        directory = checkpoint_dir if checkpoint_dir is not None else output / "crashsafe"
        with held_by(_TRAINER_HOLDS):
            self.checkpoints = CheckpointManager(directory, **options)
        self._resuming: dict[str, Any] | None = None
        self._saved_step: int | None = None
        self._config = _ConfigDict()
        if "policy" in options or options.get("save_on_sigterm"):
            hf.add_callback(_PolicySaves(self.checkpoints))

    def _hf(self) -> Trainer:
        assert isinstance(self, Trainer)
        return self

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        """HF's ``train``; ``resume_from_checkpoint=True`` resumes from the newest intact crashsafe
        step (training starts afresh if there is none), a path from the newest step stored there."""
        hf = self._hf()
        kwargs = {"trial": trial, "ignore_keys_for_eval": ignore_keys_for_eval}
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return self._train_and_wait(None, kwargs)
        if resume_from_checkpoint is True:
            where = self.checkpoints.directory
            with through(_LOG):
                loaded = self.checkpoints.load() if self.checkpoints.latest_step() is not None else None
        else:
            where = os.fspath(resume_from_checkpoint)
            with CheckpointManager(resume_from_checkpoint, read_only=True) as reader, through(_LOG):
                loaded = reader.load()
        if loaded is None:
            return self._train_and_wait(None, kwargs)
        trainer_state = _resumable(loaded, where)
        with tempfile.TemporaryDirectory(prefix="crashsafe-resume-") as folder:
            # HF reads the trainer state (epoch, step, callbacks' state) from trainer_state.json, a
            # JSON file; everything else comes from the loaded step through the hooks below.
            trainer_state.save_to_json(os.path.join(folder, "trainer_state.json"))
            self._resuming = loaded
            try:
                return self._train_and_wait(folder, kwargs)
            finally:
                self._resuming = None
                hf.state.best_model_checkpoint = None  # it named the temporary folder

    def _train_and_wait(self, folder: str | None, kwargs: dict[str, Any]) -> Any:
        output = Trainer.train(self._hf(), resume_from_checkpoint=folder, **kwargs)
        self.checkpoints.wait()  # the last save is durable (or its error raised) when train returns
        return output

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Where HF writes ``checkpoint-N``: save step N (returns after the memcpy)."""
        hf = self._hf()
        unwrapped: Any = hf.model  # the model itself (``model`` may be a wrapper)
        step = hf.state.global_step
        if step == self._saved_step:  # e.g. a step save and an epoch save at one step: same state
            return
        if hf.hp_search_backend is None and trial is None:
            hf.store_flos()
        for callback in [*hf.callback_handler.callbacks, hf.control]:
            _record_callback_state(hf.state, callback)
        state: dict[str, Any] = {
            "model": unwrapped,
            "optimizer": hf.optimizer,
            "scheduler": hf.lr_scheduler,
            "rng": RNGState(),
            "trainer_state": hf.state,
            "hf_config": self._config.of(unwrapped.config),
        }
        scaler = getattr(hf.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        self.checkpoints.save(step, state, _logged_at_this_step(hf.state))
        self._saved_step = step

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """HF's epoch, unless a resumed run already reached ``max_steps``: HF would train one step
        more (its stop check follows a step), so a run killed between committing its last step and
        returning would end one optimizer step past an uninterrupted run."""
        hf = self._hf()
        if self._resuming is not None and hf.state.global_step >= hf.state.max_steps > 0:
            self._load_rng_state(kwargs.get("resume_from_checkpoint"))  # as the skipped epoch would
            hf.control.should_training_stop = True
            return None
        return Trainer._run_epoch(hf, *args, **kwargs)  # type: ignore[no-untyped-call]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._resuming is None:
            Trainer._load_from_checkpoint(self._hf(), resume_from_checkpoint, model)
            return
        _restore(self._resuming, {"model": model if model is not None else self._hf().model})

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._resuming is None or checkpoint is None:
            Trainer._load_optimizer_and_scheduler(self._hf(), checkpoint)
            return
        hf = self._hf()
        _restore(self._resuming, {"optimizer": hf.optimizer, "scheduler": hf.lr_scheduler})

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._resuming is None or checkpoint is None:
            Trainer._load_scaler(self._hf(), checkpoint)
            return
        scaler = getattr(self._hf().accelerator, "scaler", None)
        if scaler is not None and "scaler" in self._resuming:
            _restore(self._resuming, {"scaler": scaler})

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._resuming is None or checkpoint is None:
            Trainer._load_rng_state(self._hf(), checkpoint)
            return
        _restore(self._resuming, {"rng": RNGState()})

    def close(self) -> None:
        """Wait for the pending save and release the checkpoint directory."""
        self.checkpoints.close()


class CrashsafeTrainer(CrashsafeTrainerMixin, Trainer):
    """``transformers.Trainer`` with crashsafe checkpoints: HF's parameters, then ``checkpoint_dir``
    and ``manager_options`` (see :class:`CrashsafeTrainerMixin`)."""

    def __init__(
        self,
        model: PreTrainedModel | torch.nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable[[list[Any]], dict[str, Any]] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable[..., PreTrainedModel] | None = None,
        compute_loss_func: Callable[..., Any] | None = None,
        compute_metrics: Callable[[EvalPrediction], dict[str, Any]] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, LambdaLR | None] = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        manager_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            model_init=model_init,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            checkpoint_dir=checkpoint_dir,
            manager_options=manager_options,
        )


class _ConfigDict:
    """``config.to_dict()``, taken again only when the config changed since the last save: HF's
    ``to_dict`` deep-copies the whole config (35 us for GPT-2's), comparing it with a deep copy of
    the last one seen takes 1 us (and the saves of a run rarely see a change)."""

    def __init__(self) -> None:
        self._seen: tuple[type, dict[str, Any]] | None = None
        self._dict: dict[str, Any] = {}

    def of(self, config: Any) -> dict[str, Any]:
        try:
            same = self._seen is not None and self._seen == (type(config), config.__dict__)
        except Exception:  # a value whose == is not a bool (an array): compare no more
            same = False
        if not same:
            self._dict = config.to_dict()
            self._seen = (type(config), copy.deepcopy(config.__dict__))
        return self._dict


def _restore(loaded: dict[str, Any], live: dict[str, Any]) -> None:
    """Copy the parts of ``loaded`` named in ``live`` into those live objects (checked first)."""
    saved = {key: loaded[key] for key in live}
    check_into(live, saved)
    apply_into(live, saved)


def _resumable(loaded: dict[str, Any], where: str) -> TrainerState:
    """The trainer state of a step loaded to resume from, once the step holds all a resume needs; a
    step that does not (saved by something else, or by another transformers) is a CrashsafeError."""
    step = f"the newest intact step of {where}"
    missing = [key for key in _RESUMED if key not in loaded]
    if missing:
        raise CrashsafeError(
            f"{step} lacks {', '.join(map(repr, missing))}, which CrashsafeTrainer saves with every step: "
            "it was not saved by CrashsafeTrainer. Resume from a directory CrashsafeTrainer wrote, or train "
            "without resume_from_checkpoint and restore what it holds with CheckpointManager.restore"
        )
    saved = loaded["trainer_state"]
    if isinstance(saved, TrainerState):
        return saved
    if not isinstance(saved, dict):
        raise CrashsafeError(f"{step}: its trainer_state is a {type(saved).__name__}, not HF's TrainerState")
    unknown = sorted(map(str, saved.keys() - {f.name for f in dataclasses.fields(TrainerState)}))
    if unknown:
        raise CrashsafeError(
            f"{step}: its trainer_state has fields this transformers ({transformers.__version__}) does not "
            f"know: {', '.join(unknown)}; it was saved by another version. Resume with the transformers "
            "that saved it"
        )
    try:
        return TrainerState(**saved)
    except (TypeError, ValueError) as exc:
        raise CrashsafeError(f"{step}: its trainer_state does not make a TrainerState: {exc}") from None


def _numbers(entry: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a log entry (loss, learning rate, eval_loss, ...), without its "step": the
    crashsafe step of a save is HF's global step itself."""
    return {
        k: float(v)
        for k, v in entry.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _last_logged(state: TrainerState) -> dict[str, float]:
    """The numbers of the last log entry, whatever its step (what a policy decides on)."""
    return _numbers(state.log_history[-1]) if state.log_history else {}


def _logged_at_this_step(state: TrainerState) -> dict[str, float]:
    """What HF logged at the current global step (training and evaluation entries, the later one
    winning a key): the step's metrics; none on a step that logged nothing."""
    metrics: dict[str, float] = {}
    for entry in reversed(state.log_history):
        if entry.get("step") != state.global_step:
            break
        metrics = {**_numbers(entry), **metrics}
    return metrics


def _record_callback_state(state: TrainerState, callback: Any) -> None:
    """What HF's own checkpoints record of an ``ExportableState`` callback (early stopping, ...)."""
    from transformers.trainer_callback import ExportableState

    if not isinstance(callback, ExportableState):
        return
    name = type(callback).__name__
    recorded: Any = state.stateful_callbacks  # a dict of states once TrainerState is built
    if isinstance(recorded.get(name), list):
        recorded[name].append(callback.state())
    else:
        recorded[name] = callback.state()


class _PolicySaves(TrainerCallback):
    """Asks the manager's policy after every optimizer step (and saves at once after SIGTERM)."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        context = self.manager.context(state.global_step, _last_logged(state))
        if self.manager.preempted or self.manager.policy.should_save(context):
            control.should_save = True
