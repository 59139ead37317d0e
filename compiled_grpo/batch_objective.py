"""One call's objective: the loss family of `objectives` bound to a call's inputs, settings and step context,
with TRL's logged metrics. The schedules ask it for the loss of the batch, or of a set of whole rows.
"""

from __future__ import annotations

import functools
import math

import torch

from . import distributed, objectives
from .config import CLIPPED_LOSSES, TOKEN_COUNT_NORMALIZED, GRPOLossConfig
from .objectives import Batch, Normalizers, bonus_of_rows, per_token_loss, reduce_rows
from .step import Step


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


def metrics(
    cfg: GRPOLossConfig, batch: Batch, logp, entropy, entropy_mask, policy_loss, *, policy_scale=None, group=None
) -> dict:
    """TRL's logged metrics, each a 0-d tensor; `policy_scale` (None: no entropy bonus, no policy_loss) multiplies
    the logged policy loss."""
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
        if policy_scale is not None:
            ranks = distributed.world_size(group)
            out["policy_loss"] = distributed.all_sum(policy_loss.detach() * policy_scale, group) / ranks
        return out


# One graph per loss configuration, any batch shape (in one process: the cross-rank reductions stay eager).
compiled_metrics = torch.compile(metrics, dynamic=True)


# ---------------------------------------------------------------- the gradient the speed schedule needs per tile
def rows_loss(cfg: GRPOLossConfig, batch: Batch, coef, logp, entropy, norms: Normalizers, *, entropy_mask=None):
    """(loss, policy loss) of a set of whole rows as a function of tensors and settings alone (`coef` None: no
    entropy bonus), so that torch.func.grad and torch.compile can take it whole."""
    loss, _ = per_token_loss(logp, batch, cfg, entropy_mask)
    policy = reduce_rows(loss, batch.mask, cfg, norms)
    if coef is None:
        return policy, policy
    return policy - coef * bonus_of_rows(entropy, batch.mask, entropy_mask, norms), policy


def loss_value_and_gradients(
    cfg: GRPOLossConfig, batch: Batch, coef, logp, entropy, norms: Normalizers, *, entropy_mask=None
):
    """((d loss / d logp, d loss / d entropy) at every [B, T] position (zeros where the loss does not reach),
    (loss, policy loss))."""
    f = functools.partial(rows_loss, entropy_mask=entropy_mask)
    return torch.func.grad_and_value(f, argnums=(3, 4), has_aux=True)(cfg, batch, coef, logp, entropy, norms)


# One graph per loss configuration, any batch shape: the ~50 small kernels of the objective and its backward
# become a few, which at small hidden sizes is time the GPU otherwise spends waiting for the host.
compiled_loss_value_and_gradients = torch.compile(loss_value_and_gradients, dynamic=True)


def value_and_gradients_in_grad_mode(cfg, batch, coef, logp, entropy, norms, *, entropy_mask=None):
    """`compiled_loss_value_and_gradients` run in grad mode whatever the caller's (under `no_grad` or
    `inference_mode` too): one graph, whose value is the loss with and without grad mode alike (an eager loss
    there can round differently from the compiled graph in the last bit)."""
    with torch.enable_grad():
        return compiled_loss_value_and_gradients(cfg, batch, coef, logp, entropy, norms, entropy_mask=entropy_mask)


class LossWithGradients(torch.autograd.Function):
    """The loss's value, with its gradients w.r.t. logp and entropy taken up front (`loss_value_and_gradients`):
    the backward scales them instead of replaying the objective's eager backward."""

    @staticmethod
    def forward(ctx, value, logp, entropy, g_logp, g_entropy):
        ctx.save_for_backward(g_logp, g_entropy)  # freed by autograd after a backward unless retain_graph
        ctx.set_materialize_grads(False)
        return value.detach().clone()

    @staticmethod
    def backward(ctx, g):
        g_logp, g_entropy = ctx.saved_tensors
        scaled = lambda t: None if t is None or g is None else t * g
        return None, scaled(g_logp), scaled(g_entropy), None, None


# ---------------------------------------------------------------- the objective of one call
class Objective:
    """One call's objective: its settings, its [B,T] inputs, its step context and the data-parallel group.
    The batch tensors are made when first needed: on the GPU the schedules queue their first GEMM before
    these small kernels, so the GPU does not idle while the host launches them."""

    def __init__(self, cfg: GRPOLossConfig, inputs, step: Step, group=None, sequence_slices=None):
        self.cfg, self.inputs, self.step, self.group = cfg, inputs, step, group
        # `sequence_parallel.SequenceSlices` when the sequences are split across ranks, None otherwise
        self.sequence_slices = sequence_slices
        self.dtype = torch.float64 if inputs.hidden.dtype == torch.float64 else torch.float32

    def over_whole_sequences(self) -> Objective:
        """The objective of the sequences whose positions the ranks of `sequence_slices` share (their per-token
        inputs gathered), equal on every rank of that group."""
        from .sequence_parallel import gathered_inputs

        return Objective(self.cfg, gathered_inputs(self.inputs, self.sequence_slices), self.step, self.group)

    @functools.cached_property
    def batch(self) -> Batch:
        return objectives.make_batch(self.inputs, self.dtype)

    def normalizers(self, entropy_mask=None) -> Normalizers:
        return objectives.make_normalizers(self.batch, entropy_mask, self.step, self.group)

    def loss_of_rows(self, logp, entropy, norms: Normalizers, entropy_mask=None):
        """(loss, policy loss) of a set of whole rows (the other rows' values may be anything: their tokens do
        not reach the gradient of these); summing over a partition of the rows gives the batch's loss."""
        coef = self.step.entropy_coef if self.step.bonus_on else None
        return rows_loss(self.cfg, self.batch, coef, logp, entropy, norms, entropy_mask=entropy_mask)

    def coefficient(self, like):
        """The entropy bonus's coefficient as a 0-d tensor (a new float would recompile a graph), None when off."""
        coef = self.step.entropy_coef if self.step.bonus_on else None
        if coef is not None and not isinstance(coef, torch.Tensor):
            coef = like.new_full((), float(coef))
        return coef

    def token_gradients(self, logp, entropy, norms: Normalizers, compiled: bool = False):
        """d loss / d (logp, entropy) at every [B, T] position, without the entropy mask (the speed schedule's
        objectives); `compiled`: one torch.compile graph per loss configuration."""
        f = compiled_loss_value_and_gradients if compiled else loss_value_and_gradients
        gradients, _ = f(self.cfg, self.batch, self.coefficient(logp), logp, entropy, norms)
        return gradients

    def loss_and_metrics(self, logp, entropy, entropy_mask=None, norms: Normalizers | None = None, compiled=False):
        """The batch's loss (differentiable in logp and entropy) and TRL's metrics. `compiled`: the loss's value
        and gradients from one torch.compile graph (`LossWithGradients`), and the metrics from another."""
        norms = self.normalizers(entropy_mask) if norms is None else norms
        if not compiled:
            loss, policy = self.loss_of_rows(logp, entropy, norms, entropy_mask)
            return loss, self.metrics(logp, entropy, entropy_mask, policy)
        value, metrics, g_logp, g_entropy = self.value_metrics_and_gradients(logp, entropy, entropy_mask, norms, True)
        loss = value  # without grad mode: the same graph's value, so the grad-mode call's bits
        if torch.is_grad_enabled() and (logp.requires_grad or entropy.requires_grad):
            loss = LossWithGradients.apply(value, logp, entropy, g_logp, g_entropy)
        return loss, metrics

    def value_metrics_and_gradients(self, logp, entropy, entropy_mask=None, norms=None, compiled: bool = False):
        """(loss value, TRL's metrics, d loss / d logp, d loss / d entropy), the gradients at every [B, T] position
        and d loss / d entropy None without the entropy bonus (no entropy term); `compiled`: from the torch.compile
        graphs (their value in grad mode whatever the caller's), else eager (torch.func)."""
        norms = self.normalizers(entropy_mask) if norms is None else norms
        coef = self.coefficient(logp)
        f = value_and_gradients_in_grad_mode if compiled else loss_value_and_gradients
        (g_logp, g_entropy), (value, policy) = f(
            self.cfg, self.batch, coef, logp.detach(), entropy.detach(), norms, entropy_mask=entropy_mask
        )
        metrics = self.metrics(logp, entropy, entropy_mask, policy, compiled)
        return value, metrics, g_logp, None if coef is None else g_entropy

    def metrics(self, logp, entropy, entropy_mask, policy, compiled: bool = False) -> dict:
        """TRL's metrics; `compiled` (and one process): from one torch.compile graph per loss configuration."""
        scale = None
        if self.step.bonus_on:  # TRL logs it before the gas division, except for the token-count normalized losses
            scale = 1.0 if self.cfg.loss_type in TOKEN_COUNT_NORMALIZED else float(self.step.gas)
        f = compiled_metrics if compiled and not distributed.active(self.group) else metrics
        return f(self.cfg, self.batch, logp, entropy, entropy_mask, policy, policy_scale=scale, group=self.group)

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
