"""Process-group reductions the loss needs: world size, sums and a gather of ragged tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist


def active(group=None) -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if active(group) else 1


def all_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    if not active(group):
        return x
    x = x.clone()
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
