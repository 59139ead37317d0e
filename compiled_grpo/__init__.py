"""compiled-grpo: the GRPO loss family (TRL 1.16.0 semantics) fused with the LM head, compile-first."""

from .config import LOSS_TYPES, GRPOLossConfig
from .loss import FusedLinearGRPOLoss, GRPOLossOutput, fused_linear_grpo_loss

__version__ = "0.1.0"
__all__ = ["LOSS_TYPES", "FusedLinearGRPOLoss", "GRPOLossConfig", "GRPOLossOutput", "fused_linear_grpo_loss"]
