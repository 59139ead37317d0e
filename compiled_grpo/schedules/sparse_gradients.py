"""The sparse gradient pass: a backward over the rows that have a gradient only.

backward: the objective's gradients d loss / d logp and d loss / d entropy are known per token; a token whose
          two are exactly 0 (outside the entropy mask with beta = 0, advantage 0, dropped by the off-policy mask,
          in the clipped branch, vespo weight 0) contributes exactly nothing to dX, dW and db. Those rows are
          skipped: the others are compacted (the one wait on the GPU of the backward) into static tile shapes
          and their logits recomputed. 2NHV + 6nHV FLOPs for n rows with a gradient, against the memory
          schedule's 8NHV. A skipped row's dX is exactly 0.
          Where every token has a gradient and the pass is vocabulary-outer, it runs over the forward's slots
          as they are (the memory schedule's backward, no compaction).
          Two ways, chosen by the number n of selected rows (`token_outer`):
          - token-outer: whole-vocabulary tiles of `sparse_tile` rows, dX from one GEMM per tile, dW from one GEMM
            over every row's buffered 16-bit gradient. With 16-bit inputs while those n rows of gradients take no
            more than the statistics pass's float32 logits tile (n <= 2 stats_rows) and n <= 2H, so the peak
            stays under the memory schedule's; and always with float32/64 inputs (dW is summed in their dtype).
          - vocabulary-outer over the selected rows (the memory schedule's gradient pass): no buffered gradients
            and no float32 [V, H] sum. On an H200 it runs as fast as token-outer from a few thousand rows on
            (S1 at q = 0.5: 44.5 against 43.9 ms, 1.50 against 2.38 GiB) and 19% slower at 1639 rows.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import distributed, products, tiling
from ..head import Head
from ..streaming import RowGradients
from ..tiling import TilePlan
from . import passes
from .passes import Engine, TokenOuterGradients, Wanted, head_key
from .recompute import Recompute, StatisticsThenRecompute


def workspace_bytes(engine: Engine, plan: TilePlan, head: Head) -> int:
    """The statistics pass's [stats_rows, V] product, or the token-outer gradient pass's: a [sparse_tile, V]
    product and at most 2 stats_rows rows of 16-bit gradients (the vocabulary-outer pass takes over beyond); each
    product float32, or 16-bit where the head rounds it. float32/64 inputs: the float32 [V, H] dW sum instead. A
    split head's whole terms on top."""
    t, vocab, product = engine.tiles, head.weight.shape[0], products.product_bytes(head)
    kept = 4 * head.weight.numel() if head.weight.dtype in WIDE else 2 * min(plan.slots, 2 * t.stats_rows) * vocab
    biggest = max(product * t.stats_rows * vocab, product * t.sparse_tile * vocab + kept)
    return biggest + products.whole_terms_bytes(head)


def workspace_bound(tiles, weight) -> int:
    """The largest `workspace_bytes` of any plan with these tiles, for an lm_head weight [V, H]."""
    vocab = weight.shape[0]
    kept = 4 * weight.numel() if weight.dtype in WIDE else 2 * 2 * tiles.stats_rows * vocab
    return max(4 * tiles.stats_rows * vocab, 4 * tiles.sparse_tile * vocab + kept)


WIDE = (torch.float32, torch.float64)


def token_outer(engine: Engine, x, rows: int) -> bool:
    """Whether `rows` selected rows take the token-outer pass (see the module's docstring)."""
    if x.dtype in WIDE:
        return True
    fits = rows <= 2 * engine.tiles.stats_rows
    return fits and passes.buffers_weight_gradient(x.dtype, rows, x.shape[1])


class StatisticsThenSparseGradients(StatisticsThenRecompute):
    """The statistics pass's forward (`recompute`); a backward over the rows with a non-zero upstream gradient
    only."""

    @staticmethod
    def gradients(setup: Recompute, x, head: Head, rows: RowGradients, wanted: Wanted):
        """dX [slots, H], dW and db from the slots whose upstream gradients are not both 0."""
        selected, entropy_has_gradient = rows_with_gradient(rows.g_logp, rows.g_entropy)
        if not entropy_has_gradient:  # all zero: no entropy term in the tiles
            rows = rows._replace(g_entropy=None)
        if selected.numel() == setup.active_rows and not token_outer(setup.engine, x, selected.numel()):
            # every token has a gradient: the memory schedule's pass over the forward's slots (no compaction)
            return passes.captured_vocab_outer_gradients(setup.engine, x, rows, head, setup.tiles, wanted)
        rows_plan, dx, dw, db = gradients_of_rows(setup.engine, x, head, selected, wanted, rows)
        return tiling.from_slots(dx, rows_plan, x.shape[0]), dw, db


def rows_with_gradient(g_logp, g_entropy):
    """The slots whose upstream gradients are not both 0, and whether any entropy gradient is non-zero (None:
    the entropy has none), after one wait on the device (both counts read back at once)."""
    nonzero = g_logp != 0
    entropy_nonzero = None if g_entropy is None else g_entropy != 0
    if entropy_nonzero is not None:
        nonzero = nonzero | entropy_nonzero
    counts = [nonzero.count_nonzero()]
    if entropy_nonzero is not None:
        counts.append(entropy_nonzero.count_nonzero())
    counts = torch.stack(counts).tolist()
    selected = torch.nonzero_static(nonzero, size=counts[0]).squeeze(1)
    return selected, len(counts) > 1 and counts[1] > 0


def gradients_of_rows(engine: Engine, x, head: Head, selected, wanted: Wanted, per_slot: RowGradients):
    """dX (of the selected rows, in their plan's slots), dW and db from the selected slots alone; the pass after
    the plan is captured where the engine captures calls."""
    t = engine.tiles
    token_tiles = token_outer(engine, x, selected.numel())
    tile = t.sparse_tile if token_tiles else t.token_tile
    rows_plan = tiling.plan_tokens(selected, x.shape[0], tile, t.tail_tile, engine.slot_bucket)

    def work(x, values, row_inv_temp, source, valid, *row_tensors):
        plan = dataclasses.replace(rows_plan, source=source, valid=valid, active=None, slot_of_active=None)
        h = passes.work_head(engine, head, values, row_inv_temp)
        return rows_gradients(engine, x, h, plan, wanted, RowGradients(*row_tensors), token_tiles=token_tiles)

    key = ("gradients of rows", rows_plan.tiles, rows_plan.identity, token_tiles, head_key(head), wanted)
    tensors = (x, head.values, head.row_inv_temp, rows_plan.source, rows_plan.valid, *per_slot)
    dx, dw, db = passes.captured_pass(engine, key, work, tensors)
    return rows_plan, dx, dw, db


def rows_gradients(engine: Engine, x, head: Head, rows_plan: TilePlan, wanted: Wanted, per_slot: RowGradients, *,
                   token_tiles: bool):  # fmt: skip
    """dX, dW, db of the rows of `rows_plan` (slots of x), token-outer or vocabulary-outer."""
    # Padding slots read slot 0's row and statistics (finite probabilities) with zero upstream gradients, so
    # their logits gradient is exactly 0.
    same = lambda v: None if v is None else tiling.to_slots(v, rows_plan, fill=None)
    zero = lambda v: None if v is None else tiling.to_slots(v, rows_plan, fill=0.0)
    x_r = same(x)
    rows = RowGradients(*map(same, per_slot[:3]), zero(per_slot.g_logp), zero(per_slot.g_entropy))
    head = head._replace(row_inv_temp=same(head.row_inv_temp))
    if not token_tiles:
        return passes.vocab_outer_gradients(engine, x_r, rows, head, rows_plan.tiles, wanted)
    t = engine.tiles
    buffered = x.dtype not in WIDE
    grads = TokenOuterGradients(x_r, head, rows_plan.tiles, t.sparse_tile, buffered, wanted)
    for s, n in rows_plan.tiles:
        product = products.gemm_product(x_r[s : s + n], head)
        grads.add(engine.kernels, s, product, RowGradients(*(None if v is None else v[s : s + n] for v in rows)))
        del product  # freed before the next tile's is made
    dx, dw, db = grads.result(passes.weight_gradient_out(engine, head, wanted))
    distributed.all_sum_(dx, engine.shard.group)
    return passes.hidden_gradient(engine, dx, x_r), dw, None if db is None else db.to(head.bias.dtype)
