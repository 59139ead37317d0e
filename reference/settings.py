"""Loss settings of the float64 reference, with TRL 1.16.0's defaults and checks.

TRL's `epsilon` is `epsilon_low` here. Two deliberate departures from TRL's GRPOConfig: `max_completion_length`
has no default (dr_grpo without it is an error), and `epsilon_high` defaults to `epsilon_low` as in TRL.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
IS_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class Settings:
    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    temperature: float = 1.0
    top_entropy_quantile: float = 1.0
    max_completion_length: int | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_bias_correction_kl: bool = True
    off_policy_mask_threshold: float | None = None
    entropy_coef: float = 0.0
    logit_scale: float = 1.0
    final_logit_softcapping: float | None = None

    @property
    def eps_high(self) -> float:
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    def check(self) -> Settings:
        """Raise ValueError naming the setting that TRL would reject or silently mis-scale."""
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling_level not in IS_LEVELS:
            level = self.importance_sampling_level
            raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got {level!r}")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must lie in [0, 1], got {self.top_entropy_quantile}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("max_completion_length is required for loss_type='dr_grpo' (its normalizer)")
        if self.max_completion_length is not None and self.max_completion_length <= 0:
            raise ValueError(f"max_completion_length must be > 0, got {self.max_completion_length}")
        warn_where_trl_warns(self)
        return self


def warn_where_trl_warns(s: Settings) -> None:
    """TRL computes these combinations as written but warns that they are unusual; so do we."""
    level = s.importance_sampling_level
    if s.loss_type == "luspo" and level == "token":
        warnings.warn("luspo is meant for importance_sampling_level='sequence'", stacklevel=3)
    if s.loss_type == "vespo" and level == "sequence":
        warnings.warn("vespo is meant for importance_sampling_level='token'", stacklevel=3)
    if s.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo") and level == "sequence":
        warnings.warn(f"{s.loss_type} is meant for importance_sampling_level='token'", stacklevel=3)
