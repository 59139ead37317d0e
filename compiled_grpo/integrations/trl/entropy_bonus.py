"""TRL 1.16's entropy bonus in CompiledGRPOTrainer: the coefficient a micro-batch applies, and TRL's adaptive
controller that moves it between optimizer steps."""

from __future__ import annotations

import torch


def entropy_coef_to_apply(trainer, device):
    """TRL's gating: the coefficient from the end of the previous optimizer step; 0 when the bonus is off.
    A tensor, so that a changing coefficient never recompiles anything and policy_loss is logged as TRL does."""
    if not trainer._entropy_bonus_enabled:
        return 0.0
    if trainer.use_adaptive_entropy:
        coef = trainer.entropy_coef if trainer._last_world_entropy <= trainer.args.entropy_target else 0.0
    else:
        coef = trainer.entropy_coef
    return torch.full((), float(coef), device=device)  # filled on the device: a copy from the host would wait


def update_entropy_controller(trainer, out, mask, mode):
    """TRL's adaptive entropy controller: a window-global entropy over the accumulation window, all ranks."""
    if trainer.use_adaptive_entropy and mode == "train":
        effective = mask if out.entropy_mask is None else mask * out.entropy_mask
        stats = torch.stack([(out.entropy * effective).sum(), effective.sum().to(out.entropy.dtype)]).detach()
        trainer._entropy_window_stats = (
            stats if trainer._entropy_window_stats is None else trainer._entropy_window_stats + stats
        )
        if trainer.accelerator.sync_gradients:
            window = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
            world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
            step = trainer.args.entropy_coef_delta
            if world_entropy <= trainer.args.entropy_target:
                trainer.entropy_coef = min(trainer.entropy_coef + step, trainer.args.entropy_coef_max)
            else:
                trainer.entropy_coef = max(trainer.entropy_coef - step, trainer.args.entropy_coef_min)
            trainer._last_world_entropy = world_entropy
            trainer._entropy_window_stats = None
    if mode == "train" and trainer.accelerator.sync_gradients:
        trainer._metrics[mode]["entropy_coef"].append(trainer.entropy_coef)
