"""The two schedules that drive the lm_head tiles, as autograd Functions.

memory: forward = stats pass (logp, entropy, lse per token); the objective runs on [B,T] with plain autograd;
        backward = gradient pass, vocab-outer: each vocabulary slice against every token tile, so each slice
        of dW is written once from a float32 sum over token tiles, or straight from its GEMM when there is one
        token tile (no [V,H] float32 accumulator). 8NHV FLOPs.
speed:  forward = per token tile, stats and gradient on the same logits (6NHV, no recompute); the objective's
        gradient for a tile is taken right after its stats, which is exact because, with the normalizers fixed
        up front, a token's gradient depends only on its own row (tiles hold whole rows when the objective
        couples a row's tokens). dW comes from the tiles' logits gradients (`GradientBuffer`). Backward only
        scales the stored gradients.
"""

from __future__ import annotations

import functools

import torch

from . import distributed, streaming
from .distributed import LOCAL

# Graphs each tile function may keep: one per tile shape (bulk, tail, stats rows, vocabulary slices), dtype and
# head (bias, softcap) in use in a process. Dynamo's default of 8 is reached by ordinary use (training and
# evaluation shapes, two dtypes), and under fullgraph=True reaching it is an error, not a fallback.
RECOMPILE_LIMIT = 64


def compile_tile(f):
    """`f` under torch.compile(fullgraph=True, dynamic=False), allowed RECOMPILE_LIMIT graphs (raised for the
    call and restored after it, so the process-wide setting is left alone; a plain attribute swap costs 5 us
    where `config.patch` costs 180 us, and a tile loop makes dozens of calls)."""
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    config = torch._dynamo.config

    @functools.wraps(f)
    def call(*args):
        limit = config.recompile_limit
        config.recompile_limit = max(RECOMPILE_LIMIT, limit)
        try:
            return compiled(*args)
        finally:
            config.recompile_limit = limit

    return call


class Kernels:
    """The tile functions, under `torch.compile(fullgraph=True, dynamic=False)` or eager: the same code."""

    def __init__(self, compiled: bool):
        wrap = compile_tile if compiled else (lambda f: f)
        self.compiled = compiled
        self.statistics = wrap(streaming.statistics_tile)
        self.partial_statistics = wrap(streaming.partial_statistics_tile)
        self.statistics_and_product = wrap(streaming.statistics_and_product_tile)
        self.gradient_from_product = wrap(streaming.gradient_from_product_tile)
        self.gradient_vocab = wrap(streaming.gradient_vocab_tile)


def head_values(cfg, dtype, device) -> torch.Tensor:
    """[logit_scale, 1 / temperature, softcap] as a tensor: new values never recompile the tiles."""
    cap = cfg.final_logit_softcapping
    return _constant((cfg.logit_scale, 1.0 / cfg.temperature, cap or 1.0), dtype, torch.device(device))


@functools.cache
def _constant(values: tuple, dtype, device) -> torch.Tensor:
    """A small constant tensor, made once: each host-to-device copy waits for every kernel queued before it."""
    return torch.tensor(values, dtype=dtype, device=device)


def statistics_pass(k: Kernels, x, weight, bias, targets, head_values, softcap, tiles, rows: int, vocab_group=LOCAL):
    """(logp, entropy, lse) for every slot, `rows` tokens at a time against the whole vocabulary (a tile of
    more rows is split, keeping the [rows, V] float32 logits the only large temporary). With a vocabulary-
    parallel group, `weight` is this rank's slice, `targets` are relative to its first row, and the slices'
    statistics are combined across the group."""
    pieces = [(s + i, min(rows, n - i)) for s, n in tiles for i in range(0, n, rows)]
    fold = k.statistics if vocab_group is LOCAL else k.partial_statistics
    outs = [fold(x[s : s + n], weight, bias, targets[s : s + n], head_values, softcap) for s, n in pieces]
    if not outs:
        empty = x.new_zeros(0, dtype=streaming.stat_dtype(x))
        return empty, empty, empty
    outs = tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
    return outs if vocab_group is LOCAL else distributed.combine_vocab_shards(*outs, vocab_group)


def accumulator(like: torch.Tensor, shape) -> torch.Tensor:
    """A float32 (float64 for float64 inputs) buffer for sums over tiles."""
    return torch.zeros(shape, dtype=streaming.stat_dtype(like), device=like.device)


class StreamedStatistics(torch.autograd.Function):
    """Memory schedule: logp and entropy per slot from x [slots,H]; gradients recomputed vocab-outer."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, targets, head_values, kernels, softcap, tiles, vocab_tile, stats_rows, vocab_group
    ):
        logp, entropy, lse = statistics_pass(
            kernels, x, weight, bias, targets, head_values, softcap, tiles, stats_rows, vocab_group
        )
        ctx.save_for_backward(x, weight, bias, targets, head_values, lse, entropy)
        ctx.setup = (kernels, softcap, tiles, vocab_tile, vocab_group)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        x, weight, bias, targets, head_values, lse, entropy = ctx.saved_tensors
        kernels, softcap, tiles, vocab_tile, vocab_group = ctx.setup
        need_w = ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        dx = torch.empty(x.shape, dtype=streaming.stat_dtype(x), device=x.device)
        if not tiles:  # nothing active: zero gradients
            zeros = lambda t, need: torch.zeros_like(t) if need else None
            return dx.to(x.dtype), zeros(weight, need_w), zeros(bias, need_b), *(None,) * 8
        dw = torch.empty_like(weight) if need_w else None
        db = torch.empty_like(bias) if need_b else None
        starts = range(0, weight.shape[0], vocab_tile)
        offsets = torch.arange(0, weight.shape[0], vocab_tile, device=x.device)  # made on the device: no wait
        direct = len(tiles) == 1  # one token tile: a dW slice is one GEMM, written in weight's dtype directly
        for j, v0 in enumerate(starts):
            w_v = weight[v0 : v0 + vocab_tile]
            b_v = bias[v0 : v0 + vocab_tile] if bias is not None else None
            dw_v = None
            if need_w:
                dw_v = dw[v0 : v0 + vocab_tile] if direct else torch.empty(w_v.shape, dtype=dx.dtype, device=x.device)
            db_v = accumulator(x, w_v.shape[:1]) if need_b else None
            offset = offsets[j]
            for i, (s, n) in enumerate(tiles):
                d_raw, db_t = kernels.gradient_vocab(
                    x[s : s + n], w_v, b_v, offset, targets[s : s + n], lse[s : s + n], entropy[s : s + n],
                    g_logp[s : s + n], g_entropy[s : s + n], head_values, softcap,
                )  # fmt: skip
                streaming.add_matmul(dx[s : s + n], d_raw, w_v, first=j == 0)
                if direct and need_w:
                    torch.mm(d_raw.T, x[s : s + n], out=dw_v)
                elif need_w:
                    streaming.add_matmul(dw_v, d_raw.T, x[s : s + n], first=i == 0)
                if need_b:
                    db_v += db_t
            if need_w and not direct:
                dw[v0 : v0 + vocab_tile] = dw_v
            if need_b:
                db[v0 : v0 + vocab_tile] = db_v
        distributed.all_sum_(dx, vocab_group)  # each vocabulary slice contributes to every token's dX
        return dx.to(x.dtype), dw, db, *(None,) * 8


class PrecomputedGradients(torch.autograd.Function):
    """Speed schedule: a loss whose gradients w.r.t. hidden, weight and bias were computed in the forward."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, d_hidden, d_weight, d_bias):
        ctx.grads = (d_hidden, d_weight, d_bias)
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, g):
        grads = ctx.grads
        ctx.grads = None
        if not torch.equal(g, torch.ones_like(g)):  # the usual loss.backward() needs no pass over [V, H]
            grads = tuple(None if t is None else (t * g).to(t.dtype) for t in grads)
        return (None, *grads, None, None, None)


def buffers_weight_gradient(dtype: torch.dtype, tokens: int, hidden_size: int) -> bool:
    """With 16-bit GEMMs, keeping every token's logits gradient ([tokens, V], 16-bit) for one dW GEMM at the end
    beats a float32 [V, H] accumulator when it is no larger (tokens <= 2H): dW then comes out of a single GEMM
    that sums all tokens in float32 and rounds once, with no accumulator traffic and no final cast."""
    return dtype in (torch.float16, torch.bfloat16) and 2 * tokens <= 4 * hidden_size


class GradientBuffer:
    """Where the speed schedule's tiles write their logits gradients, and how they become dW.

    single GEMM (`buffers_weight_gradient`): every slot has a row; dW = one GEMM over all of them at the end.
    accumulated: rows for `group` consecutive slots (whole tiles); each full group adds one GEMM with K = group
    into a float32 [V, H] sum, cast once at the end. Deeper, fewer accumulating GEMMs than one per tile: each
    re-reads and re-writes the whole float32 sum.
    """

    def __init__(self, x, weight, tiles, group: int, need_w: bool):
        self.x, self.weight, self.need_w = x, weight, need_w
        stat_dtype = streaming.stat_dtype(x)
        self.single = need_w and buffers_weight_gradient(x.dtype, x.shape[0], weight.shape[1])
        widest = max((n for _, n in tiles), default=0)
        rows = x.shape[0] if self.single else max(group if need_w else 0, widest)
        self.rows = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
        # not zeroed: the first group's GEMM writes it with beta = 0 (a fill is a pass over [V, H])
        self.sum = None if self.single or not need_w else torch.empty(weight.shape, dtype=stat_dtype, device=x.device)
        self.start, self.used, self.added = 0, 0, False

    def rows_for(self, s: int, n: int) -> torch.Tensor:
        """The rows tile (s, n) writes its gradient to; a full group is added to the sum first."""
        if self.single:
            return self.rows[s : s + n]
        if self.used + n > self.rows.shape[0]:
            self._add_group()
        if self.used == 0:
            self.start = s
        self.used += n
        return self.rows[self.used - n : self.used]

    def _add_group(self):
        if self.sum is not None and self.used:
            group = self.rows[: self.used]
            streaming.add_matmul(self.sum, group.T, self.x[self.start : self.start + self.used], first=not self.added)
            self.added = True
        self.used = 0

    def weight_gradient(self) -> torch.Tensor | None:
        if not self.need_w:
            return None
        if self.single:
            return torch.mm(self.rows.T, self.x)
        self._add_group()
        self.rows = None  # freed before the cast, which briefly holds the sum and its 16-bit copy
        return self.sum.to(self.weight.dtype) if self.added else torch.zeros_like(self.weight)


def speed_pass(kernels, x, weight, bias, targets, head_values, softcap, tiles, gradient_of_tile, need_w, need_b, group):
    """Per tile: stats and the GEMM output, then the objective's gradient for that tile (`gradient_of_tile(s, n,
    logp, entropy)` -> (g_logp, g_entropy)), then dX, dW, db from the same product. Returns the slots' dX (x's
    dtype: each tile's dX is one GEMM over the whole vocabulary, rounded once), dW in weight's dtype and the
    float32 db; the stats reach the caller through `gradient_of_tile`."""
    dtype = streaming.stat_dtype(x)
    logp = x.new_zeros(x.shape[0], dtype=dtype)
    entropy = torch.zeros_like(logp)
    dx = torch.empty_like(x)
    gradients = GradientBuffer(x, weight, tiles, group, need_w)
    db = accumulator(x, weight.shape[:1]) if need_b else None
    for s, n in tiles:
        lp, h, lse, product = kernels.statistics_and_product(
            x[s : s + n], weight, bias, targets[s : s + n], head_values, softcap
        )
        logp[s : s + n], entropy[s : s + n] = lp, h
        g_logp, g_entropy = gradient_of_tile(s, n, logp, entropy)
        d_raw = gradients.rows_for(s, n)
        db_t = kernels.gradient_from_product(
            product, bias, targets[s : s + n], lse, h, g_logp, g_entropy, head_values, softcap, d_raw, need_b
        )
        del product
        torch.mm(d_raw, weight, out=dx[s : s + n])
        del d_raw  # a view of the gradient rows, which weight_gradient() may free
        if need_b:
            db += db_t
    return dx, gradients.weight_gradient(), db
