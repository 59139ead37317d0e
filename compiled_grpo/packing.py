"""Packed batches: each sequence's targets laid out as the padded call's row, without copying hidden states.

A packed call gives M targets (one per trained token) with the sequence of each (`segment_ids`, a sequence's
targets in order) and the hidden row that predicts each (`row_index`, default: target m is predicted by row m,
the padding-free layout; in TRL's tree-packed rows one position can predict the first token of several
samples). The loss is that of the padded call with sequence s's targets left-aligned in row s of an [S, T]
batch (T the longest sequence): every [M] input is laid out so, [S] inputs stay per sequence, and the hidden
states stay packed: the padded positions only point at their rows (`Packing.rows`), which the lm_head tiles
gather from directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import validation


@dataclass(frozen=True)
class Packing:
    sequences: int  # S
    length: int  # T, the longest sequence (at least 2)
    position: torch.Tensor  # [M] flat position s * T + t of each target in the padded layout
    rows: torch.Tensor  # [S * T] hidden row of each padded position (row 0 where no target is)
    # every sequence has T targets, in sequence order, each predicted by its own row: the packed rows are the
    # padded batch's rows as they are, and hidden [S * T, H] is used as a [S, T, H] view (no gather)
    identity: bool = False

    @classmethod
    def of(cls, segment_ids: torch.Tensor, num_sequences: int | None, row_index: torch.Tensor | None,
           device=None) -> Packing:  # fmt: skip
        """The layout of M targets, its tensors on `device` (default: segment_ids'). Found where segment_ids are:
        on the GPU, two waits (the number of sequences and the longest); given on the host, none (the layout is
        made there and copied over from pinned memory)."""
        device = segment_ids.device if device is None else torch.device(device)
        segment_ids = segment_ids.long()
        m = segment_ids.numel()
        sequences = int(segment_ids.max()) + 1 if num_sequences is None and m else int(num_sequences or 0)
        counts = torch.bincount(segment_ids, minlength=sequences)
        in_order = (segment_ids[1:] >= segment_ids[:-1]).all()
        length, shortest, in_order = torch.stack([counts.max(), counts.min(), in_order]).tolist() if m else (0, 0, 1)
        order = torch.sort(segment_ids, stable=True).indices  # targets grouped by sequence, in their order
        starts = torch.cumsum(counts, 0) - counts
        # At least two positions: a one-position batch is where per-sequence metrics would read as per-token ones
        # (docs/semantics.md, the last paragraph), and a packing's longest sequence is no property of the batch.
        length = max(length, 2)
        rank = torch.empty_like(segment_ids)
        rank[order] = torch.arange(m, device=segment_ids.device) - starts[segment_ids[order]]
        position = to_device(segment_ids * length + rank, device)
        rows = torch.zeros(sequences * length, dtype=torch.long, device=device)
        source = torch.arange(m, device=device) if row_index is None else to_device(row_index.long(), device)
        rows[position] = source
        identity = row_index is None and bool(in_order) and shortest == length and sequences * length == m
        return cls(sequences, length, position, rows, identity)

    def unpack(self, values: torch.Tensor, fill=0) -> torch.Tensor:
        """[M] per target -> [S, T] (`fill` where no target is)."""
        out = torch.full((self.sequences * self.length,), fill, dtype=values.dtype, device=values.device)
        return out.index_put((self.position,), values).view(self.sequences, self.length)

    def pack(self, padded: torch.Tensor | None) -> torch.Tensor | None:
        """[S, T] -> [M] per target."""
        return None if padded is None else padded.reshape(-1).index_select(0, self.position)


def lay_out(inputs, packed: tuple, validate: bool):
    """(inputs in the padded layout, their Packing or None) of a call; `packed` = (segment_ids, num_sequences,
    row_index), all None for a padded call. Checks a packed call's shapes, and its values when `validate` (a wait
    on the GPU for segment_ids or row_index there; none for those given on the host)."""
    segment_ids, num_sequences, row_index = packed
    if segment_ids is None:
        if num_sequences is not None or row_index is not None:
            raise ValueError("num_sequences and row_index belong to a packed call: pass segment_ids too")
        return inputs, None
    validation.check_packed(inputs, segment_ids, row_index, num_sequences)
    if validate:
        sequences = int(segment_ids.max()) + 1 if num_sequences is None and segment_ids.numel() else num_sequences
        validation.check_packed_values(segment_ids, row_index, inputs.hidden.shape[0], sequences or 0)
    packing = Packing.of(segment_ids, num_sequences, row_index, inputs.hidden.device)
    validation.check_per_sequence(inputs, packing)
    return inputs.unpacked(packing), packing


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device` without a wait: a host tensor copied to a GPU from pinned memory (a copy from pageable
    memory first waits for every kernel queued before it)."""
    device = torch.device(device)
    if tensor.device == device or tensor.device.type != "cpu" or device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
