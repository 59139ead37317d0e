"""Token compaction and tile plans: which active token goes to which slot of which static-shape tile.

Padded positions never reach the lm_head: the active tokens are gathered (row-major) into slots, the slots are
cut into tiles of a few fixed sizes (so new batch sizes and sequence lengths reuse the compiled tiles), and
results are scattered back. A slot that holds no token points at token 0 and gets a zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TilePlan:
    source: torch.Tensor  # [slots] flat [B*T] position each slot reads (0 for padding slots)
    valid: torch.Tensor  # [slots] bool, False for padding slots
    tiles: tuple[tuple[int, int], ...]  # (first slot, size) of every tile
    active: torch.Tensor  # [N] flat positions of the active tokens
    slot_of_active: torch.Tensor  # [N] slot of each active token
    identity: bool = False  # every position active, slot i = position i: slots are a view, not a copy

    @property
    def slots(self) -> int:
        return self.source.numel()


def bulk_and_tail(n: int, tile: int, tail: int) -> list[tuple[int, int]]:
    """Full tiles of `tile` slots, then the rest rounded up to a multiple of `tail` (waste < tail) in tiles of
    tail * 2**k slots, largest first: at most log2(tile / tail) tail tiles, each a GEMM of useful size, and a
    bounded set of shapes to compile (tile and tail * 2**k below it), whatever the batch."""
    tiles = [(i * tile, tile) for i in range(n // tile)]
    start = len(tiles) * tile
    units = -(-(n - start) // tail)  # the rest, in tails
    size = 1 << max(units.bit_length() - 1, 0)  # in tails: the largest power of two in the rest, within a tile
    while size > 1 and size * tail > tile:
        size //= 2
    while units:
        if units >= size:
            tiles.append((start, size * tail))
            start, units = start + size * tail, units - size
        else:
            size //= 2
    return tiles


def plan_tokens(mask: torch.Tensor, tile: int, tail: int) -> TilePlan:
    """Tiles over the active tokens in order, regardless of rows (token-separable objectives, stats passes)."""
    active = mask.reshape(-1).nonzero().squeeze(1)
    n = active.numel()
    tiles = bulk_and_tail(n, tile, min(tail, tile))
    slots = tiles[-1][0] + tiles[-1][1] if tiles else 0
    slot_of_active = torch.arange(n, device=mask.device)
    return _make_plan(active, slot_of_active, slots, tuple(tiles), identity=n == mask.numel() == slots)


def plan_whole_rows(mask: torch.Tensor, tile: int) -> TilePlan | None:
    """Tiles of `tile` slots that each hold whole rows (for objectives coupling the tokens of a row);
    None when a row has more active tokens than a tile."""
    lengths = mask.sum(-1).tolist()
    if max(lengths, default=0) > tile:
        return None
    active = mask.reshape(-1).nonzero().squeeze(1)
    offsets, used, tiles_count = [], 0, 1 if lengths else 0
    for length in lengths:
        if used + length > tile:
            tiles_count, used = tiles_count + 1, 0
        offsets.extend(range((tiles_count - 1) * tile + used, (tiles_count - 1) * tile + used + int(length)))
        used += int(length)
    slot_of_active = torch.tensor(offsets, dtype=torch.long, device=mask.device)
    tiles = tuple((i * tile, tile) for i in range(tiles_count if active.numel() else 0))
    slots = tiles_count * tile if tiles else 0
    identity = len(offsets) == mask.numel() == slots and offsets == list(range(slots))
    return _make_plan(active, slot_of_active, slots, tiles, identity)


def _make_plan(active, slot_of_active, slots, tiles, identity) -> TilePlan:
    source = torch.zeros(slots, dtype=torch.long, device=active.device)
    valid = torch.zeros(slots, dtype=torch.bool, device=active.device)
    source[slot_of_active] = active
    valid[slot_of_active] = True
    return TilePlan(source, valid, tiles, active, slot_of_active, identity)


def to_slots(flat: torch.Tensor, plan: TilePlan, fill=0) -> torch.Tensor:
    """A [B*T, ...] tensor laid out in slots (padding slots get `fill`)."""
    if plan.identity:
        return flat
    out = flat.index_select(0, plan.source)
    if fill is None:
        return out
    shape = (-1,) + (1,) * (out.dim() - 1)
    return torch.where(plan.valid.view(shape), out, torch.as_tensor(fill, dtype=out.dtype, device=out.device))


def from_slots(values: torch.Tensor, plan: TilePlan, numel: int) -> torch.Tensor:
    """Slot values back to a flat [B*T] tensor, 0 at padded positions (differentiable)."""
    picked = values.index_select(0, plan.slot_of_active)
    return torch.zeros(numel, dtype=values.dtype, device=values.device).index_put((plan.active,), picked)
