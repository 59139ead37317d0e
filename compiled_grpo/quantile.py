"""The batch-global entropy threshold of `top_entropy_quantile` (TRL's get_high_entropy_mask).

tau = quantile(all active entropies as float32, over every rank, 1 - q) with linear interpolation, and
mask = (H * m >= tau) & m. torch.quantile refuses more than 2**24 values; past that, the same interpolation
from a sort, with the rank p * (n - 1) computed in float64 (float32 cannot index that far exactly).
"""

from __future__ import annotations

import math

import torch

from . import distributed

TORCH_QUANTILE_LIMIT = 2**24


def linear_quantile(values: torch.Tensor, p: float) -> torch.Tensor:
    """`torch.quantile(values, p)` for a 1-d float32 tensor of any length."""
    n = values.numel()
    if n <= TORCH_QUANTILE_LIMIT:
        return torch.quantile(values, p)
    pos = p * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    # kthvalue is 1-based; two order statistics are cheaper than a full sort
    v_lo = torch.kthvalue(values, lo + 1).values
    v_hi = torch.kthvalue(values, hi + 1).values if hi != lo else v_lo
    return torch.lerp(v_lo, v_hi, pos - lo)


def entropy_threshold(active_entropy: torch.Tensor, q: float, group=None) -> torch.Tensor | None:
    """Threshold over this rank's active entropies and every other rank's; None when no rank has any."""
    values = distributed.gather_ragged(active_entropy.detach().float(), group)
    if values.numel() == 0:
        return None
    return linear_quantile(values, 1.0 - q)


def masked_linear_quantile(values: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """`torch.quantile(values[keep].float(), p)` bitwise, with no read of the count back to the host (so inside a
    CUDA graph): the values outside `keep` sort last as +inf, and the ranks come from the count on the device,
    taken as torch.quantile takes them (float32 p * (n - 1), truncated below and ceiled above, one lerp; NaN
    among the kept values gives NaN). For at most `TORCH_QUANTILE_LIMIT` values; no kept value gives +inf."""
    flat, keep = values.reshape(-1).float(), keep.reshape(-1).bool()
    ordered = torch.where(keep, flat, math.inf).sort().values
    last = (keep.sum() - 1).clamp(min=0)
    ranks = torch.full((), p, dtype=torch.float32, device=flat.device) * last.float()
    below = ranks.long()
    at = lambda rank: ordered.index_select(0, rank.view(1)).view(())  # a 0-d index would read it back (`.item()`)
    tau = torch.lerp(at(below), at(ranks.ceil().long()), ranks - below)
    tau = torch.where(keep.any(), tau, math.inf)
    return torch.where((flat.isnan() & keep).any(), math.nan, tau)


def high_entropy_mask_on_device(entropy: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """`high_entropy_mask` of one process, as device work only (`masked_linear_quantile`)."""
    mask = mask.bool()
    return at_least(entropy, mask, masked_linear_quantile(entropy.detach(), mask, 1.0 - q))


def at_least(entropy: torch.Tensor, mask: torch.Tensor, tau) -> torch.Tensor:
    """[B,T] bool: the active tokens (`mask`, bool) whose entropy is at least `tau` (TRL's comparison, on float32
    entropies as TRL's head returns them: float64 ones compared with a float32 tau would drop the tied token)."""
    return (entropy.detach().float() * mask >= tau) & mask


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, q: float, group=None, active=None) -> torch.Tensor:
    """[B,T] bool: the active tokens whose entropy is at least the batch-global (1 - q) quantile. `active`, the
    flat positions of the active tokens where the caller has them, saves a boolean index (a wait on the GPU)."""
    mask = mask.bool()
    values = entropy[mask] if active is None else entropy.reshape(-1).index_select(0, active)
    tau = entropy_threshold(values, q, group)
    if tau is None:
        return torch.zeros_like(mask)
    return at_least(entropy, mask, tau)
