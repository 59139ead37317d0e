"""The sparse schedule: statistics for every token, the gradient pass only over rows that have a gradient.

forward:  the memory schedule's statistics pass and objective (every active token's logp and entropy, the
          entropy threshold, the metrics).
backward: the sparse gradient pass (`sparse_gradients`): only the tokens whose two upstream gradients are not
          both exactly 0 (outside the entropy mask with beta = 0, advantage 0, dropped by the off-policy mask, in
          the clipped branch, vespo weight 0) have their logits recomputed; 2NHV + 6nHV FLOPs for n such rows.
"""

from __future__ import annotations

from ..head import Head
from ..tiling import TilePlan
from . import memory
from .passes import Engine
from .recompute import plan
from .sparse_gradients import StatisticsThenSparseGradients, workspace_bound, workspace_bytes

NAME = "sparse"
__all__ = ["NAME", "plan", "run", "workspace_bound", "workspace_bytes"]


def run(engine: Engine, objective, head: Head, plan: TilePlan):
    return memory.statistics_then_objective(StatisticsThenSparseGradients, engine, objective, head, plan)
