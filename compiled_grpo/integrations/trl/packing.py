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
# Fixed shapes (`Shapes.fixed`): a packed row's capacities, `CAPACITIES_PER_OCTAVE` between consecutive powers of two
# (each at most a quarter above the one before), and its segment boundaries padded to a power of two of at least
# `MIN_SEGMENT_SLOTS` entries.
CAPACITIES_PER_OCTAVE, MIN_SEGMENT_SLOTS = 4, 16
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


class Shapes(NamedTuple):
    """How a packed row is padded: to a multiple of `bucket` tokens (its segments and their longest as they are);
    or, `fixed`, to one of a few capacities (`capacity`), its segment boundaries to a power of two of entries (the
    extra segments empty) and its longest lengths to the capacities, so that every shape and integer a compiled
    layer sees comes from a small set (what CUDA graphs replayed per shape need)."""

    bucket: int
    fixed: bool = False


def capacity(tokens: int, bucket: int) -> int:
    """The smallest capacity of at least `tokens`: multiples of `bucket` up to `CAPACITIES_PER_OCTAVE` of them, then
    `CAPACITIES_PER_OCTAVE` per doubling (a step that doubles with each octave: at most 25% of padding)."""
    top = CAPACITIES_PER_OCTAVE * bucket
    step = bucket if tokens <= top else bucket << ((tokens - 1) // top).bit_length() - 1  # x2 per octave above top
    return max(-(-tokens // step), 1) * step


def segment_slots(segments: int) -> int:
    """The entries of a fixed row's segment boundaries: a power of two, at least `MIN_SEGMENT_SLOTS` (+ 1)."""
    return max(MIN_SEGMENT_SLOTS, 1 << max(segments - 1, 0).bit_length()) + 1


def can_pack(lengths: Lengths) -> bool:
    """Whether the rows' real tokens are one span each, every sequence with at least one prompt token (the position
    that predicts its first completion token)."""
    return lengths.contiguous and bool((lengths.prompt > 0).all())


class SharedKeys(NamedTuple):
    """Where a packed row's segments attend when some share a prompt (`pack` with groups): each segment's keys, the
    prompt it shares (if any) then its own tokens, as packed positions segment after segment ([keys], host) with
    their boundaries ([segments + 1], int32) and the longest; and each packed position's group and segment ([N],
    host; a shared prompt's positions are in segment -1), from which a dense mask is built."""

    index: torch.Tensor
    cu_seqlens: torch.Tensor
    longest: int
    group: torch.Tensor
    segment: torch.Tensor


class PackedRows(NamedTuple):
    """Rows of a micro-batch as one row of the model: its input_ids and position_ids [1, N] (N a multiple of the
    bucket) and, on the host, where each row's tokens start in it (the packed index of its prompt's first token, or
    where it would be: a completion's tokens and its prompt's last token are at `starts + column of the row's real
    tokens`), where each segment of the row starts (a sequence, a shared prompt, a member of a group, the bucket's
    dummy sequence: [segments + 1], int32, ending at N), the longest segment's length, and the keys of segments that
    share a prompt (None: each segment attends to itself alone)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    starts: torch.Tensor
    cu_seqlens: torch.Tensor
    longest: int
    keys: SharedKeys | None = None


def segments(lengths: Lengths, rows: torch.Tensor, groups: torch.Tensor | None) -> list[tuple[int, int, int, int, int]]:
    """The packed row's segments in order, each (row, first column, tokens, first position, the index of the shared
    prompt it also attends to or -1). Rows of a group (`groups[row]`: the first row with the same prompt) of two or
    more with a prompt of two or more tokens share it: the prompt but its last token once, then each row's last
    prompt token and completion, positions continuing from the prompt's (so each completion's first token has a
    position of its own that predicts it); other rows are one segment each, positions from 0."""
    P, _ = widths(lengths)
    prompt, completion = lengths.prompt.tolist(), lengths.completion.tolist()
    members: dict[int, list[int]] = {}
    for i, row in enumerate(rows.tolist()):  # without groups, a row given twice is packed twice, apart
        members.setdefault(i if groups is None else int(groups[row]), []).append(row)
    out = []
    for group in members.values():
        p = prompt[group[0]]
        if len(group) == 1 or p < 2:
            out += [(row, P - prompt[row], prompt[row] + completion[row], 0, -1) for row in group]
            continue
        shared = len(out)
        out.append((group[0], P - p, p - 1, 0, -1))
        out += [(row, P - 1, 1 + completion[row], p - 1, shared) for row in group]
    return out


def pack(ids: torch.Tensor, lengths: Lengths, rows: torch.Tensor, shapes, groups=None) -> PackedRows:
    """`rows` (host indices) of the micro-batch's [B, P + C] prompt-and-completion ids, packed (`PackedRows`); where
    `groups` (host [B], each row's first row with the same prompt) is given, rows of a group share their prompt
    (`segments`). The row is padded by a sequence of its own (positions from 0), which nothing reads, as `shapes`
    (`Shapes`, or an int: the bucket) says."""
    shapes = shapes if isinstance(shapes, Shapes) else Shapes(shapes)
    P, _ = widths(lengths)
    parts = segments(lengths, rows, groups)
    total = sum(part[2] for part in parts)
    if shapes.fixed:
        pad = capacity(total + 1, shapes.bucket) - total  # never 0: the dummy sequence takes the keys' padding too
    else:
        pad = -total % shapes.bucket if total else shapes.bucket
    if pad:
        parts.append((int(rows[0]) if len(rows) else 0, P - 1, pad, 0, -1))
    table = torch.tensor(parts, dtype=torch.long).reshape(-1, 5)
    size = table[:, 2]
    offset = torch.cumsum(size, 0) - size
    which = torch.repeat_interleave(torch.arange(len(table)), size)
    within = torch.arange(int(size.sum())) - offset[which]
    flat = table[which, 0] * ids.shape[1] + table[which, 1] + within
    positions = table[which, 3] + within
    if pad:
        flat[len(flat) - pad :] = table[-1, 0] * ids.shape[1] + P - 1  # the dummy sequence repeats one token
    index = to_device(torch.stack([flat, positions]), ids.device)
    packed_ids = ids.reshape(-1).index_select(0, index[0]).unsqueeze(0)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(size, 0)]).to(torch.int32)
    shares = table[:, 4] >= 0  # member segments (of a group sharing the prompt segment they name)
    shared_prompt = torch.zeros(len(table), dtype=torch.bool)
    shared_prompt[table[shares, 4]] = True
    real = len(table) - (1 if pad else 0)  # the segments but the dummy sequence
    starts = row_starts(table[:real], offset, rows, shared_prompt[:real])
    keys = shared_keys(table, offset, which, shapes, shared_prompt) if bool(shares.any()) else None
    longest = int(size.max()) if len(size) else 0
    if shapes.fixed:  # the boundaries' count and the longest lengths from a small set too
        cu_seqlens = fixed_boundaries(cu_seqlens)
        longest = int(cu_seqlens[-1])
    return PackedRows(packed_ids, index[1].unsqueeze(0), starts, cu_seqlens, longest, keys)


def fixed_boundaries(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Segment boundaries padded with empty segments to `segment_slots` entries."""
    slots = segment_slots(len(cu_seqlens) - 1)
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(slots - len(cu_seqlens))])


def row_starts(table: torch.Tensor, offset: torch.Tensor, rows: torch.Tensor, shared_prompt) -> torch.Tensor:
    """Where each of `rows` starts (`PackedRows.starts`): its own segment's offset less the positions before it (a
    row's own segment: its member segment where it shares a prompt, its only one elsewhere)."""
    starts = torch.zeros(len(rows), dtype=torch.long)
    slot = {row: i for i, row in enumerate(rows.tolist())}
    for i in torch.nonzero(~shared_prompt).flatten().tolist():
        starts[slot[int(table[i, 0])]] = offset[i] - table[i, 3]
    return starts


def shared_keys(table: torch.Tensor, offset: torch.Tensor, which: torch.Tensor, shapes: Shapes,
                shared_prompt: torch.Tensor) -> SharedKeys:  # fmt: skip
    """The keys of segments that share a prompt (`SharedKeys`), from the segment table and which of its segments are
    shared prompts; with fixed shapes, the last segment (the dummy sequence) takes keys up to a capacity (it attends
    to more, which nothing reads)."""
    runs = []
    for i, (_, _, size, _, shared) in enumerate(table.tolist()):
        mine = torch.arange(int(offset[i]), int(offset[i]) + size)
        theirs = torch.arange(int(offset[shared]), int(offset[shared] + table[shared, 2])) if shared >= 0 else mine[:0]
        runs.append(torch.cat([theirs, mine]))
    if shapes.fixed:
        extra = capacity(sum(map(len, runs)), shapes.bucket) - sum(map(len, runs))
        runs[-1] = torch.cat([runs[-1], runs[-1][-1:].expand(extra)])
    sizes = torch.tensor([len(run) for run in runs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(sizes, 0)]).to(torch.int32)
    longest = int(sizes.max())
    if shapes.fixed:
        cu = fixed_boundaries(cu)
        longest = int(cu[-1])
    group = torch.where(table[:, 4] >= 0, table[:, 4], torch.arange(len(table)))
    segment = torch.where(shared_prompt, -1, torch.arange(len(table)))
    return SharedKeys(torch.cat(runs), cu, longest, group[which], segment[which])


def saved_tokens(lengths: Lengths, rows: torch.Tensor, groups: torch.Tensor | None) -> int:
    """The prompt tokens `rows` packed with `groups` do not forward again (k rows of a p-token prompt forward
    p - 1 + k of its k p tokens)."""
    alone = int(lengths.prompt[rows].sum() + lengths.completion[rows].sum())
    return alone - sum(part[2] for part in segments(lengths, rows, groups))


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
