"""How many rows a call sends through the lm_head gradient pass (logits recomputed or kept, dX, dW), read by
watching the schedules: the speed schedule's gradient plan, the sparse schedule's selected rows, the memory
schedule's every active token."""

from __future__ import annotations

import contextlib

from compiled_grpo.schedules import memory, sparse, speed


@contextlib.contextmanager
def gradient_rows():
    """Yields a list that gets one count per schedule call made inside the block."""
    counts = []
    originals = speed.run, memory.run, sparse.rows_with_gradient

    def speed_run(engine, objective, head, plan):
        counts.append(plan.gradient.active.numel())
        return originals[0](engine, objective, head, plan)

    def memory_run(engine, objective, head, plan):
        counts.append(plan.active.numel())
        return originals[1](engine, objective, head, plan)

    def sparse_rows(g_logp, g_entropy):  # the selection, compacted or (every token) not
        selected, entropy_has_gradient = originals[2](g_logp, g_entropy)
        counts.append(selected.numel())
        return selected, entropy_has_gradient

    speed.run, memory.run, sparse.rows_with_gradient = speed_run, memory_run, sparse_rows
    try:
        yield counts
    finally:
        speed.run, memory.run, sparse.rows_with_gradient = originals
