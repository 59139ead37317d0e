"""The memory schedule: statistics in the forward, gradients recomputed in the backward, vocabulary-outer.

forward:  the statistics pass (logp, entropy, lse per token; [stats_rows, V] float32 logits at a time).
objective: on [B,T] (any objective works, including the entropy threshold); with compiled tiles on a GPU its value,
          its gradients w.r.t. logp and entropy and the metrics come from torch.compile graphs
          (`Objective.loss_and_metrics`), otherwise from plain autograd.
backward: each vocabulary slice against every token tile (`passes.vocab_outer_gradients`): no float32 [V, H]
          accumulator. 8NHV FLOPs (the forward's 2NHV are recomputed). The only schedule that combines the
          statistics of a vocabulary-parallel lm_head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import quantile, streaming, tiling
from ..batch_objective import Objective
from ..head import Head
from ..sequence_parallel import GatheredPositions
from ..streaming import RowGradients
from ..tiling import TilePlan
from . import passes, whole_forward
from .passes import Engine, Slots, Wanted

NAME = "memory"


def plan(engine: Engine, mask) -> TilePlan:
    return tiling.plan_mask(mask, engine.tiles.token_tile, engine.tiles.tail_tile, engine.slot_bucket)


@dataclass(frozen=True)
class Recompute:
    """What a recomputing backward needs besides the tensors autograd tracks."""

    engine: Engine
    targets: torch.Tensor
    tiles: tuple
    template: Head  # the head without its weight and bias (autograd saves those)
    extras: bool = False  # the forward also returns TRL's other per-token fields (no gradient), from the same pass
    active_rows: int = 0  # slots that hold a token (the others are padding)
    # (setup, x, head, RowGradients, Wanted) -> (dX [slots, H], dW, db): the schedule's gradient pass
    gradients: Callable | None = None

    def head(self, weight, bias) -> Head:
        return self.template._replace(weight=weight, bias=bias)


class StatisticsThenRecompute(torch.autograd.Function):
    """logp and entropy per slot from x [slots, H] (with `Recompute.extras`, then log_sum_sq_probs, mean_logits
    and is_top1, without gradient); gradients recomputed vocabulary-outer in the backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, setup: Recompute):
        head = setup.head(weight, bias)
        passed = passes.captured_statistics_pass(setup.engine, x, setup.targets, head, setup.tiles, setup.extras)
        logp, entropy, lse, *extras = passed
        ctx.save_for_backward(x, weight, bias, lse, entropy)
        ctx.setup = setup
        ctx.set_materialize_grads(False)  # an output the loss does not use arrives as None: no work for it
        ctx.mark_non_differentiable(*extras)
        return logp, entropy, *extras

    @staticmethod
    def backward(ctx, g_logp, g_entropy, *_extras):
        x, weight, bias, lse, entropy = ctx.saved_tensors
        s = ctx.setup
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp
        rows = RowGradients(streaming.compared_ids(s.targets), lse, entropy, g_logp, g_entropy)
        wanted = Wanted(ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        dx, dw, db = s.gradients(s, x, s.head(weight, bias), rows, wanted)
        return dx, dw, db, None

    @staticmethod
    def gradients(setup: Recompute, x, head: Head, rows: RowGradients, wanted: Wanted):
        """dX [slots, H], dW and db of every slot, vocabulary-outer (captured where the engine captures calls)."""
        return passes.captured_vocab_outer_gradients(setup.engine, x, rows, head, setup.tiles, wanted)


def statistics_with_recompute(function, engine: Engine, slots: Slots, head: Head, extras: bool = False):
    """(logp, entropy) per slot (with `extras`, and the three extra fields) through `function`, an autograd
    Function of this module's form."""
    template = head._replace(weight=None, bias=None)
    setup = Recompute(engine, slots.targets, slots.plan.tiles, template, extras, slots.plan.active.numel(),
                      function.gradients)  # fmt: skip
    return function.apply(slots.x, head.weight, head.bias, setup)


def stream_statistics(function, engine: Engine, targets, plan: TilePlan, head: Head, extras: bool = False):
    """Differentiable (logp, entropy) of every flat [B*T] position, 0 where `plan` has no slot, through `function`
    (this module's autograd Function or the sparse schedule's); with `extras`, followed by log_sum_sq_probs,
    mean_logits and is_top1 (no gradient) from the same pass. `targets`: anything with `hidden`,
    `completion_ids` and `hidden_rows` (`inputs.LossInputs`, `logprobs.Targets`). The one engine the memory and
    sparse schedules of the GRPO loss and `fused_linear_logprobs` share."""
    hidden, ids = targets.hidden, targets.completion_ids
    slots = passes.gather_slots(hidden, ids, plan, engine.shard.start, targets.hidden_rows)
    per_slot = statistics_with_recompute(function, engine, slots, head, extras)
    return tuple(tiling.from_slots(values, plan, ids.numel()) for values in per_slot)


def run(engine: Engine, objective: Objective, head: Head, plan: TilePlan):
    return statistics_then_objective(StatisticsThenRecompute, engine, objective, head, plan)


def statistics_then_objective(function, engine: Engine, objective: Objective, head: Head, plan: TilePlan):
    """The loss of the batch: statistics of every active token, the objective on [B,T] (the entropy threshold
    included), gradients by `function`'s backward; where calls are captured, the forward as one replay
    (`whole_forward`)."""
    if whole_forward.applies(engine, objective, head):
        return whole_forward.run(function, engine, objective, head, plan)
    inputs = objective.inputs
    shape = inputs.completion_mask.shape
    logp, entropy = stream_statistics(function, engine, inputs, plan, head)
    logp, entropy = logp.view(shape), entropy.view(shape)
    active, slices = plan.active, objective.sequence_slices
    if slices is not None:  # sequences split across ranks: the objective over the whole sequences
        logp, entropy = (GatheredPositions.apply(t, slices) for t in (logp, entropy))
        objective, active = objective.over_whole_sequences(), None
    mask = objective.batch.mask
    entropy_mask = None
    if objective.cfg.uses_entropy_mask:
        q = objective.cfg.top_entropy_quantile
        entropy_mask = quantile.high_entropy_mask(entropy, mask, q, objective.group, active=active)
    em = None if entropy_mask is None else entropy_mask.to(mask.dtype)
    compiled = passes.compiles_objective(engine, inputs.hidden)
    loss, metrics = objective.loss_and_metrics(logp, entropy, em, compiled=compiled)
    outputs = (logp.detach(), entropy.detach(), entropy_mask)
    if slices is not None:  # this rank's positions
        outputs = tuple(None if t is None else t[:, slices.local] for t in outputs)
    return loss, metrics, *outputs
