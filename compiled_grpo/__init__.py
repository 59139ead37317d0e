"""compiled-grpo: the GRPO loss family (TRL 1.16.0 semantics) fused with the LM head, compile-first."""

from .config import LOSS_TYPES, GRPOLossConfig
from .kernels import CompilingNotice
from .logprobs import LogProbs, fused_linear_logprobs, primitive_captures
from .loss import FusedLinearGRPOLoss, GRPOLossOutput, fused_linear_grpo_loss

__version__ = "0.3.0"
__all__ = [
    "LOSS_TYPES",
    "CompilingNotice",
    "FusedLinearGRPOLoss",
    "GRPOLossConfig",
    "GRPOLossOutput",
    "LogProbs",
    "fused_linear_grpo_loss",
    "fused_linear_logprobs",
    "primitive_captures",
]
