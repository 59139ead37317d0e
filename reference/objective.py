"""The GRPO loss family on [B,T] tensors: TRL 1.16.0's `_compute_loss`, one function per concept.

Shapes: `logp`, `entropy`, `mask` are [B,T]; advantages are [B,1] or [B,T]; a sequence-level ratio is [B,1]
and broadcasts to [B,T] as soon as a [B,T] factor joins, exactly as in TRL.
"""

from __future__ import annotations

import math

import torch

from . import world
from .settings import Settings

QUANTILE_LIMIT = 2**24  # torch.quantile refuses larger inputs


# ---------------------------------------------------------------- masks
def quantile_linear(values: torch.Tensor, p: float) -> torch.Tensor:
    """torch.quantile(values, p) (linear interpolation); past 2**24 values, the same from a sort, with the
    interpolation's rank p * (n - 1) taken in float64 (float32 cannot index that far exactly)."""
    n = values.numel()
    if n <= QUANTILE_LIMIT:
        return torch.quantile(values, p)
    v = values.sort().values
    pos = p * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return torch.lerp(v[lo], v[hi], torch.tensor(pos - lo, dtype=v.dtype, device=v.device))


def entropy_threshold(entropy: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor | None:
    """tau = quantile(H[m == 1] as float32 from every rank, 1 - q); None when no rank holds an active token."""
    values = world.gather_ragged(entropy.detach()[mask].float())
    if values.numel() == 0:
        return None
    return quantile_linear(values, 1.0 - q)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor | None:
    """mask_H = (H * m >= tau) & m: the top-q highest-entropy active tokens (ties kept); None when q = 1.

    The comparison, like the threshold, reads the entropies as float32: TRL's head returns float32 entropies, so
    in its runs the token whose entropy the quantile lands on equals tau and is kept. Comparing the float64
    entropies against a float32 tau would drop that token whenever its float64 value lies below its rounding
    (about half the time). Everything else in the reference stays float64."""
    if q >= 1.0:
        return None
    tau = entropy_threshold(entropy, mask, q)
    if tau is None:
        return torch.zeros_like(mask)
    as_trl = entropy.detach().float() * mask.float()
    return ((as_trl >= tau) & mask).to(mask.dtype)


def off_policy_keep(advantages, logp, sampling_logp, mask, threshold: float) -> torch.Tensor:
    """OPSM: keep_i = (A_i >= 0) | (mean_t over m of nan_to_num(s - logp) <= threshold); NaN s = unscored."""
    kl = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)
    kl = torch.where(mask.bool(), kl, 0.0)
    seq_kl = kl.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (seq_kl <= threshold)).to(logp.dtype)


# ---------------------------------------------------------------- ratios and KL
def log_importance_weights(logp, old_logp, mask, level: str) -> torch.Tensor:
    """token: r = logp - old [B,T]; sequence: sum_t m r / max(L_i, 1) [B,1]."""
    r = logp - old_logp
    if level == "token":
        return r
    return ((r * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def kl_to_reference(logp, ref_logp, coef_1, bias_correction: bool) -> torch.Tensor:
    """k3 estimator exp(ref - logp) - (ref - logp) - 1, times coef_1 with `use_bias_correction_kl`."""
    d = ref_logp - logp
    kl = torch.exp(d) - d - 1
    return kl * coef_1 if bias_correction else kl


# ---------------------------------------------------------------- per-token policy losses
def by_sign(condition, if_true: float, if_false: float, like: torch.Tensor) -> torch.Tensor:
    """A per-sequence or per-token constant in `like`'s dtype (TRL's torch.where rounds it to float32)."""
    t = torch.tensor(if_true, dtype=like.dtype, device=like.device)
    return torch.where(condition, t, torch.tensor(if_false, dtype=like.dtype, device=like.device))


def clipped_loss(coef_1, advantages, s: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(coef_1 A, clamp(coef_1, 1 - eps_low, 1 + eps_high) A), coef_1 capped at delta first when set.
    Returns the loss and the (capped) coef_1 that the clip metrics read."""
    coef_2 = coef_1.clamp(1 - s.epsilon_low, 1 + s.eps_high)
    if s.delta is not None:
        coef_1 = coef_1.clamp(max=s.delta)
    return -torch.min(coef_1 * advantages, coef_2 * advantages), coef_1


def cispo_loss(coef_1, advantages, logp, s: Settings) -> torch.Tensor:
    """-detach(min(coef_1, eps_high)) A logp: REINFORCE with a capped, gradient-free IS weight."""
    return -coef_1.clamp(max=s.eps_high).detach() * advantages * logp


def sapo_loss(coef_1, advantages, s: Settings) -> torch.Tensor:
    """-(4 / tau) sigmoid(tau (coef_1 - 1)) A, tau = sapo_temperature_pos if A > 0 else _neg."""
    tau = by_sign(advantages > 0, s.sapo_temperature_pos, s.sapo_temperature_neg, coef_1)
    return -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * advantages


@torch.no_grad()
def vespo_phi(advantages, log_ratio, mask, is_ratio, s: Settings) -> torch.Tensor:
    """phi = exp(lam + k lw - lam exp(lw)), no gradient, NaN/inf -> 0, where
    lw = clamp(sum_t m clamp(r, -20, 20) [+ sum_t clamp(log is_ratio, log 1e-8, 20) over all T], log 1e-8, 20)
    and (k, lam) = (k_pos, lam_pos) if A >= 0 else (k_neg, lam_neg), lam >= 1e-4."""
    low = math.log(1e-8)
    lw = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        lw = lw + torch.log(is_ratio).clamp(low, 20.0).sum(-1, keepdim=True)
    lw = lw.clamp(low, 20.0)
    nonneg = advantages >= 0
    k = by_sign(nonneg, s.vespo_k_pos, s.vespo_k_neg, lw)
    lam = by_sign(nonneg, s.vespo_lambda_pos, s.vespo_lambda_neg, lw).clamp(min=1e-4)
    phi = torch.exp(lam + k * lw - lam * torch.exp(lw))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


# ---------------------------------------------------------------- normalization
def normalize(per_token_loss, mask, s: Settings, num_items, num_processes, gas, spg) -> torch.Tensor:
    """Reduce the per-token loss to the scalar each loss type defines (docs/semantics.md, "Normalization")."""
    masked = per_token_loss * mask
    if s.loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / gas
    if s.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / gas
    if s.loss_type == "dr_grpo":
        return masked.sum() / (per_token_loss.shape[0] * s.max_completion_length) / gas
    if s.loss_type == "luspo":
        return masked.sum(-1).mean() / gas
    return masked.sum() / (torch.as_tensor(num_items, dtype=masked.dtype).clamp(min=1.0) / num_processes * gas / spg)


def policy_loss_metric(loss_before_bonus, s: Settings, gas) -> torch.Tensor:
    """TRL logs the policy loss before the gas division, except for dapo/cispo/vespo (after the normalizer)."""
    if s.loss_type in ("dapo", "cispo", "vespo"):
        return loss_before_bonus.detach()
    return loss_before_bonus.detach() * gas


def entropy_bonus(entropy, mask, entropy_mask, gas) -> torch.Tensor:
    """mean of H over e = m * mask_H (or m), divided by gas; differentiable through H."""
    e = mask if entropy_mask is None else mask * entropy_mask
    return (entropy * e).sum() / e.sum().clamp(min=1.0) / gas


# ---------------------------------------------------------------- metrics
def is_per_sequence(x, mask) -> bool:
    """A [B,1] value of a [B,T>1] batch. (TRL tests only `x.shape[1] == 1`, so with T = 1 it averages masked
    rows too, reading values that are meant to be ignored; here a T = 1 batch is masked like any other.)"""
    return x.shape[1] == 1 and mask.shape[1] > 1


def masked_mean(x, mask) -> torch.Tensor:
    """TRL's global_masked_mean: over active tokens, or over sequences when x is [B,1]; summed over ranks."""
    if is_per_sequence(x, mask):
        totals = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), dtype=x.dtype, device=x.device)])
    else:
        totals = torch.stack([(x * mask).sum(), mask.sum().to(x.dtype)])
    totals = world.all_sum(totals.detach())
    return totals[0] / totals[1].clamp(min=1.0)


def per_sequence_mean(x, mask) -> torch.Tensor:
    """TRL's masked_seq_mean: one value per sequence; NaN for a fully masked row (ignored by nanmin/nanmax)."""
    if is_per_sequence(x, mask):
        return x.squeeze(1)
    return (x * mask).sum(-1) / mask.sum(-1)


def nan_extreme(x: torch.Tensor, pick) -> torch.Tensor:
    x = world.gather_ragged(x.detach())
    x = x[~torch.isnan(x)]
    return pick(x) if x.numel() else torch.tensor(float("nan"), dtype=x.dtype, device=x.device)


def clip_metrics(coef_1, advantages, mask, s: Settings) -> dict[str, torch.Tensor]:
    low = ((coef_1 < 1 - s.epsilon_low) & (advantages < 0)).to(mask.dtype)
    high = ((coef_1 > 1 + s.eps_high) & (advantages > 0)).to(mask.dtype)
    region = ((low + high) > 0).to(mask.dtype)
    return {
        "clip_ratio/low_mean": masked_mean(low, mask),
        "clip_ratio/high_mean": masked_mean(high, mask),
        "clip_ratio/region_mean": masked_mean(region, mask),
        "clip_ratio/low_min": nan_extreme(per_sequence_mean(low, mask), torch.min),
        "clip_ratio/high_max": nan_extreme(per_sequence_mean(high, mask), torch.max),
    }
