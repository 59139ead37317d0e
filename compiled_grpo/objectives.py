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

`loss_of_rows` computes the contribution of any subset of whole rows with the batch-global normalizers, so the
speed schedule can take gradients tile by tile and the sum over tiles equals the loss of the whole batch.
`Objective` binds a call's inputs, settings and step context; the schedules ask it for the loss.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import distributed
from .config import CLIPPED_LOSSES, TOKEN_COUNT_NORMALIZED, GRPOLossConfig


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
class Step:
    """Where a micro-batch sits in training: the normalizers' context and the (per-call) entropy coefficient."""

    gradient_accumulation_steps: int = 1
    steps_per_generation: int | None = None  # None: gradient_accumulation_steps
    num_items_in_batch: int | float | torch.Tensor | None = None  # None: spg x this micro-batch's active tokens
    num_processes: int = 1
    entropy_coef: float | torch.Tensor = 0.0

    @property
    def gas(self) -> int:
        return self.gradient_accumulation_steps

    @property
    def spg(self) -> int:
        return self.gas if self.steps_per_generation is None else self.steps_per_generation

    @property
    def bonus_on(self) -> bool:
        """Whether the entropy bonus may be non-zero (a tensor coefficient is not read back to find out)."""
        return not (isinstance(self.entropy_coef, float) and self.entropy_coef == 0.0)


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


def make_normalizers(batch: Batch, entropy_mask, step: Step, group=None) -> Normalizers:
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


# ---------------------------------------------------------------- metrics
def _is_per_sequence(x, mask) -> bool:
    # TRL tests x.shape[1] == 1 alone; with T = 1 that would average masked rows too, so T = 1 is masked here.
    return x.shape[1] == 1 and mask.shape[1] > 1


def masked_mean(x, mask, group=None) -> torch.Tensor:
    if _is_per_sequence(x, mask):
        totals = torch.stack([x.sum(), x.new_full((), float(x.shape[0]))])
    else:
        totals = torch.stack([(x * mask).sum(), mask.sum().to(x.dtype)])
    totals = distributed.all_sum(totals.detach(), group)
    return totals[0] / totals[1].clamp(min=1.0)


def _sequence_extreme(x, mask, pick, group=None) -> torch.Tensor:
    """min or max over rows of the row means, rows without tokens (NaN) left out; NaN when none is left.
    Without boolean indexing, which would make the host wait for the GPU."""
    per_row = x.squeeze(1) if _is_per_sequence(x, mask) else (x * mask).sum(-1) / mask.sum(-1)
    per_row = distributed.gather_ragged(per_row.detach(), group)
    empty = torch.isnan(per_row)
    neutral = math.inf if pick is torch.min else -math.inf
    if per_row.numel() == 0:
        return per_row.new_full((), math.nan)
    value = pick(torch.where(empty, neutral, per_row))
    return torch.where(empty.all(), math.nan, value)


def metrics(objective: Objective, logp, entropy, entropy_mask, policy_loss) -> dict:
    """TRL's logged metrics, each a 0-d tensor."""
    batch, cfg, group = objective.batch, objective.cfg, objective.group
    with torch.no_grad():
        _, seen = per_token_loss(logp.detach(), batch, cfg, entropy_mask)
        m, adv = batch.mask, batch.advantages
        out = {}
        if "kl" in seen:
            out["kl"] = masked_mean(seen["kl"], m, group)
        out["entropy"] = masked_mean(entropy, m, group)
        if cfg.loss_type in CLIPPED_LOSSES:
            c1 = seen["coef_1"]
            low = ((c1 < 1 - cfg.epsilon_low) & (adv < 0)).to(m.dtype)
            high = ((c1 > 1 + cfg.eps_high) & (adv > 0)).to(m.dtype)
            out["clip_ratio/low_mean"] = masked_mean(low, m, group)
            out["clip_ratio/high_mean"] = masked_mean(high, m, group)
            out["clip_ratio/region_mean"] = masked_mean(((low + high) > 0).to(m.dtype), m, group)
            out["clip_ratio/low_min"] = _sequence_extreme(low, m, torch.min, group)
            out["clip_ratio/high_max"] = _sequence_extreme(high, m, torch.max, group)
        elif cfg.loss_type == "cispo":
            clipped = ((seen["coef_1"] > cfg.eps_high) & (adv > 0)).to(m.dtype)
            out["cispo_clip_ratio"] = masked_mean(clipped, m, group)
        elif cfg.loss_type == "vespo":
            out["vespo/phi_seq_mean"] = masked_mean(seen["phi"], m, group)
        if objective.step.bonus_on:
            # TRL logs it before the gas division, except for the token-count normalized losses
            scale = 1.0 if cfg.loss_type in TOKEN_COUNT_NORMALIZED else objective.step.gas
            ranks = distributed.world_size(group)
            out["policy_loss"] = distributed.all_sum(policy_loss.detach() * scale, group) / ranks
        return out


# ---------------------------------------------------------------- the objective of one call
class Objective:
    """One call's objective: its settings, its [B,T] inputs, its step context and the data-parallel group.
    The batch tensors are made when first needed: on the GPU the schedules queue their first GEMM before
    these small kernels, so the GPU does not idle while the host launches them."""

    def __init__(self, cfg: GRPOLossConfig, inputs, step: Step, group=None):
        self.cfg, self.inputs, self.step, self.group = cfg, inputs, step, group
        self.dtype = torch.float64 if inputs.hidden.dtype == torch.float64 else torch.float32

    @functools.cached_property
    def batch(self) -> Batch:
        return make_batch(self.inputs, self.dtype)

    def normalizers(self, entropy_mask=None) -> Normalizers:
        return make_normalizers(self.batch, entropy_mask, self.step, self.group)

    def loss_of_rows(self, logp, entropy, norms: Normalizers, entropy_mask=None):
        """(loss, policy loss) of a set of whole rows (the other rows' values may be anything: their tokens do
        not reach the gradient of these); summing over a partition of the rows gives the batch's loss."""
        cfg, batch = self.cfg, self.batch
        loss, _ = per_token_loss(logp, batch, cfg, entropy_mask)
        policy = reduce_rows(loss, batch.mask, cfg, norms)
        if not self.step.bonus_on:
            return policy, policy
        return policy - self.step.entropy_coef * bonus_of_rows(entropy, batch.mask, entropy_mask, norms), policy

    def loss_and_metrics(self, logp, entropy, entropy_mask=None, norms: Normalizers | None = None):
        """The batch's loss (differentiable in logp and entropy) and TRL's metrics."""
        norms = self.normalizers(entropy_mask) if norms is None else norms
        loss, policy = self.loss_of_rows(logp, entropy, norms, entropy_mask)
        return loss, metrics(self, logp, entropy, entropy_mask, policy)

    def zero_gradient_tokens(self) -> torch.Tensor | None:
        """[B,T] bool, True at active tokens whose gradient is known to be exactly 0 before any statistic is
        seen; None when there can be none. Every policy loss is a multiple of the advantage, so a token with
        advantage 0 has a zero gradient unless the KL term (beta != 0) or the entropy bonus reaches it. Where the
        objective couples a sequence's tokens, a token gets gradient through the others: whole rows only."""
        if self.cfg.beta != 0.0 or self.step.bonus_on:
            return None
        mask = self.inputs.completion_mask.bool()
        adv = self.inputs.advantages
        zero = (adv == 0).unsqueeze(1).expand(mask.shape) if adv.dim() == 1 else adv == 0
        if self.cfg.couples_sequence:
            zero = (zero | ~mask).all(-1, keepdim=True).expand(mask.shape)
        return zero & mask
