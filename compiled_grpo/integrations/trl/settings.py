"""What CompiledGRPOTrainer reads from TRL and the model (its loss settings, the head's scaling), the lm_head
workspace it may take, whether it captures its loss's calls by default, and how its metrics are read back."""

from __future__ import annotations

import torch
from trl import GRPOTrainer

from ... import checks
from ...config import SETTING_NAMES
from ...loss import CONSTRUCTOR_OPTIONS, FusedLinearGRPOLoss
from ...schedules import sparse
from ...tiling import Tiles


def head_scaling(config) -> tuple[float, float | None]:
    """(logit_scale, final_logit_softcapping) from a model config, read the way TRL 1.16's fused head reads them:
    `logit_scale`, else `output_multiplier`, else `lm_head_multiplier`, else 1 / `logits_scaling` (times it for
    HyperCLOVA X)."""
    text = config.get_text_config()
    scale = None
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if scale is None:
            scale = getattr(text, name, None)
    if scale is None and getattr(text, "logits_scaling", None) is not None:
        scale = text.logits_scaling if text.model_type == "hyperclovax" else 1 / text.logits_scaling
    return (1.0 if scale is None else float(scale)), getattr(text, "final_logit_softcapping", None)


def unwrapped(trainer, model):
    """`trainer.accelerator.unwrap_model(model)`, remembered for each wrapper: accelerate's unwrap reads installed
    packages' metadata (is DeepSpeed there?) on every call, about 1.5 ms of host time, and a step asks twice per
    micro-batch."""
    cache = trainer.__dict__.setdefault("_compiled_grpo_unwrapped", {})
    found = cache.get(id(model))
    if found is None or found[0] is not model:  # a new wrapper (accelerate wraps the model again in train())
        found = cache[id(model)] = (model, trainer.accelerator.unwrap_model(model))
    return found[1]


def loss_settings(trainer: GRPOTrainer) -> dict:
    args = trainer.args
    logit_scale, softcap = head_scaling(trainer.accelerator.unwrap_model(trainer.model).config)
    return {
        "loss_type": args.loss_type,
        "beta": args.beta,
        "epsilon_low": args.epsilon,
        "epsilon_high": trainer.epsilon_high,
        "delta": args.delta,
        "importance_sampling_level": args.importance_sampling_level,
        "temperature": trainer.temperature,
        "top_entropy_quantile": args.top_entropy_quantile,
        "max_completion_length": args.max_completion_length,
        "sapo_temperature_pos": args.sapo_temperature_pos,
        "sapo_temperature_neg": args.sapo_temperature_neg,
        "vespo_k_pos": args.vespo_k_pos,
        "vespo_lambda_pos": args.vespo_lambda_pos,
        "vespo_k_neg": args.vespo_k_neg,
        "vespo_lambda_neg": args.vespo_lambda_neg,
        "use_bias_correction_kl": args.use_bias_correction_kl,
        "off_policy_mask_threshold": args.off_policy_mask_threshold,
        "logit_scale": logit_scale,
        "final_logit_softcapping": softcap,
    }


TRAINER_ARGUMENTS = ("compiled", "schedule")  # FusedLinearGRPOLoss's options that are the trainer's own arguments


def check_loss_options(loss_options: dict | None) -> None:
    """A TypeError naming `loss_options` for a key the trainer takes elsewhere (its own argument, or a setting it reads
    from the GRPOConfig or the model's config) or that FusedLinearGRPOLoss does not know."""
    for key in loss_options or {}:
        if key in TRAINER_ARGUMENTS:
            raise TypeError(f"loss_options: {key!r} is an argument of CompiledGRPOTrainer itself: pass "
                            f"CompiledGRPOTrainer(..., {key}=...) instead")  # fmt: skip
        if key in SETTING_NAMES:
            raise TypeError(f"loss_options: {key!r} is a loss setting, which CompiledGRPOTrainer reads from its "
                            "GRPOConfig (TRL's names: epsilon_low is `epsilon`) or, for the logit scale and softcap, "
                            "from the model's config: set it there")  # fmt: skip
    options = tuple(name for name in CONSTRUCTOR_OPTIONS if name not in TRAINER_ARGUMENTS)
    checks.unknown_names(loss_options or {}, options, "loss_options")


def read_back(metrics: dict) -> dict:
    """The values of 0-d tensors, read from the device in one wait (not one per metric)."""
    if not metrics:
        return {}
    values = torch.stack([v.detach().float().reshape(()) for v in metrics.values()]).tolist()
    return dict(zip(metrics, values, strict=True))


def settle(metrics: dict[str, list]) -> None:
    """Replace the tensors among logged values by their floats, read back in one wait."""
    pending = [(k, i) for k, values in metrics.items() for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if pending:
        values = read_back({(k, i): metrics[k][i] for k, i in pending})
        for (k, i), value in values.items():
            metrics[k][i] = value


def trainer_budget(loss: FusedLinearGRPOLoss, weight, device) -> int:
    """The lm_head workspace "auto" may take inside a trainer, where the model's activations are alive while the
    head runs: what TRL's fused head holds in its backward (a float32 dW sum and a copy in the weight's dtype),
    and never less than the sparse pass's largest workspace (its peak, measured, stays under TRL's)."""
    trl_head = weight.numel() * (4 + weight.element_size())
    tiles = Tiles.for_device(device, loss.captures is not None, **loss.tile_overrides)
    return max(trl_head, sparse.workspace_bound(tiles, weight))


# The largest lm_head hidden size whose calls the trainer captures by default. Up to it (0.5B-1.5B shapes, H 896 and
# 1536) the step is bound by the host's launches and capture measured faster or level; at 7B (H 3584) the step is
# bound by the GPU, capture gains nothing, and its graphs' pool outgrew the budget at the first capture.
CAPTURED_HIDDEN_SIZE = 2048


def captures_by_default(weight) -> bool:
    """Whether CompiledGRPOTrainer captures its loss's calls unless `loss_options` says (a GPU only, in effect)."""
    return weight.shape[1] <= CAPTURED_HIDDEN_SIZE
