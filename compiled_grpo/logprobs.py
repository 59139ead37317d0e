"""The primitive: per-token log-probabilities and entropies of any targets under the lm_head, for any loss.

`fused_linear_logprobs(hidden, weight, targets)` equals, in plain torch (with logits materialized, which this
never does):

    z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature      # temperature: a float, or per token
    logp = log_softmax(z).gather(-1, targets);  entropy = -(softmax(z) * log_softmax(z)).sum(-1)
    logp, entropy = 0 where targets == ignore_index

differentiable in hidden, weight and bias. It runs the engine of the GRPO loss's memory and sparse schedules
(`schedules.recompute.stream_statistics`): the statistics pass in the forward ([stats_rows, V] float32 logits at a
time), and a backward that recomputes the logits only for the rows whose upstream gradients are not both 0
(2NHV + 6nHV FLOPs for n such rows), without the entropy's term when no entropy gradient is non-zero. Under
`no_grad` or `inference_mode` the forward runs the same kernels on the same tiles: old, reference and policy
log-probs from this function agree bitwise.
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import torch

from . import checks, distributed, faults, products
from .capture import Captures
from .faults import Deferred, Faults
from .head import Head, VocabShard, device_constant
from .kernels import Kernels
from .primitive_checks import check_inputs, check_options, value_checks
from .schedules.passes import Engine, statistics_pass
from .schedules.recompute import StatisticsThenRecompute, stream_statistics
from .schedules.sparse_gradients import StatisticsThenSparseGradients
from .streaming import stat_dtype
from .tiling import DEFAULT_WORKSPACE_BYTES, TilePlan, Tiles, from_slots, plan_mask, to_slots

TILE_OPTIONS = ("token_tile", "tail_tile", "vocab_tile", "stats_rows", "sparse_tile")


class LogProbs(NamedTuple):
    logp: torch.Tensor  # float32 (float64 for float64 inputs), shaped like targets, 0 at ignored targets
    entropy: torch.Tensor | None  # the same; None with entropy=False


class Targets(NamedTuple):
    """What the engine streams: hidden rows and the target of each flat position."""

    hidden: torch.Tensor  # [N, H]
    completion_ids: torch.Tensor  # [N]
    hidden_rows: torch.Tensor | None = None


@functools.cache
def kernels(compiled: bool) -> Kernels:
    return Kernels(compiled)


def fused_linear_logprobs(
    hidden,
    weight,
    targets,
    *,
    bias=None,
    temperature=1.0,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    ignore_index: int = -100,
    entropy: bool = True,
    compiled: bool = True,
    validate: bool = True,
    vocab_parallel_group=None,
    vocab_start: int = 0,
    capture: bool = False,
    round_logits: bool = False,
    **tiles: int,
) -> LogProbs:
    """(logp, entropy) of `targets` under the lm_head, float32, shaped like `targets` (see the module's docstring).

    hidden [..., H] (any leading shape: [B, T, H], packed [N, H]); weight [V, H] (this rank's rows of it with
    `vocab_parallel_group`, starting at vocabulary id `vocab_start`); targets [...] integer; bias [V] or None.
    temperature: a positive float, or a tensor that is 0-d or has targets' dimensions and broadcasts to them
    (per sequence [B, 1], per token [B, T]).
    `entropy=False` returns None for it and its backward forms no entropy term. `compiled=False` runs the same
    tile functions eagerly. `validate=False` skips the checks that read values back to the host (ids in range,
    finite temperatures, finite statistics). `capture=True` (experimental, GPU): the statistics pass and the
    backward's gradient pass as CUDA graph replays (`capture.Captures`, one set per process). `round_logits=True`:
    the lm_head product rounded to the inputs' 16-bit dtype before the softmax, as TRL's head does. Tile sizes:
    token_tile, tail_tile, vocab_tile, stats_rows, sparse_tile (`tiling.Tiles`, defaults by device). Under
    autocast the GEMMs run in the autocast dtype.
    """
    checks.unknown_names(tiles, TILE_OPTIONS + LOGPROBS_OPTIONS, "fused_linear_logprobs()")
    options = Options(logit_scale, temperature, final_logit_softcapping, ignore_index, compiled, validate,
                      vocab_parallel_group, vocab_start, tiles, capture, round_logits)  # fmt: skip
    return logprobs_of_call(hidden, weight, targets, bias, options, entropy=entropy)[0]


def logprobs_of_call(hidden, weight, targets, bias, options: Options, *, entropy: bool, extras: bool = False):
    """(LogProbs, ExtraStatistics or None): the statistics pass with its recomputing backward, checked."""
    checks.check_flags(entropy=entropy)  # the other options: `prepare`
    call = prepare(hidden, weight, targets, bias, options)
    parallel = call.engine.shard.parallel
    function = StatisticsThenRecompute if parallel else StatisticsThenSparseGradients
    with torch.autocast(call.stream.hidden.device.type, enabled=False):
        logp, ent, *more = stream_statistics(function, call.engine, call.stream, call.plan, call.head, extras)
    if options.validate:
        later = faults.deferred(call.stream.hidden.device)
        found = checks.statistics_faults(call.valid, logp, ent, call.stream.hidden, call.head.weight,
                                             call.head.bias, later=later)  # fmt: skip
        PRIMITIVE_DEFERRED.keep(found) if later else found.settle()
    found = LogProbs(logp.view(targets.shape), ent.view(targets.shape) if entropy else None)
    return found, ExtraStatistics(*(t.view(targets.shape) for t in more)) if extras else None


class ExtraStatistics(NamedTuple):
    log_sum_sq_probs: torch.Tensor  # log sum_v p_v^2, float32, 0 at ignored targets
    mean_logits: torch.Tensor  # mean_v z_v (z after scale, softcap and temperature), float32, 0 at ignored targets
    is_top1: torch.Tensor  # bool: the target is the first maximal logit; False at ignored targets


def fused_linear_extra_statistics(
    hidden,
    weight,
    targets,
    *,
    bias=None,
    temperature=1.0,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    ignore_index: int = -100,
    compiled: bool = True,
    **tiles: int,
) -> ExtraStatistics:
    """Without gradient, the per-token fields TRL 1.16's fused head also offers (`ExtraStatistics`), from one more
    statistics pass over the lm_head (same arguments as `fused_linear_logprobs`; no vocabulary-parallel head)."""
    checks.unknown_names(tiles, TILE_OPTIONS + EXTRA_OPTIONS, "fused_linear_extra_statistics()")
    options = Options(logit_scale, temperature, final_logit_softcapping, ignore_index, compiled, False, None, 0, tiles)
    call = prepare(hidden, weight, targets, bias, options)
    x = to_slots(call.stream.hidden, call.plan, fill=None)
    ids = to_slots(call.stream.completion_ids, call.plan, fill=0)
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        per_slot = statistics_pass(call.engine, x, ids, call.head.detached(), call.plan.tiles, extras=True)[3:]
    numel = call.stream.completion_ids.numel()
    return ExtraStatistics(*(from_slots(values, call.plan, numel).view(targets.shape) for values in per_slot))


def fused_linear_logprobs_with_extras(hidden, weight, targets, *, bias=None, temperature=1.0,
                                      logit_scale: float = 1.0, final_logit_softcapping: float | None = None,
                                      ignore_index: int = -100, entropy: bool = True, compiled: bool = True,
                                      validate: bool = True, capture: bool = False, round_logits: bool = False,
                                      **tiles: int) -> tuple[LogProbs, ExtraStatistics]:  # fmt: skip
    """`fused_linear_logprobs` (same arguments, no vocabulary-parallel head) and, from the same statistics pass, the
    fields of `fused_linear_extra_statistics` (without gradient, of the same logits: rounded with
    `round_logits=True`): what TRL's SFT, DPO and KTO trainers ask of their head, in one read of the logits.
    Eager, the log-probs, entropies and gradients are `fused_linear_logprobs`' bitwise; compiled they may differ
    by a float32 rounding (the pass is another compiled kernel, whose sums Inductor may order differently)."""
    checks.unknown_names(tiles, TILE_OPTIONS + WITH_EXTRAS_OPTIONS, "fused_linear_logprobs_with_extras()")
    options = Options(logit_scale, temperature, final_logit_softcapping, ignore_index, compiled, validate, None,
                      0, tiles, capture, round_logits)  # fmt: skip
    return logprobs_of_call(hidden, weight, targets, bias, options, entropy=entropy, extras=True)


def _keywords(function) -> tuple[str, ...]:
    kinds = (inspect.Parameter.KEYWORD_ONLY,)
    return tuple(p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds)


# every keyword, so that a misspelt one (tiles swallows unknown names) gets the closest valid name suggested
LOGPROBS_OPTIONS = _keywords(fused_linear_logprobs)
EXTRA_OPTIONS = _keywords(fused_linear_extra_statistics)
WITH_EXTRAS_OPTIONS = _keywords(fused_linear_logprobs_with_extras)


# The primitive's captured calls (`capture=True`) and value checks read at a later call (`faults.Deferred`): one of
# each per process, as it has no object to keep them. The graphs' pool is held to the loss's default workspace
# budget (set `PRIMITIVE_CAPTURES.pool_limit` for another): past it, the primitive's calls run uncaptured.
PRIMITIVE_CAPTURES = Captures(pool_limit=DEFAULT_WORKSPACE_BYTES)
PRIMITIVE_DEFERRED = Deferred()


def primitive_captures(reset: bool = False) -> Captures:
    """The process-wide graphs of `fused_linear_logprobs(capture=True)`: `replays`, `pool_bytes` (what their
    memory pool reserves) and `pool_limit` (bytes, settable) to read. `reset=True` first drops every graph (a new,
    empty set at the default budget): later calls capture afresh."""
    global PRIMITIVE_CAPTURES
    if reset:
        PRIMITIVE_CAPTURES = Captures(pool_limit=DEFAULT_WORKSPACE_BYTES)
    return PRIMITIVE_CAPTURES


class Call(NamedTuple):
    """A primitive call's inputs as the engine takes them."""

    engine: Engine
    plan: TilePlan
    head: Head
    stream: Targets
    valid: torch.Tensor  # [N] bool: the positions whose target is not ignore_index


class Options(NamedTuple):
    """A primitive call's keyword options."""

    logit_scale: float
    temperature: float | torch.Tensor
    final_logit_softcapping: float | None
    ignore_index: int
    compiled: bool
    validate: bool
    vocab_parallel_group: object
    vocab_start: int
    tiles: dict
    capture: bool = False
    round_logits: bool = False


def prepare(hidden, weight, targets, bias, o: Options) -> Call:
    """Checks, autocast casts, the tile plan over the positions with a target, and the head."""
    check_options(o)
    check_inputs(hidden, weight, targets, bias, o.temperature)
    hidden, weight, bias = under_autocast(hidden, weight, bias)
    split = products.splits(hidden, weight)
    hidden = products.widened(hidden, weight)
    flat_targets = targets.reshape(-1)
    valid = flat_targets != o.ignore_index
    group = distributed.LOCAL if o.vocab_parallel_group is None else o.vocab_parallel_group
    value_faults = value_checks(flat_targets, valid, weight, group, o.temperature) if o.validate else Faults()
    captures = PRIMITIVE_CAPTURES.applies_to(hidden) if o.capture else None
    tiles = Tiles.for_device(hidden.device, captures is not None, **o.tiles)
    engine = Engine(kernels(o.compiled), tiles, VocabShard(group, o.vocab_start), captures)
    plan = plan_mask(valid, engine.tiles.token_tile, engine.tiles.tail_tile, engine.slot_bucket)
    # the plan has waited for the device: the flags of the value checks, and of earlier calls, are on the host
    PRIMITIVE_DEFERRED.raise_pending()
    value_faults.raise_first()
    head_values = (o.logit_scale, o.temperature, o.final_logit_softcapping)
    head = make_head(weight, bias, head_values, stat_dtype(hidden), targets.shape, o.round_logits, split=split)
    if head.row_inv_temp is not None:
        head = head._replace(row_inv_temp=to_slots(head.row_inv_temp, plan, fill=None))
    stream = Targets(hidden.reshape(-1, hidden.shape[-1]), flat_targets.masked_fill(~valid, 0))
    return Call(engine, plan, head, stream, valid)


def make_head(weight, bias, values, dtype, shape, rounded: bool = False, *, split: bool = False):
    """The lm_head as the tiles see it: (logit_scale, temperature, softcap) in one small tensor, and a per-token
    temperature as one 1 / temperature per flat position; `split`: products from the weight's bf16 terms."""
    scale, temperature, cap = values
    per_token = isinstance(temperature, torch.Tensor)
    inv_temp = 1.0 if per_token else 1.0 / temperature
    constants = device_constant((float(scale), inv_temp, float(cap or 1.0)), dtype, weight.device)
    row_inv_temp = None
    if per_token:
        row_inv_temp = (1.0 / temperature.detach().to(weight.device, dtype)).broadcast_to(shape).reshape(-1)
    terms = products.weight_terms(weight) if split else None
    return Head(weight, bias, constants, cap is not None, row_inv_temp, rounded, terms, split)


def under_autocast(hidden, weight, bias):
    """Under autocast, the floating lm_head tensors in the autocast dtype (as TRL's fused head computes)."""
    device_type = hidden.device.type
    if not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    cast = lambda t: t.to(dtype) if t is not None and t.is_floating_point() else t
    return cast(hidden), cast(weight), cast(bias)
