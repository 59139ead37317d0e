"""The statistics pass of a split fp32 head vocabulary-outer: each vocabulary slice's bf16 terms made once
(`Head.vocab_slice`) and read by every token tile, so the pass holds one slice's terms instead of the whole weight's
(three bf16 copies of it: 3 GiB at V 151936, H 3584). Each (token tile, slice) gives the slice's partial statistics
(m, s, u, target logit), merged slice after slice (`streaming.merge_partials`), then finished as a vocabulary-parallel
shard's are (`distributed.combine_vocab_shards`: across its group, or on this rank alone).
"""

from __future__ import annotations

import torch

from .. import distributed, streaming
from ..head import Head


def statistics(engine, x, targets, head: Head, tiles) -> tuple:
    """(logp, entropy, lse) of the slots of `tiles` (at least one), the whole vocabulary's."""
    merged = None
    for v0 in range(0, head.weight.shape[0], engine.tiles.vocab_tile):
        head_v = head.vocab_slice(v0, engine.tiles.vocab_tile)
        parts = [engine.kernels.partial_statistics(x[s : s + n], targets[s : s + n] - v0, head_v.rows(s, n))
                 for s, n in tiles]  # fmt: skip
        part = tuple(torch.cat(p) for p in zip(*parts, strict=True))
        merged = part if merged is None else streaming.merge_partials(merged, part)
    return distributed.combine_vocab_shards(*merged, engine.shard.group)  # no communication on one rank
