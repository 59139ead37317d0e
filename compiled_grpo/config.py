"""Loss settings: one frozen dataclass with TRL 1.16.0's names and defaults, validated once.

TRL's `epsilon` is `epsilon_low` here. `max_completion_length` has no default: dr_grpo needs it explicitly.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
TOKEN_COUNT_NORMALIZED = ("dapo", "cispo", "vespo")  # normalized by num_items_in_batch
IS_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class GRPOLossConfig:
    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float | None = None  # None: epsilon_low
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

    def __post_init__(self):
        for f in fields(self):  # a one-element tensor given for a number means that number
            object.__setattr__(self, f.name, as_number(f.name, getattr(self, f.name)))
        validate_settings(self)

    @property
    def eps_high(self) -> float:
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    @property
    def uses_entropy_mask(self) -> bool:
        return self.top_entropy_quantile < 1.0

    @property
    def couples_sequence(self) -> bool:
        """Whether a token's gradient depends on other tokens of its sequence (so a tile must hold whole rows)."""
        return (
            self.importance_sampling_level == "sequence"
            or self.off_policy_mask_threshold is not None
            or self.loss_type == "vespo"
        )


SETTING_NAMES = tuple(f.name for f in fields(GRPOLossConfig))


def as_number(name: str, value):
    """`value`, or the number a one-element tensor holds (a setting is one value for every token: a per-token or
    per-sequence temperature belongs to `fused_linear_logprobs`)."""
    if not hasattr(value, "numel") or not hasattr(value, "item"):
        return value
    if value.numel() != 1:
        raise ValueError(
            f"{name} must be one number (a float, or a one-element tensor), got a tensor of shape "
            f"{tuple(value.shape)}; a per-token temperature is fused_linear_logprobs' (temperature=)"
        )
    return value.item()


def _require(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate_settings(c: GRPOLossConfig) -> None:
    _require(c.loss_type in LOSS_TYPES, "loss_type", f"must be one of {LOSS_TYPES}, got {c.loss_type!r}")
    level = c.importance_sampling_level
    _require(level in IS_LEVELS, "importance_sampling_level", f"must be one of {IS_LEVELS}, got {level!r}")
    q = c.top_entropy_quantile
    _require(_finite(q) and 0.0 <= q <= 1.0, "top_entropy_quantile", f"must lie in [0, 1], got {q!r}")
    _require(_finite(c.temperature) and c.temperature > 0, "temperature", f"must be > 0, got {c.temperature!r}")
    _require(_finite(c.beta) and c.beta >= 0, "beta", f"must be >= 0 (a KL penalty's weight), got {c.beta!r}")
    _require(_finite(c.epsilon_low) and c.epsilon_low >= 0, "epsilon_low", f"must be >= 0, got {c.epsilon_low!r}")
    _require(_finite(c.eps_high) and c.eps_high >= 0, "epsilon_high", f"must be >= 0, got {c.epsilon_high!r}")
    _require(
        c.delta is None or (_finite(c.delta) and c.delta > 1),
        "delta",
        f"must be > 1 (an upper bound on the ratio, above 1 + epsilon_high in use) or None, got {c.delta!r}",
    )
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        v = getattr(c, name)
        _require(_finite(v) and v > 0, name, f"must be > 0, got {v!r}")
    for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        v = getattr(c, name)
        _require(_finite(v) and v >= 0, name, f"must be >= 0 (a gamma weight's shape or rate), got {v!r}")
    _require(_finite(c.entropy_coef), "entropy_coef", f"must be a finite number, got {c.entropy_coef!r}")
    if c.loss_type == "dr_grpo":
        _require(c.max_completion_length is not None, "max_completion_length", "is required for loss_type='dr_grpo'")
    m = c.max_completion_length
    _require(m is None or (isinstance(m, int) and m > 0), "max_completion_length", f"must be a positive int, got {m!r}")
    t = c.off_policy_mask_threshold
    _require(
        t is None or (_finite(t) and t >= 0),
        "off_policy_mask_threshold",
        f"must be >= 0 (a bound on a KL divergence) or None, got {t!r}",
    )
    _require(
        _finite(c.logit_scale) and c.logit_scale > 0, "logit_scale", f"must be > 0 and finite, got {c.logit_scale!r}"
    )
    cap = c.final_logit_softcapping
    _require(cap is None or (_finite(cap) and cap > 0), "final_logit_softcapping", f"must be > 0 or None, got {cap!r}")
    warn_where_trl_warns(c)


def warn_where_trl_warns(c: GRPOLossConfig) -> None:
    """TRL computes these combinations as written and warns; so do we."""
    level = c.importance_sampling_level
    if c.loss_type == "luspo" and level == "token":
        warnings.warn("luspo is meant for importance_sampling_level='sequence'", stacklevel=4)
    elif c.loss_type == "vespo" and level == "sequence":
        warnings.warn("vespo is meant for importance_sampling_level='token'", stacklevel=4)
    elif c.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo") and level == "sequence":
        warnings.warn(f"{c.loss_type} is meant for importance_sampling_level='token'", stacklevel=4)


def warn_dr_grpo_length(c: GRPOLossConfig, positions: int, stacklevel: int) -> None:
    """dr_grpo divides by rows x max_completion_length, the sampler's maximum: a batch with more completion
    positions than that was sampled with another maximum. TRL computes the loss as written; so do we, and say so."""
    if c.loss_type == "dr_grpo" and positions > c.max_completion_length:
        warnings.warn(
            f"dr_grpo: the completions have {positions} positions, more than max_completion_length="
            f"{c.max_completion_length}; the loss is divided by rows x {c.max_completion_length}, as TRL's "
            f"GRPOTrainer computes it (its completions never exceed max_completion_length), so each token weighs "
            f"more than Dr. GRPO's constant normalizer means it to: set max_completion_length to the sampler's "
            f"maximum ({positions} or more)",
            stacklevel=stacklevel,
        )
