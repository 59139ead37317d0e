"""A script for `accelerate launch` (tests/test_accelerate.py): GRPOTrainer and CompiledGRPOTrainer, each trained
3 steps from the same tiny random model on the ranks accelerate started; rank 0 writes each step's loss,
gradient norm and entropy, and which distributed type accelerate set up, to OUT/<trainer>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from test_integration_trl import digit_reward, tiny_model, tokenizer
from trl import GRPOConfig, GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer

LOGGED = ("loss", "grad_norm", "entropy")


def train(name: str, out: Path) -> None:
    model = tiny_model(dtype=torch.float32)
    args = GRPOConfig(output_dir=str(out / name), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=3, learning_rate=5e-2, logging_steps=1, report_to=[],
                      use_cpu=True, save_strategy="no", bf16=False, seed=0)  # fmt: skip
    data = Dataset.from_dict({"prompt": ["a b c", "d e f", "1 2 a", "g h i"] * 4})
    cls, extra = (GRPOTrainer, {}) if name == "grpo" else (CompiledGRPOTrainer, {"compiled": False})
    trainer = cls(model=model, reward_funcs=digit_reward, args=args, train_dataset=data, processing_class=tokenizer(),
                  **extra)  # fmt: skip
    trainer.train()
    if trainer.accelerator.is_main_process:
        steps = [{k: h[k] for k in LOGGED} for h in trainer.state.log_history if "loss" in h]
        ranks = trainer.accelerator.num_processes
        kind = str(trainer.accelerator.distributed_type)
        (out / f"{name}.json").write_text(json.dumps({"ranks": ranks, "distributed_type": kind, "steps": steps}))


if __name__ == "__main__":
    for trainer_name in ("grpo", "compiled"):
        train(trainer_name, Path(sys.argv[1]))
