"""The numerics audit of compiled-grpo against the float64 reference, numpy and scipy (`python -m audits`)."""
