"""The rule that picks a schedule for a call (`schedule="auto"`), and the schedules' names."""

from __future__ import annotations

from .. import tiling
from . import memory, sparse, speed
from .passes import Engine

SCHEDULES = ("auto", "speed", "memory", "sparse")


def choose(requested: str, engine: Engine, objective, head, budget: int):
    """(schedule module, its plan). The rule for "auto" (the same with a vocabulary-parallel lm_head, whose
    workspace is its slice's):
    - sequences split across ranks (`sequence_parallel_group`): as below, without the speed schedule;
    - top_entropy_quantile < 1: sparse (the threshold needs every entropy before any gradient; then only the
      masked-in tokens, and those the KL term or the bonus reach, need the gradient pass), or memory where
      sparse's workspace exceeds `budget` bytes;
    - otherwise speed (6NHV, and 2NHV only for tokens at advantage 0 without KL or bonus), with smaller tiles
      and one dW GEMM per tile where its usual workspace exceeds `budget` bytes; where that exceeds it too, or
      a row that must stay whole does not fit a speed tile: sparse where some token's gradient is known to be 0
      (advantage 0 without KL or bonus: 2NHV + 6nHV for the n others), else memory (8NHV).
    An explicit schedule runs as asked (speed raises where a row that must stay whole does not fit)."""
    mask = objective.inputs.completion_mask
    if requested == "memory":
        return memory, memory.plan(engine, mask)
    if requested == "sparse" or (requested == "auto" and objective.cfg.uses_entropy_mask):
        plan = sparse.plan(engine, mask)
        if requested == "sparse" or sparse.workspace_bytes(engine, plan, head) <= budget:
            return sparse, plan
        return memory, plan  # the same token plan
    if objective.sequence_slices is not None:  # sequences split across ranks: no row is whole in a speed tile
        if requested == "speed":
            raise ValueError("schedule='speed' does not take a sequence_parallel_group (its tiles need every token of "
                             "a sequence); use 'memory', 'sparse' or 'auto'")  # fmt: skip
        return without_speed(engine, objective)
    lean = requested == "auto" and speed.workspace_bound(engine, head) > budget
    if lean and speed.workspace_bound(engine, head, lean=True) > budget:
        # Smaller speed tiles would fit such budgets, but each adds a GEMM into the float32 [V, H] dW sum: in the
        # TRL step at 0.5B (256-token tiles) they cost more GPU time than the memory schedule's recompute, captured
        # or not (docs/performance.md, "Captured calls")
        return without_speed(engine, objective)  # decided before the plan's wait on the GPU
    plan = speed.plan(engine, objective, head, lean)
    if plan is None and requested == "speed":
        raise ValueError(
            f"schedule='speed' with a sequence-level objective needs whole rows in a token tile; a row has more "
            f"than speed_tile={engine.tiles.speed_tile} active tokens: raise speed_tile or use schedule='memory'"
        )
    if requested == "speed" or (plan is not None and speed.workspace_bytes(engine, plan, head) <= budget):
        return speed, plan
    return without_speed(engine, objective)


def without_speed(engine: Engine, objective):
    """sparse where some active token's gradient is known to be 0 from the inputs, else memory; one wait on the
    GPU for the token plan and that count."""
    mask = objective.inputs.completion_mask
    zero = objective.zero_gradient_tokens()
    (active, *zeros), _ = tiling.positions_and_lengths((mask,) if zero is None else (mask, zero))
    plan = tiling.plan_tokens(active, mask.numel(), engine.tiles.token_tile, engine.tiles.tail_tile, engine.slot_bucket)
    return (sparse if zeros and zeros[0].numel() else memory), plan


def head_for(schedule, head):
    """The head as `schedule` reads it: a split head's terms held whole for the speed and sparse schedules, whose
    passes take the whole vocabulary per token tile; made per vocabulary slice for the memory schedule, whose
    statistics and gradient passes both run vocabulary-outer."""
    return head if schedule is memory else head.with_whole_terms()
