"""torch.distributed, as the loss uses it: data-parallel reductions and vocabulary-parallel statistics.

A group argument is a torch.distributed process group, None for the default (world) group, or `LOCAL` for
"this process alone" (no communication), which is what a vocabulary-parallel loss uses for its batch
reductions unless told otherwise: its ranks hold the same tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LOCAL = "local"


def active(group=None) -> bool:
    return group is not LOCAL and dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if active(group) else 1


def all_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    if not active(group):
        return x
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def all_max_(x: torch.Tensor, group=None) -> torch.Tensor:
    if active(group):
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def all_sum_(x: torch.Tensor, group=None) -> torch.Tensor:
    if active(group):
        dist.all_reduce(x, group=group)
    return x


def gather_ragged(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate a 1-d tensor of any length (0 included) from every rank: counts first, then the padded
    values; padding is cut by count, so no sentinel value can collide with real data."""
    if not active(group):
        return x
    n = torch.tensor([x.numel()], device=x.device)
    counts = [torch.zeros_like(n) for _ in range(world_size(group))]
    dist.all_gather(counts, n, group=group)
    counts = [int(c) for c in counts]
    padded = torch.zeros(max(counts), dtype=x.dtype, device=x.device)
    padded[: x.numel()] = x
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])


def combine_vocab_shards(m, s, u, target, group):
    """(logp, entropy, lse) from each rank's statistics over its vocabulary slice: m = max z, s = sum exp(z - m),
    u = sum exp(z - m) (z - m), target = the target's logit where this rank owns it, else 0.
    Rescaled to the global max M: S = sum_r s_r e^(m_r - M), U = sum_r e^(m_r - M) (u_r + s_r (m_r - M))."""
    big_m = all_max_(m.clone(), group)
    scale = torch.exp(m - big_m)
    s_u_t = torch.stack([s * scale, (u + s * (m - big_m)) * scale, target])
    s_all, u_all, t_all = all_sum_(s_u_t, group)
    log_s = torch.log(s_all)
    lse = big_m + log_s
    return t_all - lse, log_s - u_all / s_all, lse


def full_tensor(t):
    """A DTensor (FSDP2's sharded parameter) gathered once. Its gradient flows back reduce-scattered into the
    DTensor's layout, averaged over the mesh as FSDP2 averages its own: each rank's gradient of the whole tensor is a
    partial one (its own batch's), which `full_tensor()`'s default (a replicated gradient: each rank keeps its own
    slice, unreduced) would leave unreduced."""
    try:
        from torch.distributed.tensor import DTensor, Partial
    except ImportError:  # torch without DTensor
        return t
    if not isinstance(t, DTensor):
        return t
    return t.full_tensor(grad_placements=[Partial("avg")] * t.device_mesh.ndim)
