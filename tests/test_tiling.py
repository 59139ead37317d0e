"""Tile plans: every active token in exactly one slot, little padding, and a bounded set of tile shapes."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_grpo import tiling


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 5000), tile=st.integers(1, 1024), tail=st.integers(1, 512))
def test_bulk_and_tail_covers_with_less_than_a_tail_of_padding(n, tile, tail):
    tail = min(tail, tile)
    tiles = tiling.bulk_and_tail(n, tile, tail)
    starts = [s for s, _ in tiles]
    assert starts == sorted(starts) and all(a + m == b for (a, m), (b, _) in zip(tiles, tiles[1:], strict=False))
    slots = sum(m for _, m in tiles)
    assert n <= slots < n + tail
    assert all(m <= tile for _, m in tiles)
    rest = [m for _, m in tiles[n // tile :]]
    assert len(rest) <= math.floor(math.log2(tile / tail)) + 2  # a few tail tiles, never one per `tail` slots
    assert all(m == tile or (m % tail == 0 and (m // tail).bit_count() == 1) for m in rest)  # tail * 2**k


def test_tail_shapes_are_a_fixed_set_across_batches():
    """Whatever the number of active tokens, tail tiles come from {tail * 2**k < tile}: compiled shapes stay few."""
    shapes = {m for n in range(0, 3000, 7) for _, m in tiling.bulk_and_tail(n, 1024, 128)}
    assert shapes <= {1024, 512, 256, 128}


def test_plan_of_a_full_mask_is_the_identity():
    mask = torch.ones(4, 16, dtype=torch.long)
    plan = tiling.plan_mask(mask, 32, 8)
    assert plan.identity and plan.slots == 64
    mask[1, 3] = 0
    assert not tiling.plan_mask(mask, 32, 8).identity
