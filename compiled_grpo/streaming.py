"""lm_head tiles: fold a tile of logits into (logp, entropy, logsumexp), and turn it into its gradient.

Pure torch, no data-dependent control flow and no host syncs: these are the functions `torch.compile`
turns into kernels (`compiled=True`) or that run as they are (`compiled=False`). Tensors that travel together
come as NamedTuples (`head.Head`, `RowGradients`), which torch.compile traces field by field; every scalar that
may change between calls arrives as a tensor (`Head.values`: logit_scale, 1 / temperature, softcap), so new
values never recompile; only the presence of a bias, of a softcap and of a bias gradient shape the graph.

Logits of a tile: z = softcap(scale * (x @ W.T + b)) * inv_temp, in float32 from input-dtype GEMMs (inv_temp one
value, or one per row: `Head.row_inv_temp`).
Statistics, with m = max z: S = sum exp(z - m), U = sum exp(z - m) (z - m),
  lse = m + log S,  H = log S - U / S  (no cancellation for huge logits or near-zero entropy),
  logp = z[y] - lse.
Gradient: p = exp(z - lse),  dz = g_logp (onehot(y) - p) - g_H p (z - lse + H),
then through the softcap and scale: d raw = dz * scale * inv_temp * (1 - (z / (cap * inv_temp))**2).
The tiles hand back d raw in the GEMM dtype; the schedules (schedules/) turn it into dX, dW, accumulating sums
over tiles in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .head import CAP, INV_TEMP, SCALE, Head
from .products import gemm_product


class RowGradients(NamedTuple):
    """Per token of a tile, what the gradient of its logits needs: the target, the statistics of the
    statistics pass and the objective's gradients with respect to logp and entropy (g_entropy None: the
    entropy has no gradient anywhere, and the tile does not form its term)."""

    targets: torch.Tensor  # int32 (`compared_ids`)
    lse: torch.Tensor
    entropy: torch.Tensor
    g_logp: torch.Tensor
    g_entropy: torch.Tensor


def compared_ids(targets: torch.Tensor) -> torch.Tensor:
    """Targets as the gradient tiles compare them with each logit's vocabulary id (`RowGradients.targets`): int32.
    Each logit loads its row's target: with int64 ids the gradient kernel of an [8192, 8192] tile took 111 us on an
    H200, with int32 97 us. A vocabulary has far fewer than 2**31 ids."""
    return targets.to(torch.int32)


def stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def tile_logits(x, head: Head) -> torch.Tensor:
    """z = softcap(scale * (x @ w.T + b)) * inv_temp for x [n,H], w [v,H]: [n,v] in float32 (float64 input: 64)."""
    return logits_from_product(gemm_product(x, head), head)


def logits_from_product(product, head: Head) -> torch.Tensor:
    """The logits from the GEMM output x @ w.T (`gemm_product`; a pointwise epilogue Inductor fuses into its
    readers), in float32 whatever the product's dtype."""
    product = product.to(stat_dtype(product))
    z = product if head.bias is None else product + head.bias.to(product.dtype)
    if not head.softcap:  # one multiply per logit: the two factors are multiplied once per tile (or row)
        return z * (head.values[SCALE] * inverse_temperature(head))
    z = head.values[CAP] * torch.tanh(z * head.values[SCALE] / head.values[CAP])
    return z * inverse_temperature(head)


def inverse_temperature(head: Head) -> torch.Tensor:
    """1 / temperature: the head's scalar, or a [n, 1] column of the tile's per-row values."""
    return head.values[INV_TEMP] if head.row_inv_temp is None else head.row_inv_temp.unsqueeze(-1)


LOG2E = 1.4426950408889634


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for the one exponential per logit of the fold and of the gradient: on a GPU as 2**(x log2 e), since
    its exp2 is one instruction where exp is a range-reduced sequence of several and these kernels are bound by
    their instruction count more than by their reads. x <= 0 here (logits less their max or their lse): rounding
    x log2 e changes exp(x) by at most |x| 2**-24 relatively, and the terms with a large |x| are the negligible
    ones. On a CPU exp is vectorized as cheaply and keeps its accuracy to the last bit, which float32 runs compared
    step for step with TRL's trainers see through Adam's first update."""
    if x.is_cuda:
        return torch.exp2(x * LOG2E)
    return torch.exp(x)


FOLD_CHUNK = 8192  # vocabulary entries per chunk of the fold: re-read from cache (fastest of 256..8192 on an H200)


def _fold_rows(z: torch.Tensor, extras: bool = False):
    """Over the last dim: m = max z, s = sum exp(z - m), u = sum exp(z - m) (z - m); with `extras` also
    q = sum exp(z - m)^2, the sum of z and the first index of the max."""
    m = z.amax(-1, keepdim=True)
    shifted = z - m
    e = exp(shifted)
    folded = (m.squeeze(-1), e.sum(-1), (e * shifted).sum(-1))
    if not extras:
        return folded
    # the first index of the max as the least index where z is the max: a plain min in the loop that sums, where
    # argmax would be a reduction of (value, index) pairs of its own
    index = torch.arange(z.shape[-1], device=z.device)
    first = torch.where(shifted == 0, index, z.shape[-1]).amin(-1)
    return folded + ((e * e).sum(-1), z.sum(-1), first)


def _fold(z: torch.Tensor, extras: bool = False):
    """(m, s, u) per row of z [n,V] (with `extras`: and q, sum z, argmax z, as `_fold_rows`), in one read of z:
    each row is folded in chunks of FOLD_CHUNK entries (the max and the sums of a chunk come from the same cached
    data, where a whole row of 152k float32 would be read twice from memory), and the chunks are combined
    rescaled to the row max. Every term of the combined u is <= 0, so the sum has no cancellation."""
    n, vocab = z.shape
    whole = vocab // FOLD_CHUNK * FOLD_CHUNK
    parts = []
    if whole:
        parts.append(_fold_rows(z[:, :whole].view(n, whole // FOLD_CHUNK, FOLD_CHUNK), extras))
    if whole < vocab:
        parts.append(_fold_rows(z[:, whole:].unsqueeze(1), extras))
    m_c, s_c, u_c, *more = (torch.cat(p, dim=1) for p in zip(*parts, strict=True))
    m = m_c.amax(-1, keepdim=True)
    gap = m_c - m
    rescale = torch.exp(gap)
    folded = (m.squeeze(-1), (s_c * rescale).sum(-1), (rescale * (u_c + s_c * gap)).sum(-1))
    if not extras:
        return folded
    q_c, sum_c, argmax_c = more
    first = m_c.argmax(-1, keepdim=True)  # the first chunk that holds the row's max (the tail chunk is last)
    argmax = argmax_c.gather(-1, first).squeeze(-1) + first.squeeze(-1) * FOLD_CHUNK
    return folded + ((q_c * rescale * rescale).sum(-1), sum_c.sum(-1), argmax)


def fold_statistics(z: torch.Tensor, targets: torch.Tensor):
    """(logp, entropy, lse) per row of a full-vocabulary logits tile z [n,V]."""
    return _statistics_of_fold(z, targets, *_fold(z))


def _statistics_of_fold(z, targets, m, s, u):
    log_s = torch.log(s)
    lse = m + log_s
    entropy = log_s - u / s
    # Clamped: an id outside the vocabulary (reachable only with validate=False) gives a meaningless logp, not a
    # device-side assert that would end the process (fused into the gather: no extra pass).
    logp = z.gather(-1, targets.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) - lse
    return logp, entropy, lse


def partial_statistics_tile(x, local_targets, head: Head):
    """Vocabulary-parallel stats pass: (m, s, u, target logit) of one token tile against this rank's slice of
    the vocabulary, the target logit 0 where the target lies in another rank's slice (distributed.py combines)."""
    return _partial_fold(tile_logits(x, head), local_targets)


def _partial_fold(z, local_targets):
    m, s, u = _fold(z)
    owned = (local_targets >= 0) & (local_targets < z.shape[-1])
    target = z.gather(-1, local_targets.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return m, s, u, torch.where(owned, target, 0.0)


def merge_partials(a: tuple, b: tuple) -> tuple:
    """Two vocabulary slices' (m, s, u, target logit) per row as one slice's: both rescaled to the larger max M,
    s e^(m - M) and e^(m - M) (u + s (m - M)) summed (every term of u stays <= 0), the target logits added (each
    slice gives 0 for a target outside it)."""
    (m_a, s_a, u_a, t_a), (m_b, s_b, u_b, t_b) = a, b
    m = torch.maximum(m_a, m_b)
    gap_a, gap_b = m_a - m, m_b - m
    scale_a, scale_b = torch.exp(gap_a), torch.exp(gap_b)
    return m, s_a * scale_a + s_b * scale_b, (u_a + s_a * gap_a) * scale_a + (u_b + s_b * gap_b) * scale_b, t_a + t_b


def partial_statistics_and_product_tile(x, local_targets, head: Head):
    """`partial_statistics_tile` that also hands back the GEMM output x @ w.T of this rank's slice (the speed
    schedule's vocabulary-parallel tile)."""
    product = gemm_product(x, head)
    return _partial_fold(logits_from_product(product, head), local_targets) + (product,)


def logits_gradient(z, onehot, rows: RowGradients, head: Head) -> torch.Tensor:
    """d loss / d (x @ W.T + b) for a logits tile, given the loss's gradients w.r.t. logp and entropy."""
    log_p = z - rows.lse.unsqueeze(-1)
    p = exp(log_p)
    dz = rows.g_logp.unsqueeze(-1) * (onehot.to(p.dtype) - p)
    if rows.g_entropy is not None:  # None: the entropy has no gradient, and its term is not formed
        dz = dz - rows.g_entropy.unsqueeze(-1) * p * (log_p + rows.entropy.unsqueeze(-1))
    inv_temp = inverse_temperature(head)
    scale = head.values[SCALE] * inv_temp
    if head.softcap:
        t = z / (head.values[CAP] * inv_temp)
        return dz * scale * (1 - t * t)
    return dz * scale


def statistics_tile(x, targets, head: Head):
    """Stats pass of one token tile against the whole vocabulary: (logp, entropy, lse)."""
    return fold_statistics(tile_logits(x, head), targets)


def statistics_and_product_tile(x, targets, head: Head):
    """Stats of one token tile that also hand back the GEMM output x @ w.T (not the logits: returning those
    would write a second [n,V] float32 tensor), for a gradient on the same tile."""
    product = gemm_product(x, head)
    return fold_statistics(logits_from_product(product, head), targets) + (product,)


def gradient_from_product_tile(product, rows: RowGradients, head: Head, out, need_b: bool):
    """The gradient of one token tile's raw logits over the whole vocabulary, from the GEMM output x @ W.T,
    written into `out` ([n,V] in the GEMM dtype, a slice of a larger buffer); returns its bias part."""
    z = logits_from_product(product, head)
    onehot = rows.targets.unsqueeze(-1) == torch.arange(z.shape[-1], device=z.device, dtype=rows.targets.dtype)
    d_raw = logits_gradient(z, onehot, rows, head)
    out.copy_(d_raw)
    return d_raw.sum(0) if need_b else None


def gradient_vocab_tile(x, rows: RowGradients, head: Head, v0):
    """Recompute the logits of token tile x against a vocabulary slice (`head` sliced to rows v0..v0+v of the
    vocabulary) and return the gradient of those raw logits (x's dtype) and its bias part (float32)."""
    z = tile_logits(x, head)
    onehot = (rows.targets - v0).unsqueeze(-1) == torch.arange(z.shape[-1], device=z.device, dtype=rows.targets.dtype)
    d_raw = logits_gradient(z, onehot, rows, head)
    return d_raw.to(x.dtype), d_raw.sum(0) if head.bias is not None else None


def statistics_with_extras_tile(x, targets, head: Head):
    """`statistics_tile`'s (logp, entropy, lse) and, from the same read of the logits, TRL's other per-token
    fields: log sum_v p_v^2, the mean logit and whether the target is the first maximal logit (argmax takes the
    lowest id among ties)."""
    z = tile_logits(x, head)
    m, s, u, q, z_sum, argmax = _fold(z, extras=True)
    statistics = _statistics_of_fold(z, targets, m, s, u)
    log_sum_sq = torch.log(q) - 2 * torch.log(s)
    return statistics + (log_sum_sq, z_sum / z.shape[-1], argmax == targets.clamp(0, z.shape[-1] - 1))
