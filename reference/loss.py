"""The float64 reference: full logits, plain autograd, TRL 1.16.0's `_compute_loss` step by step."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from . import lm_head, world
from . import objective as obj
from .settings import Settings


@dataclass
class ReferenceOutput:
    loss: torch.Tensor  # 0-d, differentiable
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    per_token_logps: torch.Tensor | None = None  # [B,T], detached, 0 where masked
    entropy: torch.Tensor | None = None  # [B,T], detached, 0 where masked
    entropy_mask: torch.Tensor | None = None  # [B,T] bool, None when top_entropy_quantile == 1


SETTING_NAMES = tuple(f.name for f in fields(Settings))


def grpo_loss(
    hidden,
    weight,
    completion_ids,
    completion_mask,
    advantages,
    *,
    bias=None,
    old_per_token_logps=None,
    ref_per_token_logps=None,
    importance_sampling_ratio=None,
    sampling_per_token_logps=None,
    num_items_in_batch=None,
    num_processes=None,
    gradient_accumulation_steps=1,
    steps_per_generation=None,
    entropy_mask_override=None,
    **settings,
) -> ReferenceOutput:
    """GRPO-family loss of one micro-batch from hidden states [B,T,H] and the lm_head W [V,H] (+ bias [V]).

    Settings are keywords with TRL's names (see `Settings`); inputs as in docs/semantics.md. Gradients of hidden,
    weight and bias come from `out.loss.backward()`.
    """
    s = make_settings(settings)
    mask = completion_mask.bool()
    ids = torch.where(mask, completion_ids, torch.zeros_like(completion_ids))  # masked ids may be anything
    z = lm_head.logits(hidden, weight, bias, s)
    logp, entropy = lm_head.logp_and_entropy(z, ids)
    logp = torch.where(mask, logp, 0.0)
    entropy = torch.where(mask, entropy, 0.0)
    out = grpo_objective(
        logp,
        entropy,
        completion_mask,
        advantages,
        old_per_token_logps=old_per_token_logps,
        ref_per_token_logps=ref_per_token_logps,
        importance_sampling_ratio=importance_sampling_ratio,
        sampling_per_token_logps=sampling_per_token_logps,
        num_items_in_batch=num_items_in_batch,
        num_processes=num_processes,
        gradient_accumulation_steps=gradient_accumulation_steps,
        steps_per_generation=steps_per_generation,
        entropy_mask_override=entropy_mask_override,
        **settings,
    )
    return out


def make_settings(settings: dict) -> Settings:
    unknown = set(settings) - set(SETTING_NAMES)
    if unknown:
        raise TypeError(f"unknown setting(s): {sorted(unknown)}")
    return Settings(**settings).check()


def as_float64(x, mask, fill):
    """A [B,T] input in float64 with its (ignored) masked positions replaced by `fill`."""
    if x is None:
        return None
    return torch.where(mask, x.double(), fill)


def grpo_objective(
    per_token_logps,
    entropy,
    completion_mask,
    advantages,
    *,
    old_per_token_logps=None,
    ref_per_token_logps=None,
    importance_sampling_ratio=None,
    sampling_per_token_logps=None,
    num_items_in_batch=None,
    num_processes=None,
    gradient_accumulation_steps=1,
    steps_per_generation=None,
    entropy_mask_override=None,
    **settings,
) -> ReferenceOutput:
    """The loss from per-token log-probs and entropies [B,T] (differentiable), no lm_head involved. Everything is
    float64 except the entropy mask's comparison, which reads the entropies as float32 as TRL's runs do
    (`objective.high_entropy_mask`: ties at the threshold kept).

    `entropy_mask_override` ([B,T] bool) replaces the computed top-entropy mask: the audit uses it to compare a
    low-precision run whose entropies legitimately fell on the other side of the threshold."""
    s = make_settings(settings)
    if s.beta != 0.0 and ref_per_token_logps is None:
        raise ValueError("beta != 0 needs ref_per_token_logps (the reference model's per-token log-probs)")
    mask_b = completion_mask.bool()
    mask = mask_b.double()
    logp = per_token_logps.double()
    entropy = entropy.double()
    gas = gradient_accumulation_steps
    spg = gas if steps_per_generation is None else steps_per_generation
    procs = world.world_size() if num_processes is None else num_processes
    if num_items_in_batch is None:  # every micro-batch of the generation batch, every rank
        num_items_in_batch = spg * world.all_sum(mask.sum())

    adv = advantages.double()
    adv = adv.unsqueeze(1) if adv.dim() == 1 else torch.where(mask_b, adv, 0.0)
    is_ratio = importance_sampling_ratio
    if is_ratio is not None:
        is_ratio = is_ratio.double()
        is_ratio = is_ratio.unsqueeze(1) if is_ratio.dim() == 1 else is_ratio
    old = logp.detach() if old_per_token_logps is None else as_float64(old_per_token_logps, mask_b, 0.0)

    entropy_mask = obj.high_entropy_mask(entropy, mask_b, s.top_entropy_quantile)
    if entropy_mask_override is not None and entropy_mask is not None:
        entropy_mask = entropy_mask_override.to(entropy_mask.device, entropy_mask.dtype) & mask_b
    log_w = obj.log_importance_weights(logp, old, mask, s.importance_sampling_level)
    coef_1 = torch.exp(log_w)
    metrics = {}
    if s.beta != 0.0:
        ref = as_float64(ref_per_token_logps, mask_b, 0.0)
        kl = obj.kl_to_reference(logp, ref, coef_1, s.use_bias_correction_kl)
        metrics["kl"] = obj.masked_mean(kl, mask)
    metrics["entropy"] = obj.masked_mean(entropy, mask)

    if s.loss_type == "cispo":
        loss = obj.cispo_loss(coef_1, adv, logp, s)
        high = ((coef_1 > s.eps_high) & (adv > 0)).double()
        metrics["cispo_clip_ratio"] = obj.masked_mean(high, mask)
    elif s.loss_type == "sapo":
        loss = obj.sapo_loss(coef_1, adv, s)
    elif s.loss_type == "vespo":
        phi = obj.vespo_phi(adv, logp - old, mask, is_ratio, s)  # TRL sums the IS ratio over all T positions
        loss = -phi * adv * logp
        metrics["vespo/phi_seq_mean"] = obj.masked_mean(phi, mask)
    else:
        loss, capped = obj.clipped_loss(coef_1, adv, s)
        metrics.update(obj.clip_metrics(capped, adv, mask, s))

    if s.off_policy_mask_threshold is not None:
        sampling = old if sampling_per_token_logps is None else sampling_per_token_logps.double()
        loss = loss * obj.off_policy_keep(adv, logp, sampling, mask_b, s.off_policy_mask_threshold)
    if entropy_mask is not None:
        loss = loss * entropy_mask.double()
    if is_ratio is not None and s.loss_type != "vespo":
        loss = loss * (is_ratio if is_ratio.shape[1] == 1 else torch.where(mask_b, is_ratio, 1.0))
    if s.beta != 0.0:
        loss = loss + s.beta * kl

    total = obj.normalize(loss, mask, s, num_items_in_batch, procs, gas, spg)
    if s.entropy_coef != 0.0:
        metrics["policy_loss"] = world.all_sum(obj.policy_loss_metric(total, s, gas)) / world.world_size()
        total = total - s.entropy_coef * obj.entropy_bonus(entropy, mask, entropy_mask, gas)
    return ReferenceOutput(
        loss=total,
        metrics=metrics,
        per_token_logps=torch.where(mask_b, logp.detach(), 0.0),
        entropy=torch.where(mask_b, entropy.detach(), 0.0),
        entropy_mask=None if entropy_mask is None else entropy_mask.bool(),
    )
