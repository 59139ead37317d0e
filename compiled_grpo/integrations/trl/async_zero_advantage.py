"""Samples at advantage 0 in TRL's async GRPO trainer: packed apart, forwarded without grad (or not at all).

TRL's async trainer packs a rank's samples into one prefix trie (a token several samples share is forwarded
once), and its loss over a sample is its advantage times a finite factor: a sample at advantage 0 adds nothing to
any gradient. `SplitCollator` packs each rank's samples twice, as TRL packs them: the samples with a gradient into
the row the model runs with grad (TRL's keys), the others into a second row (keys prefixed `zero/`) that runs
without grad ("backward": the loss and its metrics still cover every loss term) or not at all ("all": the metrics
cover the samples with a gradient). The normalizer is TRL's trained-token count of the whole micro-batch, so the
loss and gradients are TRL's. The collator sees every rank's row (rank 0 packs the micro-batch for all), so it
plans one set of calls for all ranks: a rank without a sample with a gradient moves one of its others into that
row (its loss is 0), and where any rank has a second row, every rank has one (a copy of one of its samples, its
loss terms dropped: `zero/stand_in`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from trl.experimental.async_grpo import async_grpo_trainer
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
from trl.experimental.async_grpo.packing import TreeRow

from . import zero_advantage

ZERO = "zero/"
PADDING = {"shift_labels": -100, "token_index": -1, "tree_kv_index": -1, "tree_cu_seqlens_q": -1,
           "tree_cu_seqlens_k": -1}  # fmt: skip


def row_of(samples: list[dict]) -> TreeRow:
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return row


def split_samples(rows: list[TreeRow], forward_untrained: bool) -> tuple[list, list, list, list] | None:
    """Each rank's (samples with a gradient, samples at advantage 0), stand-ins placed so every rank runs the same
    calls, whether its first row holds only a stand-in and whether its second row is one; None when no rank has a
    sample at advantage 0."""
    trained = [[s for s in row.samples if s["advantage"] != 0] for row in rows]
    zero = [[s for s in row.samples if s["advantage"] == 0] for row in rows]
    if not any(zero):
        return None
    first_stand_in = [not t for t in trained]
    for t, z in zip(trained, zero, strict=True):
        if not t:  # a forward with grad on every rank (its backward reduces the gradients): one sample, loss 0
            t.append(z.pop(0))
    stand_in = [forward_untrained and not z for z in zero]
    zero = [z or ([t[0]] if forward_untrained else []) for t, z in zip(trained, zero, strict=True)]
    return trained, zero, first_stand_in, stand_in


def padded(packs: list[dict], pad_token_id: int) -> dict:
    """The packs of every rank as one rectangular batch (row i: rank i), padded as TRL's collator pads them."""

    def pad(tensors, value):
        return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=value)

    padding = {**PADDING, "input_ids": pad_token_id}
    batch = {key: pad([p[key] for p in packs], padding.get(key, 0)) for key in packs[0]}
    batch["attention_mask"] = pad([torch.ones_like(p["input_ids"]) for p in packs], 0)
    return batch


@dataclass
class SplitCollator(DataCollatorForRollout):
    """TRL's collator (its batch, accounting and logged metrics for the whole micro-batch), with each rank's row
    packed apart by advantage (`split_samples`)."""

    forward_untrained: bool = True

    def torch_call(self, examples):
        batch = super().torch_call(examples)
        (rows,) = examples
        split = split_samples(rows, self.forward_untrained)
        self.log_skipped(rows, split)
        if split is None:
            return batch
        trained, zero, first_stand_in, stand_in = split
        batch.update(padded([row_of(t).pack() for t in trained], self.pad_token_id))
        # "all": a row with nothing to train holds one sample at advantage 0, whose terms count nowhere
        batch[ZERO + "first_stand_in"] = torch.tensor(first_stand_in) & (not self.forward_untrained)
        if self.forward_untrained:
            second = padded([row_of(z).pack() for z in zero], self.pad_token_id)
            batch.update({ZERO + key: value for key, value in second.items()})
            batch[ZERO + "stand_in"] = torch.tensor(stand_in)
        return batch

    def log_skipped(self, rows: list[TreeRow], split) -> None:
        """The shares of the micro-batch's samples that skip their backward and their forward (every rank's: this
        collator packs them all), into the trainer's metric sink as TRL's collator logs its own."""
        total = sum(len(row.samples) for row in rows)
        skipped = 0 if split is None else sum(1 for row in rows for s in row.samples if s["advantage"] == 0)
        skipped -= 0 if split is None else sum(split[2])  # moved into a row with grad (a rank with nothing else)
        self.metrics["zero_advantage/skipped_backward"].append(skipped / total)
        self.metrics["zero_advantage/skipped_forward"].append(0.0 if self.forward_untrained else skipped / total)


def second_row(inputs: dict) -> dict | None:
    """The batch of the second row (keys without their prefix), or None when there is none."""
    if ZERO + "input_ids" not in inputs:
        return None
    return {key.removeprefix(ZERO): value for key, value in inputs.items() if key.startswith(ZERO)}


def first_row_counts(inputs: dict) -> bool:
    """Whether the first row's loss terms count (not where it holds only a stand-in under "all")."""
    flag = inputs.get(ZERO + "first_stand_in")
    return flag is None or not bool(flag[0])


@contextlib.contextmanager
def split_collator(forward_untrained: bool):
    """TRL's async trainer builds its dataloader with `SplitCollator` inside this block."""
    original = async_grpo_trainer.DataCollatorForRollout
    async_grpo_trainer.DataCollatorForRollout = functools.partial(SplitCollator, forward_untrained=forward_untrained)
    try:
        yield
    finally:
        async_grpo_trainer.DataCollatorForRollout = original


def reason_not_to_split(trainer, mode, hidden_size: int) -> str | None:
    """Why this trainer never packs the samples at advantage 0 apart (None: it does), said once where a setting
    prevents it (the MoE auxiliary loss covers every sample)."""
    if mode is False:
        return "skip_zero_advantage=False"
    if trainer.aux_loss_enabled:
        why = "the MoE auxiliary loss covers every sample of the row"
        zero_advantage.say_once(trainer, f"samples at advantage 0 run their backward as the others: {why}")
        return why
    if mode == "auto" and hidden_size < zero_advantage.AUTO_HIDDEN_SIZE:
        return f"skip_zero_advantage='auto' at hidden size {hidden_size} < {zero_advantage.AUTO_HIDDEN_SIZE}"
    return None
