"""The lm_head under engines that shard parameters: its weight read where the engine has gathered it.

DeepSpeed ZeRO-3 keeps every parameter partitioned (shape (0,) on each rank) and gathers a module's parameters
only while that module's forward runs, and again in the backward of what that forward made; FSDP2 with the lm_head
in a unit of its own does the same with DTensor shards. A fused loss that reads `lm_head.weight` after the model's
forward sees an empty or sharded tensor. So the loss runs as the forward of the lm_head's own call
(`within_head`): the engine's hooks gather the weight before it, re-gather it for the backward (which recomputes
logits), and hand the weight's gradient to the engine's own reduction (ZeRO's partitioned reduce, FSDP's
reduce-scatter), the same way they serve the model's own call of its lm_head. Without an engine the call is the
plain function call: one module call's hooks, nothing else.

`within_head` costs one gather of the lm_head per forward and per backward under ZeRO-3 (the model's own call of
its lm_head, for one position, costs another); DeepSpeed's `GatheredParameters`, the other way, would gather as
often and needs the backward's gather made by hand.
"""

from __future__ import annotations

import dataclasses

import torch

from ...loss import GRPOLossOutput


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's shape as the model defines it, also while ZeRO-3 holds it partitioned (`ds_shape`)."""
    return getattr(param, "ds_shape", param.shape)


def within_head(lm_head: torch.nn.Module, compute, *args):
    """`compute(weight, bias, *args)` run as the forward of a call of `lm_head`, so that an engine that shards it
    gathers its weight for the call and for the backward of what the call returns. `compute` returns a tuple
    whose tensors the engine's backward hooks can find (tensors, tuples, lists, dicts of them, strings, None)."""
    had_own = "forward" in lm_head.__dict__
    own = lm_head.__dict__.get("forward")
    lm_head.forward = lambda *inner: compute(lm_head.weight, lm_head.bias, *inner)
    try:
        return lm_head(*args)
    finally:
        if had_own:
            lm_head.forward = own
        else:
            del lm_head.forward


def shape_only(param: torch.Tensor) -> torch.Tensor:
    """A stand-in of the parameter's full shape and dtype on the meta device, for sizing workspaces while an
    engine holds it partitioned."""
    return torch.empty(full_shape(param), dtype=param.dtype, device="meta")


def trainer_shards_parameters(trainer) -> bool:
    """Whether a transformers Trainer runs under an engine that shards parameters between calls: DeepSpeed ZeRO-3
    or FSDP (its parameters live as shards outside their units' forwards)."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    zero3 = getattr(trainer, "is_deepspeed_enabled", False) and plugin is not None and plugin.zero_stage == 3
    return bool(zero3 or getattr(trainer, "is_fsdp_enabled", False))


def loss_within_head(lm_head: torch.nn.Module, compute, hidden: torch.Tensor) -> GRPOLossOutput:
    """`compute(weight, bias, hidden)`, a fused loss's `GRPOLossOutput`, run by `within_head` (its fields travel as a
    tuple, whose loss tensor the engines' backward hooks find)."""

    def as_fields(weight, bias, hidden):
        out = compute(weight, bias, hidden)
        return tuple(getattr(out, f.name) for f in dataclasses.fields(out))

    if not gathered_by_its_hooks(lm_head):  # no engine, or one that holds the lm_head in its model's unit
        return compute(lm_head.weight, lm_head.bias, hidden)
    return GRPOLossOutput(*within_head(lm_head, as_fields, hidden))


def gathered_by_its_hooks(lm_head: torch.nn.Module) -> bool:
    """Whether an engine gathers this lm_head's weight in hooks of the lm_head's own calls: a ZeRO-3 parameter, or
    an FSDP2 unit of its own. (An lm_head inside FSDP2's root unit is gathered by the root's hooks, around the
    model's call; read after it, its weight is the DTensor the loss gathers.)"""
    if hasattr(lm_head.weight, "ds_id"):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(lm_head, FSDPModule)
