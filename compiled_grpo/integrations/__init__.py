"""Adapters to trainers: `compiled_grpo.integrations.trl` (TRL 1.16 GRPOTrainer)."""
