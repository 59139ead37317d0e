"""What a GRPO loss call needs in order to be captured (`capture.Captures`): the tensors its work reads, in a fixed
order, rebuilt into the call from a graph's static copies of them (`CallTensors`); the call padded to a bucket of
completion lengths (`pad_call`, `unpad`), so that a run's batches share a few graphs; and whether a call can be
captured at all (`capturable`). The graph cache itself knows no objective and no schedule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .. import distributed
from ..batch_objective import Objective
from ..capture import Captures, signature
from ..tiling import TilePlan
from .passes import head_key

# the call's per-token inputs that a graph reads from its static buffers (the rest of `inputs.LossInputs` is the
# lm_head, read in place, or the reference head, whose log-probs are streamed before the call's work)
SWAPPED_INPUTS = ("hidden", "completion_ids", "completion_mask", "advantages", "old_per_token_logps",
                  "ref_per_token_logps", "sampling_per_token_logps", "importance_sampling_ratio",
                  "hidden_rows")  # fmt: skip


@dataclass(frozen=True)
class CallTensors:
    """The tensors one call's work reads, in a fixed order, and where each goes back when the work is rebuilt
    from a graph's static copies of them."""

    tensors: list
    input_names: tuple  # SWAPPED_INPUTS present, in order
    plan_fields: tuple  # (field of the plan, or None for the plan itself) of each TilePlan, in order
    step_names: tuple  # Step fields passed as 0-d tensors
    head_key: tuple

    @classmethod
    def of(cls, objective, head, plan) -> CallTensors:
        inputs = objective.inputs
        names = tuple(n for n in SWAPPED_INPUTS if getattr(inputs, n) is not None)
        tensors = [getattr(inputs, n) for n in names]
        fields = plan_tile_fields(plan)
        for f in fields:
            tensors += [tile_plan(plan, f).source, tile_plan(plan, f).valid]
        tensors.append(head.values)
        step = device_step(objective.step, objective.dtype, inputs.hidden.device)
        scalars = ("entropy_coef", "num_items_in_batch")
        step_names = tuple(n for n in scalars if isinstance(getattr(step, n), torch.Tensor))
        tensors += [getattr(step, n) for n in step_names]
        return cls(tensors, names, fields, step_names, head_key(head))

    def key(self) -> tuple:
        return (self.input_names, self.plan_fields, self.step_names, self.head_key, signature(self.tensors))

    def rebuilt(self, tensors, objective, head, plan):
        """(objective, head, plan) of the call with `tensors` (static copies of `self.tensors`) in place."""
        it = iter(tensors)
        inputs = dataclasses.replace(objective.inputs, **{n: next(it) for n in self.input_names})
        for f in self.plan_fields:
            # the work reads the slots only: the plan's active positions (sized by the batch) stay out of it
            rebuilt = dataclasses.replace(tile_plan(plan, f), source=next(it), valid=next(it), active=None,
                                          slot_of_active=None)  # fmt: skip
            plan = rebuilt if f is None else dataclasses.replace(plan, **{f: rebuilt})
        head = head._replace(values=next(it)).with_fresh_terms()
        step = dataclasses.replace(objective.step, **{n: next(it) for n in self.step_names})
        return Objective(objective.cfg, inputs, step, objective.group), head, plan


def plan_tile_fields(plan) -> tuple:
    """The TilePlans of a schedule's plan: the plan itself (None), or its fields that hold one."""
    if isinstance(plan, TilePlan):
        return (None,)
    return tuple(f.name for f in dataclasses.fields(plan) if isinstance(getattr(plan, f.name), TilePlan))


def tile_plan(plan, field):
    return plan if field is None else getattr(plan, field)


def device_step(step, dtype, device):
    """The step with its per-call numbers as 0-d tensors made on the device (a fill, not a copy that waits): a
    graph would otherwise bake them in (TRL's num_items_in_batch changes every step)."""
    fill = lambda v: torch.full((), float(v), dtype=dtype, device=device)
    changes = {}
    if step.bonus_on and not isinstance(step.entropy_coef, torch.Tensor):
        changes["entropy_coef"] = fill(step.entropy_coef)
    if step.num_items_in_batch is not None and not isinstance(step.num_items_in_batch, torch.Tensor):
        changes["num_items_in_batch"] = fill(step.num_items_in_batch)
    return dataclasses.replace(step, **changes)


def capturable(engine, objective) -> bool:
    """A loss call's whole work can be captured: the engine captures (it does so only on a GPU), in one process
    (no reduction across ranks inside), with the whole vocabulary here."""
    return engine.captures is not None and not engine.shard.parallel and not distributed.active(objective.group)


# Completion lengths are rounded up to a multiple of this in a captured call, so that the batches of a run (whose
# length is their longest completion) share a few graphs: a call of length T runs as one of length ceil(T/128)*128
# whose extra positions are masked, and its per-position outputs are cut back to T.
LENGTH_BUCKET = 128


def padded_length(T: int) -> int:
    return -(-T // LENGTH_BUCKET) * LENGTH_BUCKET


def checks_captures(captures: Captures | None, inputs) -> Captures | None:
    """The captures of a call's value checks: those of the call where its completion length is already a bucket's
    (a multiple of `LENGTH_BUCKET`, as a run's longest completion at max_completion_length = 1024 is), else
    None (eager checks). The checks read the call's [B, T] inputs as they are: at other lengths a graph per length
    would crowd the passes' graphs out of the kept ones, each capture a wait on the GPU."""
    if captures is None or inputs.packed or inputs.completion_mask.shape[1] % LENGTH_BUCKET:
        return None
    return captures


def pad_call(objective, plan, length: int):
    """(objective, plan) of the same call laid out with `length` >= T positions per row: the [B, T] inputs and
    hidden [B, T, H] padded (masked positions, whose values the loss ignores; an IS ratio of 1), and each tile
    plan's slots pointing at the same tokens in the wider layout. A padded call's loss is the call's (masked
    positions do not reach it); its per-position outputs are cut back with `unpad`."""
    inputs = objective.inputs
    B, T = inputs.completion_mask.shape
    if length == T:
        return objective, plan
    widen = lambda t, value=0.0: torch.nn.functional.pad(t, (0, length - T), value=value)
    changes = {name: widen(getattr(inputs, name)) for name in ("completion_ids", "completion_mask", *PER_TOKEN_BT)
               if getattr(inputs, name) is not None}  # fmt: skip
    if inputs.advantages.dim() == 2:
        changes["advantages"] = widen(inputs.advantages)
    ratio = inputs.importance_sampling_ratio
    if ratio is not None and ratio.dim() == 2 and ratio.shape[1] == T:
        changes["importance_sampling_ratio"] = widen(ratio, 1.0)
    changes["hidden"] = torch.nn.functional.pad(inputs.hidden.detach(), (0, 0, 0, length - T))
    inputs = dataclasses.replace(inputs, **changes)
    moved = lambda p: dataclasses.replace(p, source=p.source // T * length + p.source % T, identity=False)
    for f in plan_tile_fields(plan):
        plan = moved(plan) if f is None else dataclasses.replace(plan, **{f: moved(tile_plan(plan, f))})
    return Objective(objective.cfg, inputs, objective.step, objective.group), plan


PER_TOKEN_BT = ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps")


def unpad(t, T: int):
    """A padded call's [B, length, ...] output cut back to [B, T, ...]."""
    return t if t.shape[1] == T else t[:, :T]
