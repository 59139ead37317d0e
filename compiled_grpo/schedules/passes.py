"""Passes over lm_head tiles that the schedules share: slots, the statistics pass, and the two ways of
turning logits gradients into dX, dW and db (token-outer over whole-vocabulary tiles, vocabulary-outer over
slices of the vocabulary)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import distributed, products, streaming, tiling
from ..capture import Captures
from ..head import Head, VocabShard
from ..kernels import Kernels
from ..streaming import RowGradients
from ..tiling import TilePlan, Tiles
from . import sliced_statistics


def head_key(head) -> tuple:
    """What a graph bakes in of the lm_head, read in place: the weight's and bias's addresses, shapes and dtypes,
    the softcap."""
    weight, bias = head.weight, head.bias
    return (weight.data_ptr(), tuple(weight.shape), weight.dtype, weight.device, head.softcap, head.rounded,
            None if bias is None else (bias.data_ptr(), bias.dtype), head.terms is not None, head.split)  # fmt: skip


@dataclass(frozen=True)
class Engine:
    """How the tiles of a call run: the tile functions (compiled or eager), their sizes, the vocabulary shard."""

    kernels: Kernels
    tiles: Tiles
    shard: VocabShard
    captures: Captures | None = None  # calls captured as CUDA graph replays (`capture.Captures`), or not

    @property
    def slot_bucket(self) -> int:
        """Captured calls round their slots up to a multiple of this (a bounded number of graphs serves a run)."""
        return CAPTURE_SLOT_BUCKET if self.captures is not None else 0


# A quarter of the GPU's speed tile: at most 511 padding slots (under 7% of an 8192-token batch), and a batch of
# up to 16k tokens needs at most 32 slot counts.
CAPTURE_SLOT_BUCKET = 512


class Wanted(NamedTuple):
    """Which lm_head gradients are asked for."""

    weight: bool
    bias: bool


@dataclass(frozen=True)
class Slots:
    """Hidden rows and target ids laid out in a plan's slots (targets relative to this rank's vocabulary)."""

    plan: TilePlan
    x: torch.Tensor  # [slots, H]
    targets: torch.Tensor  # [slots]


def compiles_objective(engine: Engine, hidden) -> bool:
    """The objective (loss, its gradients, the metrics) under torch.compile: with compiled tiles on a GPU, where
    its eager launches leave the GPU idle (on a CPU there is nothing to hide, and each loss configuration would
    cost a compile)."""
    return engine.kernels.compiled and (hidden.is_cuda or COMPILE_OBJECTIVE_ON_CPU)


COMPILE_OBJECTIVE_ON_CPU = False  # tests set it to check the compiled objective where no GPU is


def differentiable(hidden, head: Head) -> bool:
    """Whether the loss is to carry gradients: grad mode on and some lm_head input requiring them."""
    tensors = (hidden, head.weight, head.bias)
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def gather_slots(hidden, ids, plan: TilePlan, vocab_start: int = 0, rows=None) -> Slots:
    """`rows`: for packed hidden states [rows, H], the row of each [B * T] position (`LossInputs.hidden_rows`)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    x = tiling.to_slots(flat, plan, fill=None) if rows is None else flat.index_select(0, rows[plan.source])
    targets = tiling.to_slots(ids.reshape(-1).long(), plan, fill=0) - vocab_start
    return Slots(plan, x, targets)


def statistics_pass(engine: Engine, x, targets, head: Head, tiles, extras: bool = False):
    """(logp, entropy, lse) for the slots of `tiles`, `stats_rows` tokens at a time against the whole vocabulary (a tile
    of more rows is split, keeping the [rows, V] float32 logits the only large temporary). With a vocabulary-
    parallel shard, `head` is this rank's slice and the slices' statistics are combined across its group.
    `extras` (whole vocabulary only): also (log_sum_sq_probs, mean_logits, is_top1), from the same read."""
    if extras and engine.shard.parallel:
        raise ValueError("the extra statistics need the whole vocabulary on one rank (no vocabulary-parallel head)")
    if head.sliced_terms and tiles and not extras:  # a split head's terms made per vocabulary slice
        return sliced_statistics.statistics(engine, x, targets, head, tiles)
    head = head.with_whole_terms() if extras else head  # no tile: nothing is multiplied
    fold = engine.kernels.statistics_with_extras if extras else engine.kernels.statistics
    fold = engine.kernels.partial_statistics if engine.shard.parallel else fold
    outs = [fold(x[s : s + n], targets[s : s + n], head.rows(s, n)) for s, n in statistics_pieces(engine, tiles)]
    if not outs:
        empty = x.new_zeros(0, dtype=streaming.stat_dtype(x))
        return (empty,) * 5 + (x.new_zeros(0, dtype=torch.bool),) if extras else (empty, empty, empty)
    outs = tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
    return distributed.combine_vocab_shards(*outs, engine.shard.group) if engine.shard.parallel else outs


def captured_pass(engine: Engine, key, work, tensors: tuple):
    """`work(*tensors)` as a CUDA graph replay where the engine captures calls (`capture.Captures`: CUDA tensors,
    the whole vocabulary on this rank), else as it is. `tensors`: everything the work reads besides the lm_head
    weight and bias (read in place: `head_key` puts their addresses in the key), None where absent."""
    if engine.captures is None or engine.shard.parallel:  # the shards' statistics are combined inside the pass
        return work(*tensors)
    return engine.captures.run_with_absent((key, engine.tiles, engine.kernels.compiled), work, tensors)  # no grad


def work_head(engine: Engine, head: Head, values, row_inv_temp) -> Head:
    """The head a captured pass's work runs on, with the call's constants; while a graph is being captured, its
    weight's terms made inside the graph from the weight read in place, so a replay sees the weight as it is then
    (uncaptured, the call's own terms are current)."""
    head = head._replace(values=values, row_inv_temp=row_inv_temp)
    return head.with_fresh_terms() if engine.captures is not None and engine.captures.capturing else head


def captured_statistics_pass(engine: Engine, x, targets, head: Head, tiles, extras: bool = False):
    """`statistics_pass`, captured where the engine captures calls."""

    def work(x, targets, values, row_inv_temp):
        h = work_head(engine, head, values, row_inv_temp)
        return statistics_pass(engine, x, targets, h, tiles, extras)

    key = ("statistics", tuple(tiles), head_key(head), extras)
    return captured_pass(engine, key, work, (x, targets, head.values, head.row_inv_temp))


def captured_vocab_outer_gradients(engine: Engine, x, rows: RowGradients, head: Head, tiles, wanted: Wanted):
    """`vocab_outer_gradients`, captured where the engine captures calls."""

    def work(x, values, row_inv_temp, *row_tensors):
        h = work_head(engine, head, values, row_inv_temp)
        return vocab_outer_gradients(engine, x, RowGradients(*row_tensors), h, tiles, wanted)

    key = ("vocabulary-outer gradients", tuple(tiles), head_key(head), wanted)
    return captured_pass(engine, key, work, (x, head.values, head.row_inv_temp, *rows))


def weight_gradient_out(engine: Engine, head: Head, wanted: Wanted) -> torch.Tensor | None:
    """Where dW is asked for while a pass is being captured, the buffer it is written into, shared by every graph
    (`Captures.shared_output`); else None (the pass makes its own)."""
    if engine.captures is None or not wanted.weight:
        return None
    return engine.captures.shared_output(head.weight, "weight gradient")


def hidden_gradient(engine: Engine, dx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A pass's dX (`dx`, summed in float32 or already in x's dtype) in x's dtype: while a pass is being captured,
    written into the buffer every graph's dX shares (`Captures.shared_output`), else `dx.to(x.dtype)`."""
    out = None if engine.captures is None else engine.captures.shared_output(dx.to(x.dtype, copy=False), "dX")
    return dx.to(x.dtype) if out is None else out.copy_(dx)


def statistics_pieces(engine: Engine, tiles) -> list[tuple[int, int]]:
    """(first slot, size) of the statistics pass's pieces: each tile cut into `stats_rows` slots at most."""
    rows = engine.tiles.stats_rows
    return [(s + i, min(rows, n - i)) for s, n in tiles for i in range(0, n, rows)]


def accumulator(like: torch.Tensor, shape) -> torch.Tensor:
    """A float32 (float64 for float64 inputs) buffer for sums over tiles."""
    return torch.zeros(shape, dtype=streaming.stat_dtype(like), device=like.device)


def vocab_outer_gradients(engine: Engine, x, rows: RowGradients, head: Head, tiles, wanted: Wanted):
    """dX, dW, db of the slots' rows, vocabulary-outer: each vocabulary slice against every token tile, so each
    slice of dW is written once, from a float32 sum over token tiles, or straight from its GEMM when there is one
    token tile (no float32 [V, H] accumulator). dX ([slots, H], small) is summed over the slices in float32."""
    weight, bias = head.weight, head.bias
    dx = torch.empty(x.shape, dtype=streaming.stat_dtype(x), device=x.device)
    dw = weight_gradient_out(engine, head, wanted)
    if dw is None and wanted.weight:
        dw = torch.empty_like(weight)
    if not tiles:  # nothing active: zero gradients
        zero_bias = torch.zeros_like(bias) if wanted.bias else None
        return hidden_gradient(engine, dx.zero_(), x), None if dw is None else dw.zero_(), zero_bias
    vocab_tile = engine.tiles.vocab_tile
    db = torch.empty_like(bias) if wanted.bias else None
    # made on the device (no wait), in the dtype of the row targets they offset
    offsets = torch.arange(0, weight.shape[0], vocab_tile, device=x.device, dtype=rows.targets.dtype)
    direct = len(tiles) == 1  # one token tile: a dW slice is one GEMM, written in weight's dtype directly
    for j, v0 in enumerate(range(0, weight.shape[0], vocab_tile)):
        head_v = head.vocab_slice(v0, vocab_tile)
        dw_v = None
        if wanted.weight:
            dw_v = dw[v0 : v0 + vocab_tile] if direct else accumulator(x, head_v.weight.shape)
        db_v = accumulator(x, head_v.weight.shape[:1]) if wanted.bias else None
        for i, (s, n) in enumerate(tiles):
            rows_t = RowGradients(*(None if t is None else t[s : s + n] for t in rows))
            d_raw, db_t = engine.kernels.gradient_vocab(x[s : s + n], rows_t, head_v.rows(s, n), offsets[j])
            products.add_hidden_gradient(dx[s : s + n], d_raw, head_v, first=j == 0)
            if direct and wanted.weight:
                products.weight_gradient_into(dw_v, d_raw.T, x[s : s + n], head_v)
            elif wanted.weight:
                products.add_weight_gradient(dw_v, d_raw.T, x[s : s + n], head_v, first=i == 0)
            if wanted.bias:
                db_v += db_t
        if wanted.weight and not direct:
            dw[v0 : v0 + vocab_tile] = dw_v
        if wanted.bias:
            db[v0 : v0 + vocab_tile] = db_v
    distributed.all_sum_(dx, engine.shard.group)  # each vocabulary slice contributes to every token's dX
    return hidden_gradient(engine, dx, x), dw, db


def buffers_weight_gradient(dtype: torch.dtype, rows: int, hidden_size: int) -> bool:
    """With 16-bit GEMMs, keeping every row's logits gradient ([rows, V], 16-bit) for one dW GEMM at the end
    beats a float32 [V, H] accumulator when it is no larger (rows <= 2H): dW then comes out of a single GEMM
    that sums all rows in float32 and rounds once, with no accumulator traffic and no final cast."""
    return dtype in (torch.float16, torch.bfloat16) and 2 * rows <= 4 * hidden_size


class TokenOuterGradients:
    """dX, dW and db from whole-vocabulary token tiles, each tile's logits gradient formed from its GEMM output
    x @ W.T (`add`). dX of a tile is one GEMM over the whole vocabulary, rounded once to x's dtype. dW:

    buffered: every slot's 16-bit gradient is kept; dW = one GEMM over all of them at the end.
    accumulated: rows for `group` consecutive slots (whole tiles); each full group adds one GEMM with K = group
    into a float32 [V, H] sum, cast once at the end. Deeper, fewer accumulating GEMMs than one per tile: each
    re-reads and re-writes the whole float32 sum.
    """

    def __init__(self, x, head: Head, tiles, group: int, buffered: bool, wanted: Wanted):
        self.x, self.head, self.wanted = x, head, wanted
        self.buffered = buffered and wanted.weight
        widest = max((n for _, n in tiles), default=0)
        rows = x.shape[0] if self.buffered else max(group if wanted.weight else 0, widest)
        self.rows = torch.empty(rows, head.weight.shape[0], dtype=x.dtype, device=x.device)
        # not zeroed: the first group's GEMM writes it with beta = 0 (a fill is a pass over [V, H])
        accumulates = wanted.weight and not self.buffered
        self.sum = (
            torch.empty(head.weight.shape, dtype=streaming.stat_dtype(x), device=x.device) if accumulates else None
        )
        self.dx = torch.empty_like(x)
        self.db = accumulator(x, head.weight.shape[:1]) if wanted.bias else None
        self.start, self.used, self.added = 0, 0, False

    def add(self, kernels: Kernels, s: int, product, rows: RowGradients) -> None:
        """Tile (s, n): its logits gradient from `product` = x[s:s+n] @ W.T, then its dX and its share of dW, db."""
        n = product.shape[0]
        d_raw = self._rows_for(s, n)
        db_t = kernels.gradient_from_product(product, rows, self.head.rows(s, n), d_raw, self.wanted.bias)
        products.hidden_gradient_into(self.dx[s : s + n], d_raw, self.head)
        if self.wanted.bias:
            self.db += db_t

    def result(self, dw_out=None):
        """(dX in x's dtype, dW in weight's dtype or None, db in float32 or None); dW written into `dw_out` where
        given (`weight_gradient_out`)."""
        return self.dx, self._weight_gradient(dw_out), self.db

    def _rows_for(self, s: int, n: int) -> torch.Tensor:
        if self.buffered:
            return self.rows[s : s + n]
        if self.used + n > self.rows.shape[0]:
            self._add_group()
        if self.used == 0:
            self.start = s
        self.used += n
        return self.rows[self.used - n : self.used]

    def _add_group(self):
        if self.sum is not None and self.used:
            group, x = self.rows[: self.used], self.x[self.start : self.start + self.used]
            products.add_weight_gradient(self.sum, group.T, x, self.head, first=not self.added)
            self.added = True
        self.used = 0

    def _weight_gradient(self, out) -> torch.Tensor | None:
        if not self.wanted.weight:
            return None
        if self.buffered:
            return torch.mm(self.rows.T, self.x, out=out)
        self._add_group()
        self.rows = None  # freed before the cast, which briefly holds the sum and its 16-bit copy
        if out is None:
            return self.sum.to(self.head.weight.dtype) if self.added else torch.zeros_like(self.head.weight)
        return out.copy_(self.sum) if self.added else out.zero_()
