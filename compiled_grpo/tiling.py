"""Token compaction and tile plans: which active token goes to which slot of which static-shape tile.

Padded positions never reach the lm_head: the active tokens are gathered (row-major) into slots, the slots are
cut into tiles of a few fixed sizes (so new batch sizes and sequence lengths reuse the compiled tiles), and
results are scattered back. A slot that holds no token points at token 0 and gets a zero gradient.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tiles:
    """Tile sizes, in tokens (slots) or vocabulary entries. Active tokens go in tiles of a schedule's bulk size,
    the rest in tiles of tail_tile * 2**k.
    memory: the statistics pass holds [stats_rows, V] float32 logits; the gradient pass [token_tile, vocab_tile]
      logits and writes each vocab_tile slice of dW once per token tile (one token tile: straight from a GEMM).
    speed: a [speed_tile, V] float32 GEMM output per tile, and either every tile's 16-bit logits gradient for one
      dW GEMM or a float32 [V, H] dW sum fed by one GEMM per group of speed_group tokens (schedules/speed.py).
    sparse: the statistics pass as memory's; the gradient pass over the rows that have a gradient in tiles of
      sparse_tile rows ([sparse_tile, V] float32 GEMM output each)."""

    token_tile: int
    tail_tile: int
    vocab_tile: int
    stats_rows: int
    speed_tile: int
    speed_group: int
    sparse_tile: int
    # The GPU speed tile where dW is summed over groups: half the logits tile buys a 4096-token group in the same
    # memory (4 * 1024 + 2 * 4096 bytes per vocabulary entry, as 6 * 2048), halving the passes over the float32
    # dW sum. Not an option of its own: an explicit speed_tile sets it too.
    accumulating_speed_tile: int = 0

    @classmethod
    def for_device(cls, device: torch.device, captured: bool = False, **overrides: int) -> Tiles:
        """Large GEMMs on a GPU, cache-sized ones on a CPU; `overrides` (the constructor's tile options) win.
        `captured` (calls as CUDA graph replays, `capture.Captures`): a 256-row statistics pass and 4096-entry
        vocabulary slices in the gradient pass. The graphs' pool keeps their largest workspace reserved between
        calls, and with launches nearly free the smaller pieces cost the GPU little: at 0.5B (V 151936, H 896) the
        pool is 0.56-0.59 GiB against 0.83-1.21 GiB with the uncaptured tiles, inside a trainer's budget."""
        if device.type == "cuda":
            tiles = cls(token_tile=8192, tail_tile=128, vocab_tile=4096 if captured else 8192,
                        stats_rows=256 if captured else 1024, speed_tile=2048, speed_group=4096,
                        sparse_tile=512)  # fmt: skip
        else:  # one dW GEMM per tile measured faster than groups of 1024 or 4096 tokens (they leave the cache)
            tiles = cls(token_tile=256, tail_tile=32, vocab_tile=4096, stats_rows=256, speed_tile=256,
                        speed_group=256, sparse_tile=256)  # fmt: skip
        accumulating = overrides.get("speed_tile", 1024 if device.type == "cuda" else tiles.speed_tile)
        return dataclasses.replace(tiles, accumulating_speed_tile=accumulating, **overrides)


TILE_NAMES = tuple(f.name for f in dataclasses.fields(Tiles))[:-1]  # the constructor's tile options

# The workspace the loss's "auto" rule (`logits_budget_bytes`) and the primitive's CUDA graph pool may take.
DEFAULT_WORKSPACE_BYTES = 6 << 30


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


def active_positions(mask: torch.Tensor) -> torch.Tensor:
    """Flat positions of the non-zero entries (the one wait on the GPU of planning)."""
    return mask.reshape(-1).nonzero().squeeze(1)


def positions_and_lengths(masks, rows=None):
    """The flat positions of each mask's non-zero entries, and the per-row counts of `rows` ([B, T]) when
    given, after one wait on the GPU: every count is read back at once, then each mask's positions are found
    at a size now known (`nonzero_static`), which needs no further wait."""
    flat = [m.reshape(-1) for m in masks]
    counts = torch.stack([f.count_nonzero() for f in flat])
    if rows is not None:
        counts = torch.cat([counts, rows.count_nonzero(-1)])
    counts = counts.tolist()
    found = [torch.nonzero_static(f, size=c).squeeze(1) for f, c in zip(flat, counts, strict=False)]
    return found, (counts[len(flat) :] if rows is not None else None)


def plan_tokens(active: torch.Tensor, numel: int, tile: int, tail: int, bucket: int = 0) -> TilePlan:
    """Tiles over the `active` positions (of `numel`) in order, regardless of rows (token-separable objectives,
    stats passes, the rows of a gradient pass). `bucket`: the slots rounded up to a multiple of it (padding
    slots), so that batches of nearby sizes share one tile structure (one captured graph)."""
    n = active.numel()
    padded = -(-n // bucket) * bucket if bucket else n
    tiles = bulk_and_tail(padded, tile, min(tail, tile))
    slots = tiles[-1][0] + tiles[-1][1] if tiles else 0
    slot_of_active = torch.arange(n, device=active.device)
    return _make_plan(active, slot_of_active, slots, tuple(tiles), identity=n == numel == slots)


def plan_whole_rows(active: torch.Tensor, lengths: list[int], numel: int, tile: int) -> TilePlan | None:
    """Tiles of `tile` slots that each hold whole rows (for objectives coupling the tokens of a row), from the
    `active` flat positions and the rows' `lengths` (active tokens per row, in order); None when a row has more
    active tokens than a tile."""
    if max(lengths, default=0) > tile:
        return None
    offsets, used, tiles_count = [], 0, 1 if lengths else 0
    for length in lengths:
        if used + length > tile:
            tiles_count, used = tiles_count + 1, 0
        offsets.extend(range((tiles_count - 1) * tile + used, (tiles_count - 1) * tile + used + int(length)))
        used += int(length)
    slot_of_active = torch.tensor(offsets, dtype=torch.long, device=active.device)
    tiles = tuple((i * tile, tile) for i in range(tiles_count if active.numel() else 0))
    slots = tiles_count * tile if tiles else 0
    identity = len(offsets) == numel == slots and offsets == list(range(slots))
    return _make_plan(active, slot_of_active, slots, tiles, identity)


def _make_plan(active, slot_of_active, slots, tiles, identity) -> TilePlan:
    source = torch.zeros(slots, dtype=torch.long, device=active.device)
    valid = torch.zeros(slots, dtype=torch.bool, device=active.device)
    source[slot_of_active] = active
    valid.index_fill_(0, slot_of_active, True)  # a scalar fill: no host-to-device copy (which would wait)
    return TilePlan(source, valid, tiles, active, slot_of_active, identity)


def to_slots(flat: torch.Tensor, plan: TilePlan, fill=0) -> torch.Tensor:
    """A [B*T, ...] tensor laid out in slots (padding slots get `fill`)."""
    if plan.identity:
        return flat
    out = flat.index_select(0, plan.source)
    if fill is None:
        return out
    shape = (-1,) + (1,) * (out.dim() - 1)
    return torch.where(plan.valid.view(shape), out, fill)  # a scalar: no host-to-device copy (captured calls)


def from_slots(values: torch.Tensor, plan: TilePlan, numel: int) -> torch.Tensor:
    """Slot values back to a flat [B*T, ...] tensor, 0 at padded positions (differentiable)."""
    picked = values.index_select(0, plan.slot_of_active)
    zeros = torch.zeros(numel, *values.shape[1:], dtype=values.dtype, device=values.device)
    return zeros.index_put((plan.active,), picked)


def plan_mask(mask: torch.Tensor, tile: int, tail: int, bucket: int = 0) -> TilePlan:
    """`plan_tokens` over the non-zero entries of a mask."""
    return plan_tokens(active_positions(mask), mask.numel(), tile, tail, bucket)
