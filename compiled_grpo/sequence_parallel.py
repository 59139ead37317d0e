"""Sequences split across ranks (sequence parallelism, as verl's Ulysses): each rank of a group holds the same B
sequences, a contiguous slice of their positions each ([B, T_r], slices in rank order, of any lengths).

The lm_head work stays local: each rank streams the statistics of its own tokens. What couples a sequence's
tokens, or the batch's, is then taken over whole sequences: the per-token statistics and inputs are gathered
along the positions ([B, sum_r T_r], a few values per token), so the objective, its normalizers, the sequence-level
terms (sequence importance ratios, per-sequence normalizers, the off-policy mask, vespo's phi), the entropy
threshold and the metrics are the unsplit batch's, equal on every rank. The backward of the gather hands each rank
the gradients of its own positions, so its hidden-state gradient is the unsplit one at those positions and its
lm_head gradient is its tokens' share (summed over the group, the unsplit one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import distributed
from .inputs import PER_TOKEN


@dataclass(frozen=True)
class SequenceSlices:
    """Where this rank's positions sit in the gathered sequences."""

    group: object
    lengths: tuple[int, ...]  # T_r of every rank of the group, in rank order
    rank: int  # this rank's index in the group

    @property
    def start(self) -> int:
        return sum(self.lengths[: self.rank])

    @property
    def local(self) -> slice:
        return slice(self.start, self.start + self.lengths[self.rank])

    @classmethod
    def of(cls, group, mask: torch.Tensor) -> SequenceSlices:
        """The group's slice lengths (one small gather: a wait on the device, made once per call)."""
        length = torch.tensor([mask.shape[1]], device=mask.device)
        lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size(group))]
        dist.all_gather(lengths, length, group=group)
        return cls(group, tuple(int(n) for n in lengths), dist.get_rank(group))


def gather_positions(t: torch.Tensor, slices: SequenceSlices) -> torch.Tensor:
    """[B, T_r, ...] on each rank -> [B, sum_r T_r, ...] (not differentiable; `GatheredPositions` is)."""
    widest = max(slices.lengths)
    padded = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, widest - t.shape[1])) if t.shape[1] < widest else t
    parts = [torch.empty_like(padded) for _ in slices.lengths]
    dist.all_gather(parts, padded.contiguous(), group=slices.group)
    return torch.cat([p[:, :n] for p, n in zip(parts, slices.lengths, strict=True)], dim=1)


class GatheredPositions(torch.autograd.Function):
    """The gather along positions; every rank then computes the same objective on the whole sequences, so the
    gradient of its own positions is its slice of that objective's gradient (no reduction)."""

    @staticmethod
    def forward(ctx, t, slices: SequenceSlices):
        ctx.slices = slices
        return gather_positions(t.detach(), slices)

    @staticmethod
    def backward(ctx, g):
        return (None if g is None else g[:, ctx.slices.local].contiguous()), None


def gathered_inputs(inputs, slices: SequenceSlices):
    """The call's per-token inputs over the whole sequences (advantages and IS ratios per sequence stay as they
    are); hidden states and the lm_head stay local (the objective does not read them)."""
    full = lambda t: t if t is None or t.dim() < 2 or t.shape[1] != inputs.completion_mask.shape[1] else (
        gather_positions(t, slices))  # fmt: skip
    names = ("completion_ids", "completion_mask", "advantages", *PER_TOKEN, "importance_sampling_ratio")
    return dataclasses.replace(inputs, **{name: full(getattr(inputs, name)) for name in names})


def active(group) -> bool:
    return group is not None and distributed.active(group)
