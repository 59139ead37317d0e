"""The primitive's engine: statistics in the forward, gradients recomputed in the backward.

`stream_statistics` gives the differentiable (logp, entropy) of every flat position through an autograd Function
of this module's form: the statistics pass (logp, entropy, lse per token; [stats_rows, V] float32 logits at a
time) in its forward, and its `gradients` pass in its backward. `StatisticsThenRecompute` recomputes every slot
vocabulary-outer (`passes.vocab_outer_gradients`: no float32 [V, H] accumulator, 8NHV FLOPs with the forward);
the sparse gradient pass (`sparse_gradients`) only the rows with a gradient. `fused_linear_logprobs` and the
GRPO loss's memory and sparse schedules run on it; it knows no loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import streaming, tiling
from ..head import Head
from ..streaming import RowGradients
from ..tiling import TilePlan
from . import passes
from .passes import Engine, Slots, Wanted


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
