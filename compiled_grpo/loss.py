"""The public loss: `FusedLinearGRPOLoss` and `fused_linear_grpo_loss`.

It equals, in plain torch (with logits materialized, which this never does):

    z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature
    logp = log_softmax(z).gather(-1, completion_ids);  entropy = -(softmax(z) * log_softmax(z)).sum(-1)
    loss = <TRL 1.16.0 GRPOTrainer._compute_loss>(logp, entropy, completion_mask, advantages, ...)

and returns TRL's metrics, the per-token logp and entropy, and the entropy mask (docs/semantics.md says what
is computed, docs/usage.md how to call it). A call flows: inputs checked -> the batch
objective (`batch_objective.Objective`) -> `schedules.choice.choose` -> the schedule's `run`, which streams the lm_head
tiles and asks the objective for the loss.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from . import checks, distributed, faults, options, sequence_parallel, validation
from .batch_objective import Objective
from .capture import Captures
from .config import SETTING_NAMES, GRPOLossConfig, warn_dr_grpo_length
from .faults import Deferred, Faults
from .head import VocabShard, make_head
from .inputs import LossInputs
from .kernels import Kernels, frames_to_caller
from .packing import lay_out
from .schedules import captured_call, choice, passes, reference_logps
from .step import Step, add_step_faults, make_step
from .tiling import DEFAULT_WORKSPACE_BYTES, Tiles


@dataclass
class GRPOLossOutput:
    loss: torch.Tensor  # 0-d, float32 (float64 for float64 inputs), differentiable
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    per_token_logps: torch.Tensor | None = None  # [B,T], detached, 0 where masked
    entropy: torch.Tensor | None = None  # [B,T], detached, 0 where masked
    entropy_mask: torch.Tensor | None = None  # [B,T] bool, None when top_entropy_quantile == 1
    schedule: str | None = None  # the schedule that ran: "memory", "speed" or "sparse" (what "auto" chose)


class FusedLinearGRPOLoss:
    """GRPO-family loss from hidden states and the lm_head, without materializing [tokens, vocab] logits.

    Settings (TRL's names and defaults, see `GRPOLossConfig`) are validated once, here. `compiled=True` runs the
    tile functions under torch.compile; `compiled=False` runs the same functions eagerly. `schedule`: "memory",
    "speed", "sparse" or "auto" (`schedules.choice.choose` states the rule). `validate=False` skips the value
    checks (ids in range, finite inputs and statistics: reductions on the device, read back where the host waits
    anyway; on a GPU the check of a call's statistics is raised at the next call or by `check()`). Tile sizes
    (`tiling.Tiles`) default by device; `logits_budget_bytes` bounds the workspace of the speed and sparse
    schedules, beyond which "auto" picks memory. `round_logits=True` rounds the lm_head product to the inputs'
    16-bit dtype before the softmax, as TRL's head does; the default keeps it in float32.
    """

    def __init__(
        self,
        *,
        compiled: bool = True,
        schedule: str = "auto",
        validate: bool = True,
        token_tile: int | None = None,
        tail_tile: int | None = None,
        vocab_tile: int | None = None,
        stats_rows: int | None = None,
        speed_tile: int | None = None,
        speed_group: int | None = None,
        sparse_tile: int | None = None,
        logits_budget_bytes: int = DEFAULT_WORKSPACE_BYTES,
        process_group=None,
        vocab_parallel_group=None,
        sequence_parallel_group=None,
        capture: bool = False,
        round_logits: bool = False,
        **settings,
    ):
        checks.unknown_names(settings, SETTING_NAMES + CONSTRUCTOR_OPTIONS, "FusedLinearGRPOLoss()")
        self.config = GRPOLossConfig(**settings)
        options.check_schedule(schedule, self.config)
        checks.check_flags(compiled=compiled, validate=validate, capture=capture, round_logits=round_logits)
        self.schedule, self.validate, self.round_logits = schedule, validate, round_logits
        self.tile_overrides = options.tile_overrides(
            token_tile=token_tile, tail_tile=tail_tile, vocab_tile=vocab_tile, stats_rows=stats_rows,
            speed_tile=speed_tile, speed_group=speed_group, sparse_tile=sparse_tile,
        )  # fmt: skip
        self.logits_budget_bytes = options.check_budget(logits_budget_bytes)
        self.process_group, self.vocab_group, self.sequence_group = options.process_groups(
            schedule, process_group, vocab_parallel_group, sequence_parallel_group
        )
        self.kernels = Kernels(compiled)
        # On a GPU, the schedules' passes, the memory and sparse forward and the value checks as CUDA graph replays
        # (`capture.Captures`); elsewhere, as without it
        self.captures = Captures() if capture else None
        self.deferred = Deferred()  # value checks of earlier calls not yet read (`check`)

    def __call__(
        self,
        hidden,
        weight,
        completion_ids,
        completion_mask,
        advantages,
        *,
        bias=None,
        old_per_token_logps=None,
        ref_per_token_logps=None,
        sampling_per_token_logps=None,
        importance_sampling_ratio=None,
        ref_hidden=None,
        ref_weight=None,
        ref_bias=None,
        num_items_in_batch=None,
        num_processes=None,
        gradient_accumulation_steps=1,
        steps_per_generation=None,
        entropy_coef=None,
        vocab_start=0,
        segment_ids=None,
        num_sequences=None,
        row_index=None,
        **unknown,
    ) -> GRPOLossOutput:
        """The loss of one micro-batch. Inputs: docs/usage.md (shapes as on `inputs.LossInputs`). Under autocast,
        the lm_head GEMMs run in the autocast dtype (as TRL's fused head does).

        Packed batches (`segment_ids` given; docs/usage.md, "Packed batches"): hidden [rows, H], one entry per
        trained token in completion_ids, completion_mask, segment_ids (its sequence, 0..S-1, a sequence's tokens
        in order), the per-token inputs and optionally row_index (the hidden row predicting it);
        advantages and importance_sampling_ratio per token or per sequence. The loss is the padded call's with
        each sequence left-aligned in its own row; outputs come back per token."""
        checks.unknown_names(unknown, CALL_INPUTS, "FusedLinearGRPOLoss.__call__()")
        given = LossInputs(
            hidden, weight, completion_ids, completion_mask, advantages, bias=bias,
            old_per_token_logps=old_per_token_logps, ref_per_token_logps=ref_per_token_logps,
            sampling_per_token_logps=sampling_per_token_logps, importance_sampling_ratio=importance_sampling_ratio,
            ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias,
        ).with_constants_detached()  # fmt: skip
        validation.check_devices(given)
        inputs, packing = _laid_out(given, (segment_ids, num_sequences, row_index), self.sequence_group, self.validate)
        processes = distributed.world_size(self.process_group) if num_processes is None else num_processes
        coef = self.config.entropy_coef if entropy_coef is None else entropy_coef
        step = make_step(gradient_accumulation_steps, steps_per_generation, num_items_in_batch, processes, coef)
        shard = VocabShard(self.vocab_group, options.check_vocab_start(vocab_start, self.vocab_group))
        device_type = hidden.device.type if isinstance(hidden, torch.Tensor) else "cpu"
        with torch.autocast(device_type, enabled=False):
            out = self._loss(inputs, step, shard)
        if packing is None:
            return out
        packed = map(packing.pack, (out.per_token_logps, out.entropy, out.entropy_mask))
        return GRPOLossOutput(out.loss, out.metrics, *packed, schedule=out.schedule)

    def _loss(self, inputs: LossInputs, step: Step, shard: VocabShard) -> GRPOLossOutput:
        captures = None if self.captures is None else self.captures.applies_to(inputs.hidden, self.logits_budget_bytes)
        checks = captured_call.checks_captures(captures, inputs)
        inputs, value_faults = _checked(inputs, step, checks, self.config, self.vocab_group, self.validate)
        tiles = Tiles.for_device(inputs.hidden.device, captures is not None, **self.tile_overrides)
        engine = passes.Engine(self.kernels, tiles, shard, captures)
        objective = _objective(self, engine, inputs, step)
        schedule, plan, head = _scheduled(self, engine, objective)
        # the plan has waited for the device: the flags of the value checks, and of earlier calls, are on the host
        self.deferred.raise_pending()
        value_faults.raise_first()
        out = GRPOLossOutput(*schedule.run(engine, objective, head, plan), schedule=schedule.NAME)
        if self.validate:
            _check_statistics(inputs, out, checks, self.deferred)
        return out

    def check(self) -> None:
        """Raise now the error of a value check pending from an earlier call (on a GPU a call's statistics are
        checked at the next call, so that no call waits for its work); waits for the device."""
        self.deferred.raise_pending()


def _objective(loss: FusedLinearGRPOLoss, engine: passes.Engine, inputs: LossInputs, step: Step) -> Objective:
    """The batch objective; the reference log-probs computed first when beta != 0 and only its head is given."""
    if loss.config.beta != 0.0 and inputs.ref_per_token_logps is None:
        inputs = reference_logps.with_reference_logps(engine, inputs, loss.config, loss.round_logits)
    slices = None
    if sequence_parallel.active(loss.sequence_group):
        slices = sequence_parallel.SequenceSlices.of(loss.sequence_group, inputs.completion_mask)
    return Objective(loss.config, inputs, step, loss.process_group, slices)


def _scheduled(loss: FusedLinearGRPOLoss, engine: passes.Engine, objective: Objective):
    """(schedule, its plan, the head as it reads it) for the call (`schedules.choice`)."""
    inputs = objective.inputs
    head = make_head(inputs.weight, inputs.bias, loss.config, objective.dtype, loss.round_logits, inputs.split_head)
    schedule, plan = choice.choose(loss.schedule, engine, objective, head, loss.logits_budget_bytes)
    return schedule, plan, choice.head_for(schedule, head)


def _laid_out(given: LossInputs, packed_layout, sequence_group, validate: bool):
    """(the inputs in the padded layout and under autocast, the `packing.Packing` of a packed call or None)."""
    if packed_layout[0] is not None and sequence_group is not None:
        raise ValueError("segment_ids: a packed call does not take a sequence_parallel_group; pass each rank's "
                         "slice of the padded [B, T] batch")  # fmt: skip
    inputs, packing = lay_out(given, packed_layout, validate)
    return inputs.under_autocast(), packing


def _checked(inputs: LossInputs, step: Step, captures, config, vocab_group, validate) -> tuple[LossInputs, Faults]:
    """Shapes and dtypes now, values (unless validate=False) as device flags whose read-back has started
    (with `captures`, computed by a CUDA graph replay); DTensor weights gathered; [B, 1] advantages as [B]; 16-bit
    hidden states against a float32 weight widened (`LossInputs.widened`); the dr_grpo length warning."""
    validation.check_shapes(inputs)
    warn_dr_grpo_length(config, inputs.completion_mask.shape[1], frames_to_caller() + 1)
    inputs = inputs.with_row_advantages()
    no_reference = inputs.ref_per_token_logps is None and inputs.ref_hidden is None and inputs.ref_weight is None
    if config.beta != 0.0 and no_reference:
        raise ValueError("beta != 0 needs ref_per_token_logps, or ref_hidden / ref_weight to compute them")
    inputs = inputs.cast_head(distributed.full_tensor).widened()
    if not validate:
        return inputs, Faults()
    vocab = inputs.weight.shape[0]
    if vocab_group is not distributed.LOCAL:
        vocab = int(distributed.all_sum(torch.tensor(vocab, device=inputs.weight.device), vocab_group))
    return inputs, add_step_faults(validation.value_faults(inputs, vocab, captures), step).issue()


def _check_statistics(inputs: LossInputs, out: GRPOLossOutput, captures, deferred: Deferred) -> None:
    """Finite statistics at active positions: now on a CPU; on a GPU read at the next call or by `check()`."""
    later = faults.deferred(inputs.hidden.device)
    active = inputs.completion_mask.bool()
    found = checks.statistics_faults(active, out.per_token_logps, out.entropy, inputs.hidden, inputs.weight,
                                         inputs.bias, rows=inputs.hidden_rows, later=later,
                                         captures=captures)  # fmt: skip
    deferred.keep(found) if later else found.settle()


def _parameters(function, kinds) -> tuple[str, ...]:
    return tuple(p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds)


_KEYWORD = (inspect.Parameter.KEYWORD_ONLY,)
CONSTRUCTOR_OPTIONS = _parameters(FusedLinearGRPOLoss.__init__, _KEYWORD)
CALL_INPUTS = _parameters(FusedLinearGRPOLoss.__call__, _KEYWORD)


def fused_linear_grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, **kwargs) -> GRPOLossOutput:
    """Functional form: every constructor option, setting and call input as a keyword. Builds the loss on every
    call (the compiled tiles are shared across calls by torch.compile's cache, keyed on shapes)."""
    built = {k: kwargs.pop(k) for k in list(kwargs) if k in SETTING_NAMES or k in CONSTRUCTOR_OPTIONS}
    checks.unknown_names(kwargs, SETTING_NAMES + CONSTRUCTOR_OPTIONS + CALL_INPUTS, "fused_linear_grpo_loss()")
    loss_fn = FusedLinearGRPOLoss(**built)
    return loss_fn(hidden, weight, completion_ids, completion_mask, advantages, **kwargs)
