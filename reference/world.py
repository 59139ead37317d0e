"""What the reference needs from torch.distributed: world size, a sum, and a gather of ragged tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def all_sum(x: torch.Tensor) -> torch.Tensor:
    if not is_distributed():
        return x
    x = x.clone()
    dist.all_reduce(x)
    return x


def gather_ragged(x: torch.Tensor) -> torch.Tensor:
    """Concatenate a 1-d tensor of any length from every rank (some may hold none)."""
    if not is_distributed():
        return x
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, x.cpu())
    return torch.cat(parts).to(x.device)
