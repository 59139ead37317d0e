"""One plan per micro-batch, made when its generation batch is made: which rows are at advantage 0 (so which run
with grad, without, or not at all: `zero_advantage`) and where each row's real tokens are (so how they are packed
or trimmed: `packing`). Both are read back from the device in one wait per generation batch; a step reads the
plan its micro-batch carries and plans again (one read-back) only where the micro-batch no longer holds the
tensors the plan was read from, unchanged (a subclass that reshapes advantages or masks after `_prepare_inputs`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# The key under which a micro-batch carries its plan (`annotate`).
PLAN = "compiled_grpo_plan"
# Token pairs `prompt_groups` compares at once (bytes of its largest temporary).
COMPARED_AT_ONCE = 1 << 25


class ZeroRows(NamedTuple):
    """A micro-batch's rows at advantage 0 (host bool [B]) and [ranks, 2] counts of such rows and of all rows, with
    the advantages tensor they were read from and its version counter then (`fits`)."""

    zero: torch.Tensor
    counts: torch.Tensor
    advantages: torch.Tensor
    version: int

    def fits(self, advantages: torch.Tensor) -> bool:
        """Whether these rows were read from `advantages` as it is now (not replaced, not changed in place)."""
        return advantages is self.advantages and advantages._version == self.version


def is_zero(advantages: torch.Tensor) -> torch.Tensor:
    """Which rows are at advantage 0: advantages [B], or [B, T] equal along T as TRL gives them."""
    return (advantages if advantages.dim() == 1 else advantages.abs().amax(-1)) == 0


class Lengths(NamedTuple):
    """Where a micro-batch's real tokens are, on the host: each row's real prompt tokens (the last ones of its
    left-padded prompt) and real completion tokens (the first ones of its completion), whether every row's real
    tokens are those spans exactly (TRL's layout; a row with a hole in its masks is not), and the masks they were
    read from with their version counters then; where the trainer shares prompts, each row's first row with the
    same prompt."""

    prompt: torch.Tensor
    completion: torch.Tensor
    contiguous: bool
    masks: tuple
    versions: tuple
    groups: torch.Tensor | None = None  # each row's first row with the same prompt (`shared_prompts.groups`)

    def fits(self, inputs: dict) -> bool:
        masks = (inputs["prompt_mask"], inputs["completion_mask"])
        same = all(a is b for a, b in zip(masks, self.masks, strict=True))
        return same and tuple(m._version for m in masks) == self.versions


class MicroBatchPlan(NamedTuple):
    zero: ZeroRows | None  # None where the trainer never splits by advantage
    lengths: Lengths


def real_spans(inputs: dict) -> torch.Tensor:
    """[B, 4] on the device: each row's real prompt and completion tokens, whether they are one span each, and its
    first row with the same real prompt (`prompt_groups`)."""
    prompt_mask, completion_mask = inputs["prompt_mask"].bool(), inputs["completion_mask"].bool()
    P, C = prompt_mask.shape[1], completion_mask.shape[1]
    first = torch.where(prompt_mask, torch.arange(P, device=prompt_mask.device), P).amin(1)
    end = torch.where(completion_mask, torch.arange(1, C + 1, device=completion_mask.device), 0).amax(1)
    prompt, completion = P - first, end
    one_span = (prompt_mask.sum(1) == prompt) & (completion_mask.sum(1) == completion)
    groups = prompt_groups(inputs["prompt_ids"], prompt_mask)
    return torch.stack([prompt, completion, one_span.long(), groups], 1)


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """[B] on the device: each row's first row with the same real prompt (the same tokens on the same mask): the
    rows of a GRPO group share one. Compared exactly, a block of rows at a time (`COMPARED_AT_ONCE` token pairs:
    a generation batch of 256 rows of 4096-token prompts would take 256 MiB at once), without a wait."""
    real = prompt_ids.masked_fill(~prompt_mask.bool(), -1)
    rows = max(COMPARED_AT_ONCE // max(real.numel(), 1), 1)
    firsts = []
    for block in real.split(rows):
        same = (block[:, None, :] == real[None, :, :]).all(-1)
        firsts.append(same.int().argmax(1))  # the first match: a row matches itself at the latest
    return torch.cat(firsts) if firsts else real.new_zeros(0)


def lengths_of(span: torch.Tensor, masks: tuple) -> Lengths:
    """A micro-batch's `Lengths` from its host `real_spans` and the masks they were read from."""
    versions = tuple(m._version for m in masks)
    return Lengths(span[:, 0], span[:, 1], bool(span[:, 2].all()), masks, versions, span[:, 3])


def read(trainer, micro_batches: list[dict], with_zeros: bool) -> list[MicroBatchPlan]:
    """Each micro-batch's plan, read back in one wait; with its rows at advantage 0 and every rank's counts of
    them (one gather across ranks, which every rank reaches alike) where `with_zeros`."""
    spans = [real_spans(batch) for batch in micro_batches]
    parts = [torch.cat(spans).reshape(-1)]
    if with_zeros:
        zeros = [is_zero(batch["advantages"]) for batch in micro_batches]
        # each row count filled on the device: a copy from the host would wait
        counts = torch.stack([torch.stack([z.sum(), torch.full((), z.numel(), device=z.device)]) for z in zeros])
        if trainer.accelerator.num_processes > 1:  # every rank must take the same branches
            counts = trainer.accelerator.gather(counts.reshape(1, -1)).reshape(-1, len(zeros), 2).transpose(0, 1)
        else:
            counts = counts.reshape(len(zeros), 1, 2)
        parts += [torch.cat(zeros).long(), counts.reshape(-1)]
    host = torch.cat([p.to(parts[0].device) for p in parts]).cpu()
    sizes = [len(s) for s in spans]
    host_spans = host[: 4 * sum(sizes)].reshape(-1, 4).split(sizes)
    plans = []
    for batch, span in zip(micro_batches, host_spans, strict=True):
        lengths = lengths_of(span, (batch["prompt_mask"], batch["completion_mask"]))
        plans.append(MicroBatchPlan(None, lengths))
    if with_zeros:
        rest = host[4 * sum(sizes) :]
        masks = rest[: sum(sizes)].bool().split(sizes)
        counts = rest[sum(sizes) :].reshape(len(micro_batches), -1, 2)
        for i, batch in enumerate(micro_batches):
            zero = ZeroRows(masks[i], counts[i], batch["advantages"], batch["advantages"]._version)
            plans[i] = plans[i]._replace(zero=zero)
    return plans


def annotate(trainer, micro_batches: list[dict], with_zeros: bool) -> None:
    """Store each micro-batch's plan in it (`PLAN`): one wait per generation batch, none per step."""
    for batch, plan in zip(micro_batches, read(trainer, micro_batches, with_zeros), strict=True):
        batch[PLAN] = plan


def zero_rows(trainer, inputs: dict) -> ZeroRows:
    """The micro-batch's rows at advantage 0 as its plan has them, or read again where its advantages are no
    longer the tensor they were read from (a plan made from other advantages would run rows that now have a
    gradient without grad). Every rank must change its advantages alike (the read-back gathers across ranks)."""
    planned = inputs.get(PLAN)
    if planned is not None and planned.zero is not None and planned.zero.fits(inputs["advantages"]):
        return planned.zero
    return read(trainer, [inputs], with_zeros=True)[0].zero


def lengths(trainer, inputs: dict) -> Lengths:
    """The micro-batch's real spans as its plan has them, or read again where its masks changed."""
    planned = inputs.get(PLAN)
    if planned is not None and planned.lengths.fits(inputs):
        return planned.lengths
    return read(trainer, [inputs], with_zeros=False)[0].lengths
