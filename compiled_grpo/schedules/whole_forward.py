"""The memory and sparse schedules' forward as one CUDA graph replay.

After the plan, a call's forward (the slots' gather, the statistics pass, the objective's value and its gradients
w.r.t. logp and entropy, TRL's metrics) is device work that reads nothing back to the host. Captured whole, it is
one replay where it was the statistics pass's replay plus the ~100 small launches of the gather, the scatter back
to [B, T], the objective's and the metrics' graphs around it; in a step bound by the host's launch rate those
launches are what the step waits on. The backward pushes the per-slot gradients (times the incoming one) through
the schedule's own gradient pass, itself a replay (`recompute.StatisticsThenRecompute.gradients`, the sparse one's).

Applies where calls are captured (`captured_call.capturable`) and the call is differentiable. The entropy threshold of
`top_entropy_quantile < 1` is taken inside the graph too: its quantile over the active tokens, whose count only
the device holds there, is `quantile.masked_linear_quantile` (bitwise torch.quantile's). Values are bitwise those
of the same work run uncaptured on the same layout (completion lengths bucketed as `captured_call.pad_call` says).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import quantile, streaming, tiling
from ..head import Head
from ..inputs import LossInputs
from ..streaming import RowGradients
from ..tiling import TilePlan
from . import captured_call, passes
from .passes import Engine, Wanted
from .recompute import Recompute
from .speed import FlatStatistics, scatter_rows


def applies(engine: Engine, objective, head: Head) -> bool:
    hidden = objective.inputs.hidden
    small = objective.inputs.completion_mask.numel() <= quantile.TORCH_QUANTILE_LIMIT  # the threshold's one form
    return (captured_call.capturable(engine, objective) and (small or not objective.cfg.uses_entropy_mask)
            and objective.sequence_slices is None and passes.differentiable(hidden, head))  # fmt: skip


def run(function, engine: Engine, objective, head: Head, plan: TilePlan):
    """(loss, metrics, logp, entropy, None) of the call, its forward one replay; `function`: the schedule's
    autograd Function, whose `gradients` the backward runs."""
    inputs = objective.inputs
    T = inputs.completion_mask.shape[1]
    laid_out, padded = objective, plan
    if not inputs.packed:  # a few completion lengths serve a run (`captured_call.LENGTH_BUCKET`)
        laid_out, padded = captured_call.pad_call(objective, plan, captured_call.padded_length(T))
    batch = captured_call.CallTensors.of(laid_out, head, padded)
    key = ("whole forward", batch.key(), padded.tiles, padded.identity, engine.tiles, engine.kernels.compiled)

    def work(*tensors):
        with torch.no_grad():  # as every capture runs it (`capture.Captures.run`), here for a work run directly too
            return forward_work(engine, *batch.rebuilt(tensors, laid_out, head, padded))

    value, metrics, logp, entropy, entropy_mask, per_slot = engine.captures.run(key, work, batch.tensors)
    template = head._replace(weight=None, bias=None)
    setup = Recompute(engine, None, plan.tiles, template, active_rows=plan.active.numel(),
                             gradients=function.gradients)  # fmt: skip
    loss = LossOfSlots.apply(value, inputs.hidden, head.weight, head.bias, per_slot, Backward(setup, plan, inputs))
    entropy_mask = None if entropy_mask is None else captured_call.unpad(entropy_mask, T)
    return loss, metrics, captured_call.unpad(logp, T), captured_call.unpad(entropy, T), entropy_mask


def forward_work(engine: Engine, objective, head: Head, plan: TilePlan):
    """(loss value, metrics, logp [B, T], entropy [B, T], the entropy mask [B, T] or None, per slot (lse, entropy,
    d loss / d logp, d loss / d entropy or None)): device work only, reading the plan's slots (not its active
    positions)."""
    inputs = objective.inputs
    slots = passes.gather_slots(inputs.hidden, inputs.completion_ids, plan, engine.shard.start, inputs.hidden_rows)
    logp_s, entropy_s, lse_s = passes.statistics_pass(engine, slots.x, slots.targets, head, plan.tiles)
    flat = FlatStatistics(inputs.completion_ids.numel(), logp_s.dtype, logp_s.device)
    flat.write(flat.destinations(plan), logp_s, entropy_s)
    logp, entropy = flat.view(inputs.completion_mask.shape)
    mask, entropy_mask, em = objective.batch.mask, None, None
    if objective.cfg.uses_entropy_mask:
        entropy_mask = quantile.high_entropy_mask_on_device(entropy, mask, objective.cfg.top_entropy_quantile)
        em = entropy_mask.to(mask.dtype)
    compiled = passes.compiles_objective(engine, inputs.hidden)
    value, metrics, g_logp, g_entropy = objective.value_metrics_and_gradients(logp, entropy, em, compiled=compiled)
    # what the upstream gradient of each slot would be: 0 at padding slots, as from the scatter's backward
    per_slot = lambda g: None if g is None else tiling.to_slots(g.reshape(-1), plan, fill=0.0)
    return value, metrics, logp, entropy, entropy_mask, (lse_s, entropy_s, per_slot(g_logp), per_slot(g_entropy))


@dataclass(frozen=True)
class Backward:
    """What the backward of a whole-forward call needs besides the tensors autograd saves: the gradient pass's
    setup, the call's plan (slots of its own layout) and its inputs (ids, packed rows) to gather the slots again."""

    setup: Recompute
    plan: TilePlan
    inputs: LossInputs


class LossOfSlots(torch.autograd.Function):
    """The loss of a whole-forward call: its value, with d loss / d (logp, entropy) per slot known; the backward
    scales them by the incoming gradient and runs the schedule's gradient pass."""

    @staticmethod
    def forward(ctx, value, hidden, weight, bias, per_slot, backward: Backward):
        # saved, not kept on ctx: autograd frees them after a backward (unless retain_graph)
        ctx.save_for_backward(hidden, weight, bias, *per_slot)
        ctx.backward_call = backward
        return value.detach().clone()

    @staticmethod
    def backward(ctx, g):
        hidden, weight, bias, lse, entropy, g_logp, g_entropy = ctx.saved_tensors
        b = ctx.backward_call
        s, inputs = b.setup, b.inputs
        slots = passes.gather_slots(hidden.detach(), inputs.completion_ids, b.plan, s.engine.shard.start,
                                    inputs.hidden_rows)  # fmt: skip
        # always scaled (exact at 1): finding out whether g is 1 would wait for the GPU
        scaled = lambda t: None if t is None else t * g
        rows = RowGradients(streaming.compared_ids(slots.targets), lse, entropy, scaled(g_logp), scaled(g_entropy))
        wanted = Wanted(ctx.needs_input_grad[2], bias is not None and ctx.needs_input_grad[3])
        dx, dw, db = s.gradients(s, slots.x, s.head(weight, bias), rows, wanted)
        d_hidden = None
        if ctx.needs_input_grad[1]:
            identity = b.plan.identity and not inputs.packed
            d_hidden = dx.view(hidden.shape) if identity else scatter_rows(dx, b.plan, hidden, inputs.hidden_rows)
        return None, d_hidden, dw, db, None, None
