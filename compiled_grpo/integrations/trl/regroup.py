"""A generation batch regrouped: its sequences with a gradient fill as few micro-batches as they can, and the
completions of one prompt sit side by side.

TRL's GRPOTrainer generates one batch for `steps_per_generation` micro-batches, shuffles its rows and slices it in
order. Under `skip_zero_advantage="all"` a sequence at advantage 0 runs nothing, so gathering the sequences with a
gradient into the first micro-batches of each optimizer step leaves the last ones with nothing to run
(`zero_advantage`). Where packed rows share their prompts (`shared_prompts`), the shuffle scatters a group's
completions over the micro-batches, so each forwards the prompt again; gathered, a group's completions share a
micro-batch (or as few as its size allows) and forward their prompt once. This is exact where a sequence's weight in
the loss does not depend on which micro-batch of its optimizer step holds it: grpo, sapo and luspo divide by the
micro-batch's sequence count (equal in every micro-batch), dr_grpo by B x max_completion_length, dapo, cispo and
vespo by the generation batch's token count. Not regrouped: bnpo (its normalizer is the micro-batch's token count),
`top_entropy_quantile < 1` (the threshold is the micro-batch's), and sequences never cross an optimizer step (each
step's micro-batches are regrouped among themselves), so every optimizer step keeps its sequences and TRL's step
count.
"""

from __future__ import annotations

import torch

from . import plan

REGROUPS_EXACTLY = ("grpo", "sapo", "luspo", "dr_grpo", "dapo", "cispo", "vespo")


def applies(trainer) -> bool:
    """Whether this trainer, in train mode, regroups its generation batches: by gradient ("all") or by prompt
    (prompts shared), where either is exact (every condition above)."""
    args = trainer.args
    return (
        (trainer.skip_zero_advantage == "all" or getattr(trainer, "share_prompts", False))
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


def reordered(micro_batches: list[dict], by_gradient: bool, by_prompt: bool) -> list[dict]:
    """The same rows in as many micro-batches of the same size: those with a nonzero advantage first
    (`by_gradient`), the rows of one prompt side by side in the order the prompts first appear (`by_prompt`), the
    rows' order kept otherwise; one read-back."""
    size = len(micro_batches[0]["advantages"])
    merged = merge(micro_batches)
    rows = torch.arange(len(merged["advantages"]), device=merged["advantages"].device)
    zero = plan.is_zero(merged["advantages"]).long() if by_gradient else torch.zeros_like(rows)
    group = plan.prompt_groups(merged["prompt_ids"], merged["prompt_mask"]) if by_prompt else rows
    keys = torch.stack([zero, group]).cpu().tolist()  # one read-back of the generation batch
    order = sorted(range(len(keys[0])), key=lambda i: (keys[0][i], keys[1][i], i))
    return [take(merged, order[start : start + size]) for start in range(0, len(order), size)]


def regroup(trainer, buffered: list[dict]) -> list[dict]:
    """A generation batch's micro-batches regrouped within each optimizer step (`reordered`)."""
    window = trainer.args.gradient_accumulation_steps
    by_gradient, by_prompt = trainer.skip_zero_advantage == "all", bool(getattr(trainer, "share_prompts", False))
    steps = [buffered[start : start + window] for start in range(0, len(buffered), window)]
    return [batch for step in steps for batch in reordered(step, by_gradient, by_prompt)]
