"""Float64 reference of the GRPO loss family (TRL 1.16.0 semantics), independent of `compiled_grpo`.

`grpo_loss` starts from hidden states and the lm_head (full logits in float64); `grpo_loss_packed` from packed
targets (laid out as the padded call); `grpo_objective` starts from per-token log-probs and entropies. All
return a `ReferenceOutput`. `fused_linear_logprobs` is the per-token primitive (log-probs, entropies and TRL's
other per-token fields) on full float64 logits.
"""

from .logprobs import ReferenceLogProbs, fused_linear_logprobs
from .loss import ReferenceOutput, grpo_loss, grpo_objective
from .packed import grpo_loss_packed
from .settings import LOSS_TYPES, Settings

__all__ = [
    "LOSS_TYPES",
    "ReferenceLogProbs",
    "ReferenceOutput",
    "Settings",
    "fused_linear_logprobs",
    "grpo_loss",
    "grpo_loss_packed",
    "grpo_objective",
]
