"""A drop-in for Liger-Kernel 0.8.5's `LigerFusedLinearGRPOLoss`: same constructor, same call, same return.

    from compiled_grpo.compat import LigerFusedLinearGRPOLoss   # was: from liger_kernel.chunked_loss import ...
    loss, metrics = loss_fn(hidden, lm_head.weight, completion_ids, completion_mask, advantages, ...)

`metrics` is Liger's tuple: (kl, clip_ratio) with beta != 0, else (clip_ratio,). Where Liger departs from TRL
1.16.0 this follows TRL (docs/usage.md, "How results differ from Liger"):
- luspo: TRL's mean over sequences of the masked row sum (Liger divides by B * T instead of B);
- the clip ratio under `delta`: measured on the ratio after the delta cap, as TRL does;
- cispo's clip ratio is TRL's `cispo_clip_ratio`; sapo and vespo report 0, as Liger does.
Plus `top_entropy_quantile`, which Liger cannot offer. `chunk_size` is accepted and ignored (tiles are sized by
the library); `use_bias_correction_kl` keeps Liger's default (False), unlike FusedLinearGRPOLoss (TRL's True).
"""

from __future__ import annotations

import torch

from .loss import FusedLinearGRPOLoss


class LigerFusedLinearGRPOLoss(torch.nn.Module):
    def __init__(
        self,
        beta: float = 0.04,
        compiled: bool = True,
        use_ref_model: bool = True,
        chunk_size: int = 1,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: str = "dapo",
        max_completion_length: int | None = None,
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        temperature: float = 1.0,
        delta: float | None = None,
        use_bias_correction_kl: bool = False,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        top_entropy_quantile: float = 1.0,
    ):
        super().__init__()
        self.beta = beta
        self.use_ref_model = use_ref_model
        self.loss = FusedLinearGRPOLoss(
            compiled=compiled,
            beta=beta,
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            loss_type=loss_type,
            max_completion_length=max_completion_length,
            importance_sampling_level=importance_sampling_level,
            sapo_temperature_pos=sapo_temperature_pos,
            sapo_temperature_neg=sapo_temperature_neg,
            temperature=temperature,
            delta=delta,
            use_bias_correction_kl=use_bias_correction_kl,
            vespo_k_pos=vespo_k_pos,
            vespo_lambda_pos=vespo_lambda_pos,
            vespo_k_neg=vespo_k_neg,
            vespo_lambda_neg=vespo_lambda_neg,
            top_entropy_quantile=top_entropy_quantile,
        )

    def forward(
        self,
        _input,
        lin_weight,
        selected_token_ids,
        attention_mask,
        advantages,
        bias=None,
        ref_per_token_logps=None,
        old_per_token_logps=None,
        ref_input=None,
        ref_weight=None,
        ref_bias=None,
        vllm_is_ratio=None,
        num_items_in_batch=None,
    ):
        use_ref_head = self.beta != 0.0 and self.use_ref_model and ref_per_token_logps is None
        out = self.loss(
            _input,
            lin_weight,
            selected_token_ids,
            attention_mask,
            advantages,
            bias=bias,
            old_per_token_logps=old_per_token_logps,
            ref_per_token_logps=ref_per_token_logps,
            ref_hidden=ref_input if use_ref_head else None,
            ref_weight=ref_weight if use_ref_head else None,
            ref_bias=ref_bias if use_ref_head else None,
            importance_sampling_ratio=vllm_is_ratio,
            num_items_in_batch=num_items_in_batch,
        )
        return out.loss, self.liger_metrics(out.metrics)

    def liger_metrics(self, metrics: dict) -> tuple[torch.Tensor, ...]:
        clipped = metrics.get("clip_ratio/region_mean", metrics.get("cispo_clip_ratio"))
        if clipped is None:  # sapo, vespo: no clipping
            clipped = torch.zeros_like(metrics["entropy"])
        return (metrics["kl"], clipped) if self.beta != 0.0 else (clipped,)
