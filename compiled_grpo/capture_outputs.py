"""A captured graph's outputs: small tensors packed into one static buffer per dtype, copied out in one go.

A graph writes its outputs into static buffers that the next replay overwrites, so every replay's results are
copied out. A call's outputs are dozens of small tensors (metrics, per-token values): copied one by one, each copy
is a launch. Here each small output is a slice of one buffer per dtype and device that the graph writes
(`StaticOutputs.of`, called inside the capture), so a replay's results come out in a copy or two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

# Outputs of at most this many elements share one static buffer per dtype (metrics, per-token values); larger
# ones (a gradient pass's dW, dX) are copied out on their own, so packing never adds a copy of a large tensor.
PACKED_NUMEL = 1 << 18


@dataclass(frozen=True)
class Packed:
    """Where a small output lies: the next slice of one of `StaticOutputs.buffers`."""

    buffer: int
    shape: torch.Size


@dataclass
class StaticOutputs:
    """A graph's outputs (a pytree): each small tensor a slice of one buffer per dtype and device, which the
    graph writes (`of`, called inside the capture), the large ones and non-tensors as they are."""

    spec: object  # the pytree's structure
    leaves: list  # a leaf (a large tensor, a non-tensor) or `Packed`
    buffers: list

    @classmethod
    def of(cls, outputs) -> StaticOutputs:
        leaves, spec = pytree.tree_flatten(outputs)
        groups: dict = {}
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and t.numel() <= PACKED_NUMEL:
                groups.setdefault((t.dtype, t.device), []).append(i)
        buffers = []
        for members in groups.values():
            buffers.append(torch.cat([leaves[i].reshape(-1) for i in members]))
            for i in members:
                leaves[i] = Packed(len(buffers) - 1, leaves[i].shape)
        return cls(spec, leaves, buffers)

    def tensors(self) -> list:
        """Every static tensor the graph writes."""
        return self.buffers + [t for t in self.leaves if isinstance(t, torch.Tensor)]

    def copied(self):
        """The outputs, copied out of the static buffers (one copy per buffer and per large tensor)."""
        parts = [iter(b.clone().split(sizes)) for b, sizes in zip(self.buffers, self.sizes(), strict=True)]

        def leaf(v):
            if isinstance(v, Packed):
                part = next(parts[v.buffer])
                return part if part.shape == v.shape else part.view(v.shape)
            return v.clone() if isinstance(v, torch.Tensor) else v

        return pytree.tree_unflatten([leaf(v) for v in self.leaves], self.spec)

    def sizes(self) -> list[list[int]]:
        """The element counts of each buffer's tensors, in order."""
        sizes = [[] for _ in self.buffers]
        for v in self.leaves:
            if isinstance(v, Packed):
                sizes[v.buffer].append(v.shape.numel())
        return sizes
