"""TRL 1.16 on compiled_grpo: the GRPO trainer's loss, and the fused LM head of every TRL trainer.

    from compiled_grpo.integrations.trl import CompiledGRPOTrainer, compiled_fused_head
    trainer = CompiledGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    with compiled_fused_head():  # SFT, DPO, KTO, RLOO, GRPO...: TRL's fused head on fused_linear_logprobs
        SFTTrainer(...).train()

Every loss setting comes from the trainer's `GRPOConfig` (loss type, clipping, delta, KL, importance sampling
level and vLLM correction, top_entropy_quantile, OPSM, entropy bonus with TRL's adaptive controller, vespo,
gradient accumulation), and the logit scale and softcap from the model's config, as TRL's fused head reads
them. The model runs once per micro-batch with a pre-hook on its output embedding that takes the final hidden
states and lets the head project only one position; the fused loss then streams the completion positions
through the lm_head. Each micro-batch runs its real tokens only, trimmed to its own longest prompt and completion
or packed into one row (`padding_free`); on a GPU the decoder layers are compiled by region (`compile_backbone`)
and generation runs on compiled decoding with a pinned cache (`compile_generation`, `rollouts`; on a GPU the trainer's
own decoding loop, `decoding_loop`).
TRL's metrics are logged under TRL's names. Also handled: the
one-position shift between hidden states and completion ids, `tool_mask`, the MoE auxiliary loss (divided by
gradient accumulation), eval mode (no accumulation), `cast_lm_head_to_fp32`, PEFT (an adapter on the backbone; not
on lm_head itself), tied embeddings and FSDP2 DTensor weights.
"""

from .head import CapturedFusedHeadFunction, EagerFusedHeadFunction, FusedHeadFunction, compiled_fused_head
from .settings import CAPTURED_HIDDEN_SIZE, captures_by_default, head_scaling, loss_settings, settle, trainer_budget
from .trainer import CompiledGRPOTrainer

__all__ = [
    "CAPTURED_HIDDEN_SIZE", "CapturedFusedHeadFunction", "CompiledGRPOTrainer", "EagerFusedHeadFunction",
    "FusedHeadFunction", "captures_by_default", "compiled_fused_head", "head_scaling", "loss_settings", "settle",
    "trainer_budget",
]  # fmt: skip
