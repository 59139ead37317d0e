"""The loss's constructor options, checked: a ValueError or TypeError naming the option."""

from __future__ import annotations

import numbers

from . import distributed
from .schedules.choice import SCHEDULES
from .tiling import TILE_NAMES

FLAGS = ("compiled", "validate", "capture", "round_logits")


def check_budget(logits_budget_bytes) -> int:
    if isinstance(logits_budget_bytes, bool) or not isinstance(logits_budget_bytes, numbers.Integral):
        raise TypeError(f"logits_budget_bytes: expected an int (bytes), got {logits_budget_bytes!r}")
    if logits_budget_bytes < 0:
        raise ValueError(f"logits_budget_bytes: must be >= 0, got {logits_budget_bytes!r}")
    return int(logits_budget_bytes)


def check_schedule(schedule, config) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "speed" and config.uses_entropy_mask:
        raise ValueError(
            "schedule='speed' cannot be used with top_entropy_quantile < 1: the entropy threshold needs every "
            "token's entropy before any gradient can be formed; use schedule='sparse' (or 'auto')"
        )


def tile_overrides(**knobs) -> dict:
    """The tile sizes given (`tiling.Tiles` fields), each a positive int."""
    assert set(knobs) == set(TILE_NAMES)
    for name, v in knobs.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    return {k: v for k, v in knobs.items() if v is not None}


def process_groups(schedule, process_group, vocab_parallel_group, sequence_parallel_group):
    """(data-parallel, vocabulary-parallel, sequence-parallel group), checked; `distributed.LOCAL` for a group
    whose reductions stay on this rank."""
    if sequence_parallel_group is not None and (vocab_parallel_group is not None or schedule == "speed"):
        raise ValueError("sequence_parallel_group: not with a vocab_parallel_group, nor with "
                         "schedule='speed' (its tiles need every token of a sequence)")  # fmt: skip
    # Vocabulary- and sequence-parallel ranks hold the same sequences: their batch reductions stay local unless a
    # data-parallel group is given.
    if process_group is None and (vocab_parallel_group is not None or sequence_parallel_group is not None):
        process_group = distributed.LOCAL
    vocab_group = distributed.LOCAL if vocab_parallel_group is None else vocab_parallel_group
    return process_group, vocab_group, sequence_parallel_group


def check_vocab_start(vocab_start, vocab_group) -> int:
    """This rank's first vocabulary row: an int >= 0, and 0 unless the lm_head is vocabulary-parallel."""
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, numbers.Integral):
        raise TypeError(f"vocab_start: expected an int, got {vocab_start!r}")
    if vocab_start < 0:
        raise ValueError(f"vocab_start: must be >= 0, got {vocab_start!r}")
    if vocab_start and vocab_group is distributed.LOCAL:
        raise ValueError(f"vocab_start={vocab_start} needs vocab_parallel_group= (the loss was built without one, "
                         "so its weight is the whole vocabulary)")  # fmt: skip
    return int(vocab_start)
