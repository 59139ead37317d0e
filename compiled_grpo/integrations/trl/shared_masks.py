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


def masks(attention: str, packed, config):
    """The masks of the segments' rule (`visible`), as implementation `attention` takes them (`one_mask`), in the
    form the model takes them ready-made (`as_model_takes`)."""
    return as_model_takes(config, lambda window: one_mask(attention, packed, window))


def as_model_takes(config, make):
    """A ready-made mask for a model of `config`, `make(sliding window or None)` making one: {layer type: mask} where
    the model has layer types (its forward takes such a mapping), else one 4D mask (which transformers passes on as
    it is), of the model's sliding window where it has one."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    kinds = getattr(text, "layer_types", None)
    if not kinds:
        return make(window if getattr(text, "use_sliding_window", None) is not False else None)
    by_window = {}  # a [N, N] mask built once per window, whatever the number of layer types that take it
    mapping = {}
    for kind in set(kinds) | {"full_attention", "sliding_attention"}:  # a type no layer has gets the full one
        size = window if kind == "sliding_attention" and kind in kinds else None
        if size not in by_window:
            by_window[size] = make(size)
        mapping[kind] = by_window[size]
    return mapping


def one_mask(attention: str, packed, window: int | None):
    seen = visible(packed, window)
    if attention == "sdpa":
        return seen[None, None]
    if attention == "eager":
        additive = torch.zeros(seen.shape, device=seen.device)
        return additive.masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, k: seen[q, k], None, None, *seen.shape, device=seen.device)
