"""The numerics audit of compiled-grpo against the float64 reference, numpy and scipy (`python -m audits` in a
checkout, `compiled-grpo-audit` after an install)."""

if __package__ == "compiled_grpo.audits":  # installed: the wheel maps both folders under compiled_grpo
    from compiled_grpo import reference
else:  # a checkout: the reference is the top-level folder beside this one
    import reference

__all__ = ["reference"]
