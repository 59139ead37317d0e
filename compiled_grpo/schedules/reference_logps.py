"""The reference model's per-token log-probs streamed from its head (beta != 0 without `ref_per_token_logps`)."""

from __future__ import annotations

import dataclasses

import torch

from .. import streaming, tiling
from ..head import make_head
from .passes import Engine, gather_slots, statistics_pass


def with_reference_logps(engine: Engine, inputs, cfg, rounded: bool = False):
    """The inputs with ref_per_token_logps streamed from the reference head (ref_hidden, ref_weight, ref_bias,
    each defaulting to the policy's), without gradient; `rounded`: `Head.rounded`."""
    hidden = inputs.hidden if inputs.ref_hidden is None else inputs.ref_hidden
    weight, bias = (inputs.weight, inputs.bias) if inputs.ref_weight is None else (inputs.ref_weight, inputs.ref_bias)
    mask = inputs.completion_mask
    plan = tiling.plan_mask(mask, engine.tiles.token_tile, engine.tiles.tail_tile)
    with torch.no_grad():
        slots = gather_slots(hidden.detach(), inputs.completion_ids, plan, engine.shard.start, inputs.hidden_rows)
        head = make_head(weight, bias, cfg, streaming.stat_dtype(slots.x), rounded, inputs.split_ref_head)
        logp, _, _ = statistics_pass(engine, slots.x, slots.targets, head.detached(), plan.tiles)
        ref = tiling.from_slots(logp, plan, mask.numel()).view(mask.shape)
    return dataclasses.replace(inputs, ref_per_token_logps=ref)
