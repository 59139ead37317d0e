"""Sequences whose advantage is exactly 0 skip the backbone's backward (and, with "all", its forward).

With `beta == 0`, the entropy bonus off and no auxiliary loss, every loss type's per-token loss is the advantage
times a finite factor, so a sequence at advantage 0 adds nothing to any gradient, yet a trainer runs the whole
model's forward and backward on it. Here the micro-batch's model forward is split by rows:

- `"backward"`: the sequences with a gradient run the forward with grad; the others run it without grad (their
  final hidden states are still needed: the logged entropy and clip metrics and the batch-global
  `top_entropy_quantile` threshold cover them). The loss gets the whole micro-batch as before, so the loss, every
  gradient and every metric are the unsplit step's (the rows' values agree to the GEMMs' rounding at another
  batch size), and every normalizer counts the skipped sequences.
- `"all"`: the sequences without a gradient run no forward at all; the loss gets the others alone, scaled by the
  share of the micro-batch's normalizer they hold (`normalizer_share`), so the loss and gradients are still the
  unsplit step's, while the logged metrics cover the sequences with a gradient only. A generation batch is also
  regrouped (`regroup.py`). With `top_entropy_quantile < 1` (its threshold needs every entropy) it runs as
  "auto", said once.
- `"auto"` (the default): "backward" where it measured faster: lm_heads of hidden size >= `AUTO_HIDDEN_SIZE`
  (below it the step is bound by the host's launches and a second, small forward costs more than the backward
  it saves).
- `False`: every sequence trains, as TRL's trainer does.

A micro-batch with no sequence to train runs no forward with grad on one process: its loss is a zero that gives
every trainable parameter a zero gradient (as the full backward would: an optimizer step still moves AdamW's
weights). On several processes every rank issues the same calls, whatever its own rows (`plan_rows`). Not split
(said once, with the reason): beta != 0, the entropy bonus, a MoE auxiliary loss, multimodal inputs.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from ... import kernels
from . import packing, plan

SKIP_MODES = ("auto", "backward", "all", False)
# The smallest lm_head hidden size at which "auto" splits the forward (Qwen2.5-1.5B's is 1536, 0.5B's 896).
AUTO_HIDDEN_SIZE = 1536
# Per-row inputs of a micro-batch, sliced with its sequences ("all" hands the loss the trained rows alone).
ROW_INPUTS = ("completion_ids", "completion_mask", "advantages", "old_per_token_logps", "ref_per_token_logps",
              "sampling_per_token_logps", "importance_sampling_ratio", "tool_mask")  # fmt: skip
SHARE_BY_SEQUENCES = ("grpo", "sapo", "dr_grpo", "luspo")  # normalizers that count the micro-batch's sequences
SHARE_BY_TOKENS = ("bnpo",)  # normalizers that count the micro-batch's active tokens


class SkipNotice(UserWarning):
    """Why the trainer trains every sequence of its micro-batches although some are at advantage 0."""


class RowPlan(NamedTuple):
    """A micro-batch's forwards on this rank: the rows run with grad (empty: none at all), the rows run without
    (None: no such forward), whether either only keeps step with the other ranks (a stand-in row: the one without
    grad dropped, the one with grad at advantage 0), whether the loss gets the trained rows alone ("all"), whether
    any rank has a sequence with a gradient, and the shares of all ranks' sequences that skipped their backward
    and their forward."""

    trained: torch.Tensor
    untrained: torch.Tensor | None
    stand_in: bool
    trained_stand_in: bool
    sliced: bool
    any_gradient: bool
    skipped_backward: float
    skipped_forward: float
    rows: tuple = (None, None)  # the trained and untrained rows on the host (for packing them)


class LossRows(NamedTuple):
    """What the loss is called on: the inputs and mask of its rows, the factor its loss is multiplied by, and
    whether its metrics are logged."""

    inputs: dict
    mask: torch.Tensor
    share: float | torch.Tensor = 1.0
    log_metrics: bool = True


def check_mode(mode) -> None:
    if mode not in SKIP_MODES or isinstance(mode, (int, float)) and mode is not False:
        raise ValueError(f"skip_zero_advantage: expected one of {SKIP_MODES}, got {mode!r}")


def why_not(trainer, mode, hidden_size: int) -> str | None:
    """Why this trainer cannot split its forward by advantage (None: it can)."""
    args = trainer.args
    reasons = (
        (mode is False, "skip_zero_advantage=False"),
        (args.beta != 0.0, f"beta={args.beta} (the KL term has a gradient at advantage 0)"),
        (trainer._entropy_bonus_enabled, "the entropy bonus is on (its term has a gradient at advantage 0)"),
        (trainer.aux_loss_enabled, "the MoE auxiliary loss covers every sequence of the micro-batch"),
        (mode == "auto" and hidden_size < AUTO_HIDDEN_SIZE,
         f"skip_zero_advantage='auto' at hidden size {hidden_size} < {AUTO_HIDDEN_SIZE}, where the split forward "
         "measured slower (skip_zero_advantage='backward' splits anyway)"),
    )  # fmt: skip
    return next((why for applies, why in reasons if applies), None)


def plan_rows(trainer, inputs: dict, forward_untrained: bool) -> RowPlan | None:
    """The split of a micro-batch by its sequences' advantages, the same calls on every rank, or None when no
    rank has a sequence at advantage 0. On several processes a rank always runs one forward with grad (one row,
    its loss 0, when it has nothing to train: the backward's gradient reduction must run on every rank) and, if
    untrained rows run a forward, one without (a stand-in row when it has none)."""
    zero, counts, _, _ = plan.zero_rows(trainer, inputs)
    if int(counts[:, 0].sum()) == 0:
        return None
    # one process whose parameters are its own: a micro-batch with nothing to train may skip the model (an engine
    # that shards parameters must see them in a forward and a backward, as other ranks must keep step)
    alone = trainer.accelerator.num_processes == 1 and not getattr(trainer, "shards_parameters", False)
    rows = torch.arange(zero.numel())
    trained, untrained = rows[~zero], rows[zero]
    any_gradient = bool((counts[:, 0] < counts[:, 1]).any())
    trained_stand_in = trained.numel() == 0 and not alone
    if trained_stand_in:
        trained, untrained = rows[:1], rows[1:]
    stand_in = forward_untrained and not alone and untrained.numel() == 0
    if stand_in:
        untrained = rows[:1]
    skipped_backward = float(counts[:, 0].sum()) - (0 if alone else float((counts[:, 0] == counts[:, 1]).sum()))
    share = skipped_backward / float(counts[:, 1].sum())
    device = inputs["advantages"].device  # the rows copied there without a wait (a pageable copy would wait)
    kept = packing.to_device(untrained, device) if forward_untrained and untrained.numel() else None
    sliced = not forward_untrained
    skipped_forward = 0.0 if forward_untrained else share
    host = (trained, untrained if kept is not None else None)
    return RowPlan(packing.to_device(trained, device), kept, stand_in, trained_stand_in, sliced, any_gradient, share,
                   skipped_forward, host)  # fmt: skip


def rows_of(model_inputs: dict, rows: torch.Tensor) -> dict:
    """The model's inputs of some rows (every input is per row: multimodal inputs are not split)."""
    return {k: v.index_select(0, rows) if isinstance(v, torch.Tensor) else v for k, v in model_inputs.items()}


def split_forward(forward, model_inputs: dict, plan: RowPlan | None):
    """(final hidden states [B or trained rows, C, H], the trained rows' model outputs): `forward(model_inputs)` on
    the trained rows with grad and on the untrained ones without, put back in the micro-batch's row order; without
    a plan, on every row. (None, None) when nothing runs."""
    if plan is None:
        return forward(model_inputs)
    hidden, outputs = forward(rows_of(model_inputs, plan.trained)) if plan.trained.numel() else (None, None)
    if plan.untrained is None:
        return hidden, outputs
    with torch.no_grad():
        rest, _ = forward(rows_of(model_inputs, plan.untrained))
    if plan.stand_in:
        return hidden, outputs
    if hidden is None:
        return rest, None
    order = torch.cat([plan.trained, plan.untrained])
    return torch.cat([hidden, rest.to(hidden.dtype)]).index_select(0, torch.argsort(order)), outputs


def loss_rows(trainer, inputs: dict, mask: torch.Tensor, plan: RowPlan | None) -> LossRows:
    """The whole micro-batch, unless its untrained rows ran no forward ("all"): then the trained rows' inputs
    (num_items_in_batch as it is: the whole generation batch's), their loss scaled to the micro-batch's normalizer
    (`normalizer_share`), and no metrics logged when no rank has a sequence with a gradient."""
    if plan is None or not plan.sliced:
        return LossRows(inputs, mask)
    out = dict(inputs)
    for key in ROW_INPUTS:
        if isinstance(inputs.get(key), torch.Tensor) and inputs[key].dim() >= 1:
            out[key] = inputs[key].index_select(0, plan.trained)
    if out.get("num_items_in_batch") is None:  # the loss's default, over the whole micro-batch and every rank
        out["num_items_in_batch"] = trainer.accelerator.reduce(mask.sum(), "sum") * trainer.args.steps_per_generation
    share = normalizer_share(trainer.args.loss_type, mask, plan)
    rows_mask = mask.index_select(0, plan.trained)
    if plan.trained_stand_in:  # its row keeps this rank's backward in step with the others: no token of it counts
        rows_mask = torch.zeros_like(rows_mask)
    return LossRows(out, rows_mask, share, plan.any_gradient)


def normalizer_share(loss_type: str, mask: torch.Tensor, plan: RowPlan):
    """What the trained rows' loss, normalized over them alone, is multiplied by to be normalized over the whole
    micro-batch: their share of its sequences (grpo, sapo, dr_grpo, luspo) or of its active tokens (bnpo); 1 for the
    normalizers of the whole generation batch (dapo, cispo, vespo: `num_items_in_batch` is passed as it is)."""
    if loss_type in SHARE_BY_SEQUENCES:
        return plan.trained.numel() / mask.shape[0]
    if loss_type in SHARE_BY_TOKENS:
        kept = mask.index_select(0, plan.trained).sum().clamp(min=1)
        return kept.to(torch.float32) / mask.sum().clamp(min=1).to(torch.float32)
    return 1.0


def zero_gradients_loss(model) -> torch.Tensor:
    """A loss of 0 whose backward gives every trainable parameter a zero gradient, as a full backward of sequences
    at advantage 0 would (AdamW then moves the weights as after TRL's step), without running the model."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.stack([p.reshape(-1)[0].float() for p in params]).sum() * 0.0


def log_skipped(trainer, plan: RowPlan | None, mode: str) -> None:
    """The shares of all ranks' sequences that skipped their backward and their forward (train mode, where the
    trainer may split)."""
    if mode != "train" or trainer.skip_reason is not None:
        return
    metrics = trainer._metrics[mode]
    metrics["zero_advantage/skipped_backward"].append(0.0 if plan is None else plan.skipped_backward)
    metrics["zero_advantage/skipped_forward"].append(0.0 if plan is None else plan.skipped_forward)


def effective_mode(trainer, mode):
    """The mode the trainer runs: `mode`, but "all" with `top_entropy_quantile < 1` (whose threshold needs every
    sequence's entropy, so every sequence runs a forward) runs as "auto", the exact default, said once."""
    check_mode(mode)
    if mode == "all" and trainer.args.top_entropy_quantile < 1:
        say_once(trainer, "skip_zero_advantage='all' with top_entropy_quantile < 1 runs as 'auto' (exact: the "
                          "threshold needs every sequence's entropy)")  # fmt: skip
        return "auto"
    return mode


def reason_not_to_split(trainer, mode, hidden_size: int) -> str | None:
    """At construction: why this trainer never splits (None: it may), said once where a setting prevents it, not
    where the user chose False or where "auto" measured the split slower (the default's own choice)."""
    check_mode(mode)
    why = why_not(trainer, mode, hidden_size)
    chosen = mode is False or (mode == "auto" and why is not None and why.startswith("skip_zero_advantage='auto'"))
    if why is not None and not chosen:
        say_once(trainer, f"sequences at advantage 0 run their backward as the others: {why}")
    return why


def forwards_untrained(trainer) -> bool:
    """Whether sequences without a gradient still run a forward (without grad): always but under "all"."""
    return trainer.skip_zero_advantage != "all"


def row_plan(trainer, inputs: dict, mode: str, multimodal: bool) -> RowPlan | None:
    """This micro-batch's split (None: one forward of every row, as TRL's trainer runs it). Train mode only (eval
    has no backward); a read-back of the advantages unless its generation batch was annotated (`annotate`)."""
    if mode != "train" or trainer.skip_reason is not None:
        return None
    if multimodal:
        say_once(trainer, "sequences at advantage 0 run their backward as the others: multimodal inputs are not "
                          "split by rows")  # fmt: skip
        return None
    return plan_rows(trainer, inputs, forwards_untrained(trainer))


def say_once(trainer, message: str, category: type[UserWarning] = SkipNotice) -> None:
    """Warn with `message` the first time this trainer says it."""
    said = trainer.__dict__.setdefault("_notices", set())
    if message not in said:
        said.add(message)
        warnings.warn(f"compiled_grpo: {message}", category, stacklevel=kernels.frames_to_caller())
