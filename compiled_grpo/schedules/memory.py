"""The memory schedule: statistics in the forward, gradients recomputed in the backward, vocabulary-outer.

forward:  the statistics pass (logp, entropy, lse per token; [stats_rows, V] float32 logits at a time).
objective: on [B,T] with plain autograd (any objective works, including the entropy threshold).
backward: each vocabulary slice against every token tile (`passes.vocab_outer_gradients`): no float32 [V, H]
          accumulator. 8NHV FLOPs (the forward's 2NHV are recomputed). The only schedule that combines the
          statistics of a vocabulary-parallel lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import quantile, tiling
from ..batch_objective import Objective
from ..head import Head
from ..streaming import RowGradients
from ..tiling import TilePlan
from . import passes
from .passes import Engine, Slots, Wanted


def plan(engine: Engine, mask) -> TilePlan:
    return tiling.plan_mask(mask, engine.tiles.token_tile, engine.tiles.tail_tile)


@dataclass(frozen=True)
class Recompute:
    """What a recomputing backward needs besides the tensors autograd tracks."""

    engine: Engine
    targets: torch.Tensor
    head_values: torch.Tensor
    softcap: bool
    tiles: tuple


class StatisticsThenRecompute(torch.autograd.Function):
    """logp and entropy per slot from x [slots, H]; gradients recomputed vocabulary-outer in the backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, setup: Recompute):
        head = Head(weight, bias, setup.head_values, setup.softcap)
        logp, entropy, lse = passes.statistics_pass(setup.engine, x, setup.targets, head, setup.tiles)
        ctx.save_for_backward(x, weight, bias, lse, entropy)
        ctx.setup = setup
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        x, weight, bias, lse, entropy = ctx.saved_tensors
        s = ctx.setup
        head = Head(weight, bias, s.head_values, s.softcap)
        rows = RowGradients(s.targets, lse, entropy, g_logp, g_entropy)
        wanted = Wanted(ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        dx, dw, db = passes.vocab_outer_gradients(s.engine, x, rows, head, s.tiles, wanted)
        return dx, dw, db, None


def statistics_with_recompute(function, engine: Engine, slots: Slots, head: Head):
    """(logp, entropy) per slot through `function`, an autograd Function of this module's form."""
    setup = Recompute(engine, slots.targets, head.values, head.softcap, slots.plan.tiles)
    return function.apply(slots.x, head.weight, head.bias, setup)


def run(engine: Engine, objective: Objective, head: Head, plan: TilePlan):
    return statistics_then_objective(StatisticsThenRecompute, engine, objective, head, plan)


def statistics_then_objective(function, engine: Engine, objective: Objective, head: Head, plan: TilePlan):
    """The loss of the batch: statistics of every active token, the objective on [B,T] (the entropy threshold
    included), gradients by `function`'s backward."""
    inputs = objective.inputs
    slots = passes.gather_slots(inputs.hidden, inputs.completion_ids, plan, engine.shard.start, inputs.hidden_rows)
    logp_s, entropy_s = statistics_with_recompute(function, engine, slots, head)
    mask = objective.batch.mask
    logp = tiling.from_slots(logp_s, plan, mask.numel()).view(mask.shape)
    entropy = tiling.from_slots(entropy_s, plan, mask.numel()).view(mask.shape)
    entropy_mask = None
    if objective.cfg.uses_entropy_mask:
        q = objective.cfg.top_entropy_quantile
        entropy_mask = quantile.high_entropy_mask(entropy, mask, q, objective.group, active=plan.active)
    em = None if entropy_mask is None else entropy_mask.to(mask.dtype)
    loss, metrics = objective.loss_and_metrics(logp, entropy, em)
    return loss, metrics, logp.detach(), entropy.detach(), entropy_mask
