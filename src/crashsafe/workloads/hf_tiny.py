"""Tiny Hugging Face models built from configs (no download) and a GPT-2 trained by ``CrashsafeTrainer``.

Used by the integration tests (killed and resumed, exported) and ``bench/integrations.py``. The
training data are seeded random token sequences; HF's seeded sampler and its skipping of trained
batches give the data position, and dropout draws from torch's RNG, which the checkpoint restores.

``python -m crashsafe.workloads.hf_tiny DIR --steps 40`` trains (resuming from DIR/crashsafe if it
holds a step) and writes the final weights' digest to DIR/final.txt.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["TokenData", "main", "tiny_bert", "tiny_gpt2", "training_args"]


def tiny_gpt2(seed: int = 0) -> Any:
    """GPT-2 with 2 layers of width 64 over 512 tokens; ``lm_head`` is tied to ``wte``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=64))


def tiny_bert(seed: int = 0) -> Any:
    """BERT for masked LM with 2 layers of width 64 over 512 tokens (decoder tied to the embeddings)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
    )
    return BertForMaskedLM(config)


class TokenData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` seeded random token sequences; a causal LM learns to continue them."""

    def __init__(self, n: int = 256, length: int = 32, vocab: int = 512, seed: int = 0) -> None:
        self.tokens = torch.from_numpy(np.random.default_rng(seed).integers(0, vocab, (n, length)))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def training_args(directory: Path, max_steps: int, save_steps: int, **overrides: Any) -> Any:
    """Quiet, deterministic CPU arguments that save every ``save_steps`` steps."""
    from transformers import TrainingArguments

    options: dict[str, Any] = {
        "output_dir": str(directory),
        "max_steps": max_steps,
        "save_steps": save_steps,
        "save_strategy": "steps",
        "per_device_train_batch_size": 8,
        "learning_rate": 1e-3,
        "warmup_steps": 5,
        "logging_steps": 5,
        "seed": 0,
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        **overrides,
    }
    return TrainingArguments(**options)


def digest(model: Any, optimizer: Any) -> str:
    """sha256 of the weights and the optimizer state, bit for bit."""
    h = hashlib.sha256()
    tensors = [*model.state_dict().values()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    for tensor in tensors:
        h.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging

    from crashsafe.integrations.transformers import CrashsafeTrainer

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    trainer = CrashsafeTrainer(
        model=tiny_gpt2(),
        args=training_args(args.directory, args.steps, args.every),
        train_dataset=TokenData(),
    )
    trainer.train(resume_from_checkpoint=True)
    trainer.close()
    (args.directory / "final.txt").write_text(digest(trainer.model, trainer.optimizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
