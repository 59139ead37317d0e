"""The masks of a packed row whose segments share prompts (`packing.SharedKeys`), for the attention implementations
that take a mask: each position attends to the earlier positions of its own segment and of its group's shared
prompt, never to a sibling's."""

from __future__ import annotations

import torch

MASKED = ("sdpa", "eager", "flex_attention")  # implementations a mask of the segments' rule is passed to


def visible(packed, window: int | None = None) -> torch.Tensor:
    """[N, N] bool on the device: which keys each packed position attends to (the segments' rule, by positions)."""
    keys, device = packed.keys, packed.input_ids.device
    group, segment = (vector.to(device, non_blocking=True) for vector in (keys.group, keys.segment))
    position = packed.position_ids[0]
    seen = (group[:, None] == group[None, :]) & ((segment[None, :] == -1) | (segment[:, None] == segment[None, :]))
    seen &= position[None, :] <= position[:, None]
    if window:
        seen &= position[:, None] - position[None, :] < window
    return seen


def masks(attention: str, packed, config) -> dict:
    """{layer type: mask} of the segments' rule (`visible`), as implementation `attention` takes it: a bool mask
    (SDPA), an additive one (eager), a BlockMask (FlexAttention)."""
    text = config.get_text_config()
    types = set(getattr(text, "layer_types", None) or ()) | {"full_attention", "sliding_attention"}
    window = getattr(text, "sliding_window", None)
    return {kind: one_mask(attention, packed, window if kind == "sliding_attention" else None) for kind in types}


def one_mask(attention: str, packed, window: int | None):
    seen = visible(packed, window)
    if attention == "sdpa":
        return seen[None, None]
    if attention == "eager":
        additive = torch.zeros(seen.shape, device=seen.device)
        return additive.masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, k: seen[q, k], None, None, *seen.shape, device=seen.device)
