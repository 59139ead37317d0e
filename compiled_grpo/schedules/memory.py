"""The memory schedule: statistics in the forward, gradients recomputed in the backward, vocabulary-outer.

forward:  the statistics pass (logp, entropy, lse per token; [stats_rows, V] float32 logits at a time).
objective: on [B,T] (any objective works, including the entropy threshold); with compiled tiles on a GPU its value,
          its gradients w.r.t. logp and entropy and the metrics come from torch.compile graphs
          (`Objective.loss_and_metrics`), otherwise from plain autograd.
backward: each vocabulary slice against every token tile (`passes.vocab_outer_gradients`): no float32 [V, H]
          accumulator. 8NHV FLOPs (the forward's 2NHV are recomputed). The only schedule that combines the
          statistics of a vocabulary-parallel lm_head.
The statistics pass and its recomputing backward are the primitive's engine (`recompute`); this module puts the
GRPO objective between them.
"""

from __future__ import annotations

from .. import quantile
from ..batch_objective import Objective
from ..head import Head
from ..sequence_parallel import GatheredPositions
from ..tiling import TilePlan
from . import passes, whole_forward
from .passes import Engine
from .recompute import StatisticsThenRecompute, plan, stream_statistics

NAME = "memory"
__all__ = ["NAME", "plan", "run", "statistics_then_objective"]


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
