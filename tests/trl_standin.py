"""Run TRL 1.16.0's own `GRPOTrainer._compute_loss` without a trainer, on injected per-token statistics.

A stand-in object carries exactly the attributes `_compute_loss` reads; a one-process accelerator answers its
pad/gather/reduce calls. This lets the tests compare the reference with TRL's code itself, not a re-reading.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import torch
from trl.trainer.grpo_trainer import GRPOTrainer


class OneProcessAccelerator:
    num_processes = 1
    sync_gradients = True

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


class TrainerStandIn:
    _compute_loss = GRPOTrainer._compute_loss
    get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask
    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)

    def __init__(self, logp, entropy, *, gas=1, spg=None, use_vllm_is=False, **s):
        self._injected = (logp, entropy)
        self.accelerator = OneProcessAccelerator()
        self.model = SimpleNamespace(training=True)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.loss_type = s.get("loss_type", "dapo")
        self.beta = s.get("beta", 0.0)
        self.epsilon_low = s.get("epsilon_low", 0.2)
        self.epsilon_high = s.get("epsilon_high") or self.epsilon_low
        self.importance_sampling_level = s.get("importance_sampling_level", "token")
        self.top_entropy_quantile = s.get("top_entropy_quantile", 1.0)
        self.max_completion_length = s.get("max_completion_length")
        self.off_policy_mask_threshold = s.get("off_policy_mask_threshold")
        self.entropy_coef = s.get("entropy_coef", 0.0)
        self._entropy_bonus_enabled = self.entropy_coef != 0.0
        self.use_adaptive_entropy = False
        self.aux_loss_enabled = False
        self.use_vllm = use_vllm_is
        self.vllm_importance_sampling_correction = use_vllm_is
        self.current_gradient_accumulation_steps = gas
        self.args = SimpleNamespace(
            use_bias_correction_kl=s.get("use_bias_correction_kl", True),
            delta=s.get("delta"),
            sapo_temperature_pos=s.get("sapo_temperature_pos", 1.0),
            sapo_temperature_neg=s.get("sapo_temperature_neg", 1.05),
            vespo_k_pos=s.get("vespo_k_pos", 2.0),
            vespo_lambda_pos=s.get("vespo_lambda_pos", 3.0),
            vespo_k_neg=s.get("vespo_k_neg", 3.0),
            vespo_lambda_neg=s.get("vespo_lambda_neg", 2.0),
            steps_per_generation=gas if spg is None else spg,
        )

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        logp, entropy = self._injected
        return logp, entropy, None

    def metrics(self) -> dict[str, float]:
        return {k: v[-1] for k, v in self._metrics["train"].items()}


def trl_compute_loss(logp, entropy, completion_ids, completion_mask, advantages, *, inputs=None, **kwargs):
    """TRL's loss and logged metrics for injected `logp`/`entropy` ([B,T], may require grad)."""
    inputs = dict(inputs or {})
    trainer = TrainerStandIn(logp, entropy, use_vllm_is="importance_sampling_ratio" in inputs, **kwargs)
    B = completion_ids.shape[0]
    batch = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        **inputs,
    }
    loss = trainer._compute_loss(None, batch)
    return loss, trainer.metrics()
