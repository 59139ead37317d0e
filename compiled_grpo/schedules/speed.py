"""The speed schedule: statistics, objective gradient and lm_head gradients on the same logits, tile by tile.

Per token tile: the GEMM output x @ W.T and the statistics (logp, entropy, lse); the objective's gradient for
that tile's tokens; their logits gradient from the same GEMM output; dX, and the tile's share of dW and db
(`passes.TokenOuterGradients`). 6NHV FLOPs, no recompute, every gradient ready when the forward returns; the
backward only scales them. Exact because, with the normalizers fixed up front, a token's gradient depends
only on its own row: tiles hold whole rows when the objective couples a row's tokens (sequence-level
importance sampling, the off-policy mask, vespo), and the entropy threshold (which needs every entropy
first) is not available here.

Tokens whose gradient is known to be 0 from the inputs alone (advantage 0 with beta = 0 and no entropy
bonus, `Objective.zero_gradient_tokens`) get their statistics only (2NHV instead of 6NHV for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import distributed, products, streaming, tiling
from ..batch_objective import Objective
from ..head import Head
from ..streaming import RowGradients
from ..tiling import TilePlan
from . import captured_call, passes
from .passes import Engine, TokenOuterGradients, Wanted

# Up to this hidden size the speed schedule keeps its full tile even where dW is summed over groups: the [V, H] sum is
# small there, and fewer tiles mean fewer launches of the objective (H200, 8192 tokens, V=151936: H896 16.7 -> 15.9
# ms, H1536 23.4 -> 21.7 ms with 2048-token tiles instead of 1024, at 2.84 and 3.21 GiB instead of 2.26 and 2.63).
SMALL_HIDDEN = 2048

NAME = "speed"


@dataclass(frozen=True)
class SpeedPlan:
    gradient: TilePlan  # tokens that get a gradient (whole rows in a tile when the objective couples them)
    statistics_only: TilePlan | None  # tokens whose gradient is known to be 0
    buffered: bool  # dW from one GEMM over every gradient token's 16-bit logits gradient (`buffers_weight_gradient`)
    group: int  # tokens per dW GEMM into the float32 [V, H] sum, when not buffered

    @property
    def tile(self) -> int:
        return max((n for _, n in self.gradient.tiles), default=0)


def plan(engine: Engine, objective: Objective, head: Head, lean: bool = False) -> SpeedPlan | None:
    """The tile plan, or None when a row that must stay whole has more active tokens than a tile. One wait on
    the GPU (every count the plan needs is read back at once). `lean`: the smaller workspace of
    `accumulating_speed_tile` tokens per tile and one dW GEMM per tile (for a tight memory budget)."""
    mask = objective.inputs.completion_mask
    zero = objective.zero_gradient_tokens()
    gradient_mask = mask if zero is None else mask.bool() & ~zero
    whole_rows = objective.cfg.couples_sequence
    masks = (gradient_mask,) if zero is None else (gradient_mask, zero)
    (active, *zero_positions), lengths = tiling.positions_and_lengths(masks, gradient_mask if whole_rows else None)
    t = engine.tiles
    buffered = passes.buffers_weight_gradient(head.weight.dtype, active.numel(), head.weight.shape[1])
    tile, group = tile_and_group(engine, head, head.weight.requires_grad and not buffered, lean)
    if whole_rows:
        gradient = tiling.plan_whole_rows(active, lengths, mask.numel(), tile)
        if gradient is None:
            return None
    else:
        gradient = tiling.plan_tokens(active, mask.numel(), tile, t.tail_tile, engine.slot_bucket)
    statistics_only = None
    if zero_positions:
        statistics_only = tiling.plan_tokens(zero_positions[0], mask.numel(), t.stats_rows, t.tail_tile,
                                             engine.slot_bucket)  # fmt: skip
    return SpeedPlan(gradient, statistics_only, buffered, group)


def tile_and_group(engine: Engine, head: Head, accumulates: bool, lean: bool) -> tuple[int, int]:
    """Tokens per tile and per dW GEMM into the float32 sum."""
    t = engine.tiles
    halved = lean or (accumulates and head.weight.shape[1] > SMALL_HIDDEN)
    tile = t.accumulating_speed_tile if halved else t.speed_tile
    # split products keep float32 logits gradients (twice a 16-bit head's bytes): one group per tile holds the least
    return tile, tile if lean or head.split else t.speed_group


def workspace_bound(engine: Engine, head: Head, lean: bool = False) -> int:
    """The workspace of the largest plan `plan` can make, known before its wait on the GPU: full tiles, and dW
    summed in float32 (keeping every token's 16-bit gradient instead is chosen only where it is no larger)."""
    # a float32 head keeps float32 gradients; a split head's terms are held whole by this schedule
    vocab, kept, terms = head.weight.shape[0], head.weight.element_size(), products.whole_terms_bytes(head)
    if not head.weight.requires_grad:
        tile, _ = tile_and_group(engine, head, False, lean)
        return (4 + kept) * tile * vocab + terms
    tile, group = tile_and_group(engine, head, True, lean)
    return 4 * tile * vocab + kept * max(tile, group) * vocab + 4 * head.weight.numel() + terms


def workspace_bytes(engine: Engine, plan: SpeedPlan, head: Head) -> int:
    """A tile's GEMM output (float32, or 16-bit where the head rounds it), plus the logits gradients kept for dW
    (in the weight's dtype): every token's (buffered), a group's and the float32 dW sum (accumulated), or one tile's
    (no weight gradient); plus a split head's whole terms."""
    vocab, size = head.weight.shape[0], head.weight.element_size()
    if not head.weight.requires_grad:
        kept = size * plan.tile * vocab
    elif plan.buffered:
        kept = size * plan.gradient.slots * vocab
    else:
        kept = size * max(plan.tile, plan.group) * vocab + 4 * head.weight.numel()
    return products.product_bytes(head) * plan.tile * vocab + kept + products.whole_terms_bytes(head)


class FlatStatistics:
    """logp and entropy over the flat [B*T] positions, with one scratch entry at B*T for padding slots (so
    scattering a tile's values needs no boolean indexing, which would make the host wait for the GPU)."""

    def __init__(self, numel: int, dtype, device):
        self.numel = numel
        self.logp = torch.zeros(numel + 1, dtype=dtype, device=device)
        self.entropy = torch.zeros_like(self.logp)

    def destinations(self, plan: TilePlan) -> torch.Tensor:
        return torch.where(plan.valid, plan.source, self.numel)

    def write(self, dest, logp, entropy) -> None:
        self.logp.index_copy_(0, dest, logp)
        self.entropy.index_copy_(0, dest, entropy)

    def view(self, shape):
        return self.logp[: self.numel].view(shape), self.entropy[: self.numel].view(shape)


def tile_gradients(objective: Objective, flat: FlatStatistics, norms, plan: TilePlan, tile, compiled: bool):
    """d loss / d (logp, entropy) for the tokens of the tile (s, n), from the objective on [B,T] with the batch's
    normalizers (exact: a token's gradient depends only on its own row's values, all of them in this tile)."""
    shape = objective.inputs.completion_mask.shape
    logp, entropy = flat.view(shape)
    g_lp, g_h = objective.token_gradients(logp.detach(), entropy.detach(), norms, compiled)
    s, n = tile
    src, valid = plan.source[s : s + n], plan.valid[s : s + n]
    return torch.where(valid, g_lp.reshape(-1)[src], 0.0), torch.where(valid, g_h.reshape(-1)[src], 0.0)


def run(engine: Engine, objective: Objective, head: Head, plan: SpeedPlan):
    inputs = objective.inputs
    hidden = inputs.hidden
    if not passes.differentiable(hidden, head):  # no_grad, inference_mode, or nothing requires grad: statistics only
        return statistics_run(engine, objective, head, plan)
    wanted = Wanted(head.weight.requires_grad, head.bias is not None and head.bias.requires_grad)
    call = GradientCall(wanted, hidden.requires_grad, passes.compiles_objective(engine, hidden))
    is_captured = captured_call.capturable(engine, objective)
    if is_captured:
        loss, metrics, logp, entropy, grads = captured(engine, objective, head, plan, call)
    else:
        loss, metrics, logp, entropy, grads = gradient_work(engine, objective, head, plan, call)
    loss = PrecomputedGradients.apply(loss, hidden, head.weight, head.bias, grads, is_captured)
    return loss, metrics, logp, entropy, None


def statistics_run(engine: Engine, objective: Objective, head: Head, plan: SpeedPlan):
    """The grad-mode tiles and kernel without gradients, so logp and entropy are bitwise the same."""
    inputs = objective.inputs
    ids = inputs.completion_ids
    flat = statistics_only_tokens(engine, objective, head.detached(), plan)
    slots = gather(engine, inputs, plan.gradient)
    dest = flat.destinations(plan.gradient)
    for s, n in plan.gradient.tiles:
        logp, entropy, _, _ = tile_statistics(engine, slots.x[s : s + n], slots.targets[s : s + n],
                                              head.detached().rows(s, n))  # fmt: skip
        flat.write(dest[s : s + n], logp, entropy)
    logp, entropy = flat.view(ids.shape)
    compiled = passes.compiles_objective(engine, inputs.hidden)
    loss, metrics = objective.loss_and_metrics(logp, entropy, compiled=compiled)
    return loss, metrics, logp, entropy, None


def statistics_only_tokens(engine: Engine, objective: Objective, detached: Head, plan: SpeedPlan) -> FlatStatistics:
    """The flat statistics, with those of the tokens whose gradient is known to be 0 filled in."""
    inputs = objective.inputs
    hidden, ids = inputs.hidden, inputs.completion_ids
    flat = FlatStatistics(ids.numel(), streaming.stat_dtype(hidden), hidden.device)
    if plan.statistics_only is not None and plan.statistics_only.tiles:
        slots = gather(engine, inputs, plan.statistics_only)
        logp, entropy, _ = passes.statistics_pass(engine, slots.x, slots.targets, detached, slots.plan.tiles)
        flat.write(flat.destinations(plan.statistics_only), logp, entropy)
    return flat


@dataclass(frozen=True)
class GradientCall:
    """What a differentiable call computes besides its tensors: which lm_head gradients, whether dX, and whether
    the objective runs as a torch.compile graph."""

    wanted: Wanted
    hidden_gradient: bool
    compile_objective: bool


def gradient_work(engine: Engine, objective: Objective, head: Head, plan: SpeedPlan, call: GradientCall):
    """(loss, metrics, logp, entropy, (dX, dW, db)): every tile's statistics and gradients, then the loss. Device
    work only (no host read), so that it can be captured (`captured`)."""
    inputs = objective.inputs
    hidden, ids = inputs.hidden, inputs.completion_ids
    detached = head.detached()
    flat = statistics_only_tokens(engine, objective, detached, plan)
    slots = gather(engine, inputs, plan.gradient)
    x, targets, tiles = slots.x, slots.targets, plan.gradient.tiles
    dest = flat.destinations(plan.gradient)
    grads = TokenOuterGradients(x, detached, tiles, plan.group, plan.buffered, call.wanted)
    norms, compared = None, streaming.compared_ids(targets)
    for s, n in tiles:
        logp, entropy, lse, product = tile_statistics(engine, x[s : s + n], targets[s : s + n], detached.rows(s, n))
        flat.write(dest[s : s + n], logp, entropy)
        # made after the first GEMM is queued, so the GPU does not wait while the host launches their kernels
        norms = objective.normalizers() if norms is None else norms
        g_logp, g_entropy = tile_gradients(objective, flat, norms, plan.gradient, (s, n), call.compile_objective)
        grads.add(engine.kernels, s, product, RowGradients(compared[s : s + n], lse, entropy, g_logp, g_entropy))
        del product  # freed before the next tile's is made
    dx, dw, db = grads.result(passes.weight_gradient_out(engine, head, call.wanted))
    distributed.all_sum_(dx, engine.shard.group)  # each vocabulary slice contributes to every token's dX
    dx = passes.hidden_gradient(engine, dx, x)
    logp, entropy = flat.view(ids.shape)
    loss, metrics = objective.loss_and_metrics(logp, entropy, None, norms, compiled=call.compile_objective)
    d_hidden = None
    if call.hidden_gradient and plan.gradient.identity and not inputs.packed:
        d_hidden = dx.view(hidden.shape)
    elif call.hidden_gradient:
        d_hidden = scatter_rows(dx, plan.gradient, hidden, inputs.hidden_rows)
    d_weight = dw.to(head.weight.dtype) if call.wanted.weight else None
    d_bias = db.to(head.bias.dtype) if call.wanted.bias else None
    return loss, metrics, logp, entropy, (d_hidden, d_weight, d_bias)


def gather(engine: Engine, inputs, plan: TilePlan) -> passes.Slots:
    """The plan's hidden rows and targets (relative to this rank's slice of the vocabulary)."""
    hidden, ids = inputs.hidden.detach(), inputs.completion_ids
    return passes.gather_slots(hidden, ids, plan, engine.shard.start, inputs.hidden_rows)


def tile_statistics(engine: Engine, x, targets, head: Head):
    """(logp, entropy, lse, GEMM output) of a token tile; with a vocabulary-parallel lm_head, the statistics of
    every rank's slice combined (one reduction over the group per tile) and the output of this rank's slice."""
    if not engine.shard.parallel:
        return engine.kernels.statistics_and_product(x, targets, head)
    *partial, product = engine.kernels.partial_statistics_and_product(x, targets, head)
    return (*distributed.combine_vocab_shards(*partial, engine.shard.group), product)


def captured(engine: Engine, objective: Objective, head: Head, plan: SpeedPlan, call: GradientCall):
    """`gradient_work` as a CUDA graph replay (`capture.Captures`): the per-call tensors (the batch's per-token
    inputs, hidden states, the plan's slots, the head's constants and the step's scalars) are the graph's
    inputs; the lm_head weight and bias are read in place, their addresses part of the key."""
    T = objective.inputs.completion_mask.shape[1]
    padded = not objective.inputs.packed
    if padded:  # a few completion lengths serve a run (`captured_call.LENGTH_BUCKET`)
        objective, plan = captured_call.pad_call(objective, plan, captured_call.padded_length(T))
    batch = captured_call.CallTensors.of(objective, head, plan)
    key = (NAME, call, batch.key(), plan.gradient.tiles, plan.gradient.identity, plan.buffered, plan.group,
           None if plan.statistics_only is None else (plan.statistics_only.tiles, plan.statistics_only.identity),
           engine.tiles, engine.kernels.compiled)  # fmt: skip

    def work(*tensors):
        o, h, p = batch.rebuilt(tensors, objective, head, plan)
        with torch.no_grad():
            return gradient_work(engine, o, h, p, call)

    loss, metrics, logp, entropy, (d_hidden, d_weight, d_bias) = engine.captures.run(key, work, batch.tensors)
    if padded:
        unpad = captured_call.unpad
        logp, entropy, d_hidden = (unpad(t, T) if t is not None else None for t in (logp, entropy, d_hidden))
    return loss, metrics, logp, entropy, (d_hidden, d_weight, d_bias)


def scatter_rows(dx, plan: TilePlan, hidden, rows=None):
    """dX of the slots back to hidden's shape, 0 where no slot is (padding, statistics-only tokens). Packed
    hidden states ([rows, H], `rows` the row of each position) sum the slots that share a row."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    numel = flat.shape[0]
    destination = plan.source if rows is None else rows[plan.source]
    d_hidden = torch.zeros(numel + 1, flat.shape[1], dtype=hidden.dtype, device=hidden.device)
    d_hidden.index_add_(0, torch.where(plan.valid, destination, numel), dx)  # padding slots: the scratch row
    return d_hidden[:numel].view(hidden.shape)


class PrecomputedGradients(torch.autograd.Function):
    """A loss whose gradients w.r.t. hidden, weight and bias were computed in the forward."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, grads, without_wait=False):
        # saved, not kept on ctx: autograd frees them after a backward (unless retain_graph), so a kept loss does
        # not hold dW, and a second backward with retain_graph=True finds them again
        ctx.save_for_backward(*grads)
        ctx.without_wait = without_wait
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, g):
        grads = ctx.saved_tensors
        # The usual loss.backward() (g = 1) needs no pass over [V, H], but finding out waits for the GPU. A captured
        # call's host is ahead of its GPU, and that wait would throw the lead away: it always scales (exact at 1).
        if ctx.without_wait or not torch.equal(g, torch.ones_like(g)):
            grads = tuple(None if t is None else (t * g).to(t.dtype) for t in grads)
        return (None, *grads, None, None)
