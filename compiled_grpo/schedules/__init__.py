"""The schedules that drive the lm_head tiles, and the rule that picks one.

memory: statistics forward, gradients recomputed vocabulary-outer in the backward (8NHV, small workspace).
speed:  statistics and gradients on the same logits, tile by tile (6NHV; not with top_entropy_quantile < 1).
sparse: statistics forward, gradients recomputed only for the rows whose upstream gradient is non-zero
        (2NHV + 6nHV for n such rows).
Each module owns its plan, its autograd Function and its tile loop; speed and sparse also estimate their
workspace, which "auto" compares with a budget (sparse or memory are the fallback, whose workspace is a logits
tile).
`choice` holds the rule. The primitive's engine (`recompute`, `sparse_gradients`, `passes`) knows no loss; the
GRPO schedules (`memory`, `speed`, `sparse`, `whole_forward`, `captured_call`) put the objective around it.
"""
