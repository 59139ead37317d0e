"""A script for `accelerate launch` (tests/test_accelerate.py): GRPOTrainer and CompiledGRPOTrainer, each trained
a few steps from the same tiny random model on the ranks accelerate started; rank 0 writes each step's loss,
gradient norm and entropy, and which distributed type accelerate set up, to OUT/<trainer>.json.

`python accelerate_run.py OUT` trains on the usual digit reward. `python accelerate_run.py OUT zero` gives the
completions of one rank, taking turns, reward 0 (its micro-batches wholly at advantage 0), and half of the other
rank's too, with gradient accumulation 2, then trains CompiledGRPOTrainer skipping their backward ("backward")
and their forward ("all"); every rank writes how many of its rows were at advantage 0 in each micro-batch to
OUT/<trainer>-rank<r>-zeros.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from test_integration_trl import digit_reward, tiny_model, tokenizer
from trl import GRPOConfig, GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, padding_free, plan, zero_advantage

LOGGED = ("loss", "grad_norm", "entropy", "shared_prompts/saved_tokens")
TRAINERS = {"dense": ("grpo", "compiled"), "zero": ("grpo", "skip-backward", "skip-all"), "long": ("grpo", "compiled"),
            "long-shared": ("grpo", "compiled")}  # fmt: skip


class ZeroOnOneRank:
    """A reward that is 0 for every completion of one rank (rank 0 at the first generation, then the other, in
    turn) and for the first half of the other rank's; elsewhere a digest of the completion's characters."""

    __name__ = "zero_on_one_rank"

    def __init__(self):
        self.calls = 0

    def __call__(self, completions, **kwargs):
        rank = torch.distributed.get_rank()
        zero_rank, self.calls = self.calls % 2, self.calls + 1
        half = len(completions) // 2
        return [0.0 if rank == zero_rank or i < half else float(sum(map(ord, c)) % 7) for i, c in
                enumerate(completions)]  # fmt: skip


def record_zero_rows(name: str, out: Path) -> list:
    """Each micro-batch's (rows at advantage 0, rows) on this rank, as the trainer planned it (from the rows its
    generation batch found at 0)."""
    seen, plan_rows = [], zero_advantage.plan_rows

    def recording(trainer, inputs, forward_untrained):
        zero = inputs[plan.PLAN].zero.zero
        seen.append([int(zero.sum()), zero.numel()])
        return plan_rows(trainer, inputs, forward_untrained)

    zero_advantage.plan_rows = recording
    return seen


def count_packed_forwards() -> list:
    """A list that grows by one at each packed forward of the trainer's loss."""
    calls, packed_forward = [], padding_free.packed_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return packed_forward(*args, **kwargs)

    padding_free.packed_forward = counting
    return calls


def train(name: str, out: Path, scenario: str) -> None:
    model = tiny_model(dtype=torch.float32)
    zero = scenario == "zero"
    extra_args = {"gradient_accumulation_steps": 2, "optim": "sgd"} if zero else {}
    extra_args["max_completion_length"] = 6
    if scenario.startswith("long"):  # rank 0's completions up to 24 tokens, rank 1's at most 3: unlike lengths
        rank = int(os.environ.get("RANK", "0"))
        extra_args = {"gradient_accumulation_steps": 2, "optim": "sgd", "max_completion_length": 24,
                      "generation_kwargs": {"max_new_tokens": 24 if rank == 0 else 3}}  # fmt: skip
    args = GRPOConfig(output_dir=str(out / name), per_device_train_batch_size=4, num_generations=4, max_steps=3,
                      learning_rate=5e-2, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                      bf16=False, seed=0, **extra_args)  # fmt: skip
    data = Dataset.from_dict({"prompt": ["a b c", "d e f", "1 2 a", "g h i"] * 4})
    cls, extra = (GRPOTrainer, {}) if name == "grpo" else (CompiledGRPOTrainer, {"compiled": False})
    if scenario.startswith("long") and name != "grpo":
        extra["padding_free"] = "pack"  # "auto" trims on the CPU
        extra["share_prompts"] = scenario == "long-shared"  # and regrouped by prompt
    if name.startswith("skip-"):
        extra["skip_zero_advantage"] = name.removeprefix("skip-")
    reward = ZeroOnOneRank() if zero else digit_reward
    trainer = cls(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer(),
                  **extra)  # fmt: skip
    seen = record_zero_rows(name, out) if zero else []
    packed = count_packed_forwards()
    trainer.train()
    rank = trainer.accelerator.process_index
    if zero:
        (out / f"{name}-rank{rank}-zeros.json").write_text(json.dumps(seen))
    if trainer.accelerator.is_main_process:
        steps = [{k: h.get(k) for k in LOGGED} for h in trainer.state.log_history if "loss" in h]
        ranks = trainer.accelerator.num_processes
        kind = str(trainer.accelerator.distributed_type)
        record = {"ranks": ranks, "distributed_type": kind, "steps": steps, "packed_forwards": len(packed)}
        (out / f"{name}.json").write_text(json.dumps(record))


def end_launch() -> None:
    """End a launched rank once its results are written. The interpreter's own teardown aborts now and then on the
    CPU ("terminate called without an active exception", after every step has run): gloo's worker threads outlive
    the interpreter where a group is left alive (pytorch/pytorch#190489), which would fail a launch whose numbers
    are all in."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    which = sys.argv[2] if len(sys.argv) > 2 else "dense"
    for trainer_name in TRAINERS[which]:
        train(trainer_name, Path(sys.argv[1]), which)
    end_launch()
