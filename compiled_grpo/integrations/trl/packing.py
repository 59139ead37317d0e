"""A micro-batch's real tokens, without its padding: trimmed to its own longest prompt and completion, or packed.

TRL's GRPOTrainer pads every micro-batch to its generation batch's longest completion (and its prompts, on the left,
to the longest prompt). Trimming drops the columns that are padding in every row: exact, as every dropped position
is masked out of attention and of the loss. Packing lays the real tokens of some rows end to end in one row of the
model, `position_ids` restarting at 0 where each sequence starts and no attention mask: transformers then builds the
mask that keeps each sequence to itself (for sdpa, eager, flex_attention and FlashAttention alike), so a packed
sequence equals the sequence forwarded alone, and the sequence in TRL's padded row to rounding (its left-padded
prompt shifts its rotary positions, which cancel in attention). The packed row's length is rounded up to a multiple
of `bucket` by a dummy sequence of its own, so that a run compiles a bounded number of shapes.

The loss then reads the packed final hidden states in place (`targets`): completion token j of a row is predicted by
the packed position just before it, and the loss's packed call lays the targets out as the padded call's rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...packing import to_device
from .plan import Lengths

PER_TOKEN = ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps")
PER_TOKEN_OR_SEQUENCE = ("advantages", "importance_sampling_ratio")


def widths(lengths: Lengths) -> tuple[int, int]:
    """(prompt width, completion width) of the padded micro-batch the lengths were read from."""
    return lengths.masks[0].shape[1], lengths.masks[1].shape[1]


def trimmed(inputs: dict, lengths: Lengths) -> tuple[dict, Lengths]:
    """The micro-batch without the prompt columns that are padding in every row (on the left) nor the completion
    columns that are (on the right), at least one completion column; and its lengths on those widths."""
    P, C = widths(lengths)
    keep_p = int(lengths.prompt.max()) if len(lengths.prompt) else P
    keep_c = max(int(lengths.completion.max()) if len(lengths.completion) else C, 1)
    if keep_p == P and keep_c == C:
        return inputs, lengths
    out = dict(inputs)
    for key, value in inputs.items():
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            continue
        if key in ("prompt_ids", "prompt_mask"):
            out[key] = value[:, P - keep_p :]
        elif value.shape[1] == C:  # completion ids and masks, per-token log-probs, advantages or ratios
            out[key] = value[:, :keep_c]
    return out, lengths._replace(masks=(out["prompt_mask"], out["completion_mask"]))


def can_pack(lengths: Lengths) -> bool:
    """Whether the rows' real tokens are one span each, every sequence with at least one prompt token (the position
    that predicts its first completion token)."""
    return lengths.contiguous and bool((lengths.prompt > 0).all())


class PackedRows(NamedTuple):
    """Rows of a micro-batch as one row of the model: its input_ids and position_ids [1, N] (N a multiple of the
    bucket) and, on the host, where each row's tokens start in it, and where each sequence of the row starts (the
    rows' and the bucket's dummy sequence: [sequences + 1], int32, ending at N) and the longest sequence's length."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    starts: torch.Tensor
    cu_seqlens: torch.Tensor
    longest: int


def pack(ids: torch.Tensor, lengths: Lengths, rows: torch.Tensor, bucket: int) -> PackedRows:
    """`rows` (host indices) of the micro-batch's [B, P + C] prompt-and-completion ids, packed (`PackedRows`). The
    row is padded to a multiple of `bucket` by a sequence of its own (positions from 0), which nothing reads."""
    P, _ = widths(lengths)
    prompt, completion = lengths.prompt[rows], lengths.completion[rows]
    span = prompt + completion
    starts = torch.cumsum(span, 0) - span
    total = int(span.sum())
    sequence = torch.repeat_interleave(torch.arange(len(rows)), span)
    within = torch.arange(total) - starts[sequence]
    flat = rows[sequence] * ids.shape[1] + (P - prompt)[sequence] + within
    pad = -total % bucket if total else bucket
    flat = torch.cat([flat, torch.full((pad,), int(rows[0]) * ids.shape[1] + P - 1 if len(rows) else 0)])
    positions = torch.cat([within, torch.arange(pad)])
    index = to_device(torch.stack([flat, positions]), ids.device)
    packed_ids = ids.reshape(-1).index_select(0, index[0]).unsqueeze(0)
    lengths = torch.cat([span, torch.tensor([pad])]) if pad else span
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)]).to(torch.int32)
    return PackedRows(packed_ids, index[1].unsqueeze(0), starts, cu_seqlens, int(lengths.max()) if len(lengths) else 0)


class Targets(NamedTuple):
    """The loss's packed call over some rows (the loss rows, S of them): for each of M targets, its index in the
    rows' [S, C] per-token tensors and the hidden row that predicts it, on the device; on the host, each target's
    sequence (0..S-1) and its row again, where the loss finds its packed layout without a wait."""

    flat: torch.Tensor
    row_index: torch.Tensor
    sequences: int
    on_host: tuple[torch.Tensor, torch.Tensor]  # (segment_ids, row_index)


def targets(lengths: Lengths, rows: torch.Tensor, starts: torch.Tensor, width: int, device) -> Targets:
    """The targets of `rows` (host indices into the micro-batch), the real completion tokens of each, whose packed
    tokens start at `starts` (host) in the hidden states; `width` the completion width of the loss rows' tensors."""
    prompt, completion = lengths.prompt[rows], lengths.completion[rows]
    sequence = torch.repeat_interleave(torch.arange(len(rows)), completion)
    j = torch.arange(int(completion.sum())) - (torch.cumsum(completion, 0) - completion)[sequence]
    predicting = starts[sequence] + prompt[sequence] + j - 1
    index = to_device(torch.stack([sequence * width + j, predicting]), device)
    return Targets(index[0], index[1], len(rows), (sequence, predicting))


def per_target(inputs: dict, mask: torch.Tensor, t: Targets) -> dict:
    """The loss rows' inputs as its packed call takes them: per-token ones [M], per-sequence ones [S]."""
    take = lambda x: x.reshape(-1).index_select(0, t.flat)  # noqa: E731
    out = {
        "completion_ids": take(inputs["completion_ids"]),
        "completion_mask": take(mask),
        **{k: take(inputs[k]) for k in PER_TOKEN if isinstance(inputs.get(k), torch.Tensor)},
    }
    for key in PER_TOKEN_OR_SEQUENCE:
        value = inputs.get(key)
        if isinstance(value, torch.Tensor):
            per_token = value.dim() == 2 and value.shape[1] == mask.shape[1] and mask.shape[1] > 1
            out[key] = take(value) if per_token else value.reshape(-1)
    segment_ids, row_index = t.on_host  # the loss lays the targets out on the host: no wait on the GPU
    return {**out, "segment_ids": segment_ids, "num_sequences": t.sequences, "row_index": row_index}
