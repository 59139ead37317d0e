"""The GRPO loss family on [B,T] tensors: no vocabulary dimension, plain differentiable torch.

The math of every loss type lives here (docs/semantics.md states what TRL 1.16.0's `_compute_loss` computes):
- ratio r = logp - old; token level log_w = r [B,T]; sequence level log_w = sum_t m r / max(L_i, 1) [B,1].
- grpo, bnpo, dr_grpo, dapo, luspo: l = -min(c1 A, clamp(c1, 1 - eps_low, 1 + eps_high) A), c1 = exp(log_w)
  capped at delta (when set) after the clamp is taken.
- cispo: l = -detach(min(c1, eps_high)) A logp.     sapo: l = -(4 / tau) sigmoid(tau (c1 - 1)) A.
- vespo: l = -phi A logp, phi a gradient-free gamma weight of the clamped summed log-ratio (`vespo_phi`).
- then l *= OPSM keep, *= entropy mask, *= IS ratio (not vespo), += beta * KL (k3, times c1 with bias correction).
- normalizers (`Normalizers`): grpo/sapo mean over rows of the row mean; bnpo token mean; dr_grpo sum over
  B * max_completion_length; dapo/cispo/vespo sum over N / P * gas / spg; luspo mean over rows of the row sum;
  all divided by gas (dapo's gas is inside its normalizer). Entropy bonus: -c * mean(H over m * mask_H) / gas.

`reduce_rows` computes the contribution of any subset of whole rows with the batch-global normalizers, so the
speed schedule can take gradients tile by tile and the sum over tiles equals the loss of the whole batch.
`batch_objective.Objective` binds these to a call's inputs, settings and step context, with TRL's metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import distributed
from .config import GRPOLossConfig


@dataclass(frozen=True)
class Batch:
    """The objective's [B,T] inputs in the statistics dtype, masked positions made harmless."""

    mask: torch.Tensor  # [B,T] float 0/1
    advantages: torch.Tensor  # [B,1] or [B,T]
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    is_ratio: torch.Tensor | None = None  # [B,1] or [B,T]; masked positions 1
    is_ratio_vespo: torch.Tensor | None = None  # as given: vespo sums its log over all T positions (as TRL)
    sampling: torch.Tensor | None = None  # NaN allowed at active positions (unscored by vLLM)


@dataclass(frozen=True)
class Normalizers:
    """Batch-global denominators, fixed before any tile is seen."""

    rows: int  # B
    tokens: torch.Tensor  # max(sum m, 1)
    items: torch.Tensor  # max(N, 1) / P * gas / spg
    gas: float
    bonus_tokens: torch.Tensor  # max(sum m * mask_H, 1)


def make_batch(inputs, dtype) -> Batch:
    """The objective's tensors from a call's inputs (`inputs.LossInputs`)."""
    active = inputs.completion_mask.bool()
    keep = lambda t, fill: None if t is None else torch.where(active, t.to(dtype), fill)
    adv = inputs.advantages.to(dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else torch.where(active, adv, 0.0)
    ratio = inputs.importance_sampling_ratio
    ratio = None if ratio is None else ratio.to(dtype)
    ratio = ratio.unsqueeze(1) if ratio is not None and ratio.dim() == 1 else ratio
    ratio_masked = ratio if ratio is None or ratio.shape[1] == 1 else torch.where(active, ratio, 1.0)
    sampling = inputs.sampling_per_token_logps
    return Batch(
        mask=active.to(dtype),
        advantages=adv,
        old=keep(inputs.old_per_token_logps, 0.0),
        ref=keep(inputs.ref_per_token_logps, 0.0),
        is_ratio=ratio_masked,
        is_ratio_vespo=ratio,
        sampling=None if sampling is None else sampling.to(dtype),
    )


def make_normalizers(batch: Batch, entropy_mask, step, group=None) -> Normalizers:
    m, gas, spg = batch.mask, step.gas, step.spg
    num_items = step.num_items_in_batch
    if num_items is None:  # every micro-batch of the generation batch, every rank
        num_items = spg * distributed.all_sum(m.sum(), group)
    if not isinstance(num_items, torch.Tensor):
        num_items = m.new_full((), float(num_items))  # filled on the device: no copy that waits for the GPU
    items = num_items.to(device=m.device, dtype=m.dtype).clamp(min=1.0) / step.num_processes * gas / spg
    e = m if entropy_mask is None else m * entropy_mask
    return Normalizers(
        rows=m.shape[0],
        tokens=m.sum().clamp(min=1.0),
        items=items,
        gas=gas,
        bonus_tokens=e.sum().clamp(min=1.0),
    )


# ---------------------------------------------------------------- per-token pieces
def by_sign(condition, if_true: float, if_false: float, like: torch.Tensor) -> torch.Tensor:
    """A constant chosen by the advantage's sign, in `like`'s dtype (exact, where TRL rounds it to float32).
    `new_full` fills on the device: a host-to-device copy would wait for every kernel queued before it."""
    return torch.where(condition, like.new_full((), if_true), like.new_full((), if_false))


def log_importance_weights(logp, old, mask, level: str) -> torch.Tensor:
    r = logp - old
    if level == "token":
        return r
    return ((r * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


@torch.no_grad()
def vespo_phi(adv, log_ratio, mask, is_ratio, cfg: GRPOLossConfig) -> torch.Tensor:
    """phi = exp(lam + k lw - lam e^lw) with lw the clamped summed log-ratio (+ clamped log IS ratio)."""
    low = math.log(1e-8)
    lw = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        lw = lw + torch.log(is_ratio).clamp(low, 20.0).sum(-1, keepdim=True)
    lw = lw.clamp(low, 20.0)
    nonneg = adv >= 0
    k = by_sign(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg, lw)
    lam = by_sign(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg, lw).clamp(min=1e-4)
    return torch.exp(lam + k * lw - lam * torch.exp(lw)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_keep(adv, logp, sampling, mask, threshold: float) -> torch.Tensor:
    kl = torch.nan_to_num(sampling - logp.detach(), nan=0.0)
    kl = torch.where(mask > 0, kl, 0.0)
    seq_kl = kl.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (seq_kl <= threshold)).to(logp.dtype)


def per_token_loss(logp, batch: Batch, cfg: GRPOLossConfig, entropy_mask) -> tuple[torch.Tensor, dict]:
    """The per-token loss l ([B,T] or [B,1]) and what the metrics read (capped ratio, phi, KL)."""
    adv, mask = batch.advantages, batch.mask
    old = logp.detach() if batch.old is None else batch.old
    coef_1 = torch.exp(log_importance_weights(logp, old, mask, cfg.importance_sampling_level))
    seen = {}
    if cfg.loss_type == "cispo":
        loss = -coef_1.clamp(max=cfg.eps_high).detach() * adv * logp
        seen["coef_1"] = coef_1
    elif cfg.loss_type == "sapo":
        tau = by_sign(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg, coef_1)
        loss = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv
    elif cfg.loss_type == "vespo":
        phi = vespo_phi(adv, logp - old, mask, batch.is_ratio_vespo, cfg)
        loss = -phi * adv * logp
        seen["phi"] = phi
    else:
        coef_2 = coef_1.clamp(1 - cfg.epsilon_low, 1 + cfg.eps_high)
        capped = coef_1 if cfg.delta is None else coef_1.clamp(max=cfg.delta)
        loss = -torch.min(capped * adv, coef_2 * adv)
        seen["coef_1"] = capped
    if cfg.off_policy_mask_threshold is not None:
        sampling = old if batch.sampling is None else batch.sampling
        loss = loss * off_policy_keep(adv, logp, sampling, mask, cfg.off_policy_mask_threshold)
    if entropy_mask is not None:
        loss = loss * entropy_mask
    if batch.is_ratio is not None and cfg.loss_type != "vespo":
        loss = loss * batch.is_ratio
    if cfg.beta != 0.0:
        d = batch.ref - logp
        kl = torch.exp(d) - d - 1
        kl = kl * coef_1 if cfg.use_bias_correction_kl else kl
        loss = loss + cfg.beta * kl
        seen["kl"] = kl
    return loss, seen


def reduce_rows(loss, mask, cfg: GRPOLossConfig, n: Normalizers) -> torch.Tensor:
    """These rows' share of the normalized policy loss."""
    masked = loss * mask
    if cfg.loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / (n.rows * n.gas)
    if cfg.loss_type == "bnpo":
        return masked.sum() / n.tokens / n.gas
    if cfg.loss_type == "dr_grpo":
        return masked.sum() / (n.rows * cfg.max_completion_length) / n.gas
    if cfg.loss_type == "luspo":
        return masked.sum() / (n.rows * n.gas)
    return masked.sum() / n.items


def bonus_of_rows(entropy, mask, entropy_mask, n: Normalizers) -> torch.Tensor:
    e = mask if entropy_mask is None else mask * entropy_mask
    return (entropy * e).sum() / n.bonus_tokens / n.gas
