"""A generation batch regrouped by gradient: its sequences with a gradient fill as few micro-batches as they can.

TRL's GRPOTrainer generates one batch for `steps_per_generation` micro-batches and slices it in order. Under
`skip_zero_advantage="all"` a sequence at advantage 0 runs nothing, so gathering the sequences with a gradient
into the first micro-batches of each optimizer step leaves the last ones with nothing to run (`zero_advantage`).
This is exact where a sequence's weight in the loss does not depend on which micro-batch of its optimizer step
holds it: grpo, sapo and luspo divide by the micro-batch's sequence count (equal in every micro-batch), dr_grpo by
B x max_completion_length, dapo, cispo and vespo by the generation batch's token count. Not regrouped: bnpo (its
normalizer is the micro-batch's token count), `top_entropy_quantile < 1` (the threshold is the micro-batch's), and
sequences never cross an optimizer step (each step's micro-batches are regrouped among themselves), so every
optimizer step keeps its sequences and TRL's step count.
"""

from __future__ import annotations

import torch

from . import plan

REGROUPS_EXACTLY = ("grpo", "sapo", "luspo", "dr_grpo", "dapo", "cispo", "vespo")


def applies(trainer) -> bool:
    """Whether this trainer, in train mode and free to split, regroups its generation batches ("all", every
    condition above)."""
    args = trainer.args
    return (
        trainer.skip_zero_advantage == "all"
        and args.top_entropy_quantile == 1.0
        and args.loss_type in REGROUPS_EXACTLY
        and args.steps_per_generation % args.gradient_accumulation_steps == 0
        and args.gradient_accumulation_steps > 1
    )


def merge(micro_batches: list[dict]) -> dict:
    """The micro-batches as one batch: per-row values (tensors of rank >= 1, lists) concatenated in order, the
    others (0-d tensors such as num_items_in_batch, None) taken from the first."""
    first = micro_batches[0]
    merged = {}
    for key, value in first.items():
        parts = [batch[key] for batch in micro_batches]
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            merged[key] = torch.cat(parts)
        elif isinstance(value, list):
            merged[key] = [item for part in parts for item in part]
        else:
            merged[key] = value
    return merged


def take(batch: dict, rows: list[int]) -> dict:
    """The rows `rows` of a batch, in that order (0-d and None values as they are)."""
    index = torch.tensor(rows, dtype=torch.long)
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            out[key] = value.index_select(0, index.to(value.device))
        elif isinstance(value, list):
            out[key] = [value[i] for i in rows]
        else:
            out[key] = value
    return out


def gradient_first(micro_batches: list[dict]) -> list[dict]:
    """The same rows in as many micro-batches of the same size, those with a nonzero advantage first (each group
    in its order); one read-back of the advantages."""
    size = len(micro_batches[0]["advantages"])
    merged = merge(micro_batches)
    advantages = merged["advantages"]  # one read-back of the generation batch's advantages
    zero = plan.is_zero(advantages).cpu().tolist()
    order = [i for i, z in enumerate(zero) if not z] + [i for i, z in enumerate(zero) if z]
    return [take(merged, order[start : start + size]) for start in range(0, len(order), size)]


def regroup(trainer, buffered: list[dict]) -> list[dict]:
    """A generation batch's micro-batches regrouped within each optimizer step (`gradient_first`)."""
    window = trainer.args.gradient_accumulation_steps
    steps = [buffered[start : start + window] for start in range(0, len(buffered), window)]
    return [batch for step in steps for batch in gradient_first(step)]
