"""The packed entry of the reference: lay the targets out in a padded [S, T] batch with plain loops, then the
padded reference. Written independently of compiled_grpo's layout code."""

from __future__ import annotations

import torch

from .loss import ReferenceOutput, grpo_loss

PER_TARGET = ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps")


def grpo_loss_packed(
    hidden,
    weight,
    completion_ids,
    completion_mask,
    advantages,
    segment_ids,
    *,
    num_sequences=None,
    row_index=None,
    importance_sampling_ratio=None,
    **rest,
) -> ReferenceOutput:
    """`grpo_loss` of M packed targets: hidden [rows, H]; completion_ids, completion_mask, segment_ids (each
    target's sequence, a sequence's targets in order), the per-token inputs, and row_index (the hidden row that
    predicts each target, default the target's own index) all [M]; advantages and importance_sampling_ratio
    [M] or [S]. Equal to the padded call with each sequence's targets left-aligned in its own row (at least two
    positions wide); outputs per target."""
    seg = [int(s) for s in segment_ids.tolist()]
    M = len(seg)
    S = num_sequences if num_sequences is not None else (max(seg) + 1 if seg else 0)
    rows_of = list(range(M)) if row_index is None else [int(r) for r in row_index.tolist()]
    members = [[m for m in range(M) if seg[m] == s] for s in range(S)]
    # at least two positions: with one, per-sequence metrics would be read as per-token ones
    T = max(max((len(ms) for ms in members), default=0), 2)
    where = {m: (s, t) for s, ms in enumerate(members) for t, m in enumerate(ms)}

    def lay_out(values, fill):
        if values is None or values.shape[0] != M:
            return values  # per sequence, or absent
        out = torch.full((S, T), fill, dtype=values.dtype, device=values.device)
        for m, (s, t) in where.items():
            out[s, t] = values[m]
        return out

    picks = [[rows_of[ms[t]] if t < len(ms) else 0 for t in range(T)] for ms in members]
    index = torch.tensor(picks, dtype=torch.long, device=hidden.device).view(S, T)
    padded_hidden = hidden[index]  # [S, T, H], differentiable back to the packed rows
    if rest.get("ref_hidden") is not None:
        rest["ref_hidden"] = rest["ref_hidden"][index]
    for name in PER_TARGET:
        rest[name] = lay_out(rest.get(name), 0.0)
    if rest.get("entropy_mask_override") is not None:
        rest["entropy_mask_override"] = lay_out(rest["entropy_mask_override"], False)
    out = grpo_loss(
        padded_hidden,
        weight,
        lay_out(completion_ids, 0),
        lay_out(completion_mask, 0),
        lay_out(advantages, 0.0),
        importance_sampling_ratio=lay_out(importance_sampling_ratio, 1.0),
        **rest,
    )

    def per_target(padded):
        if padded is None:
            return None
        return torch.stack([padded[where[m]] for m in range(M)]) if M else padded.new_zeros(0)

    return ReferenceOutput(
        out.loss, out.metrics, per_target(out.per_token_logps), per_target(out.entropy), per_target(out.entropy_mask)
    )
