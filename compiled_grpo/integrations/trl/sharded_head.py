"""The lm_head under engines that shard parameters: its weight read where the engine has gathered it.

DeepSpeed ZeRO-3 keeps every parameter partitioned (shape (0,) on each rank) and gathers a module's parameters
only while that module's forward runs, and again in the backward of what that forward made; FSDP2 does the same
with DTensor shards, unit by unit. A fused loss that reads `lm_head.weight` after the model's forward sees an empty
or sharded tensor. So the loss runs as the forward of a call of the module whose hooks gather the lm_head: the
engine's hooks gather the weight before it, re-gather it for the backward (which recomputes logits), and hand the
weight's gradient to the engine's own reduction (ZeRO's partitioned reduce, FSDP's reduce-scatter), the same way
they serve the model's own call of its lm_head. Without an engine the call is the plain function call.

- ZeRO-3 (`within_head`): a call of the lm_head with the hidden states as its argument. One gather of the lm_head
  per forward and per backward (the model's own call of its lm_head, for one position, costs another);
  DeepSpeed's `GatheredParameters`, the other way, would gather as often and needs the backward's gather by hand.
- FSDP2 (`within_unit`): a call without arguments (the hidden states taken by closure) of the lm_head where it is
  a unit (accelerate's TRANSFORMER_BASED_WRAP puts it in one with the final norm, `reshard_after_forward=False`),
  else of the model, the root unit that holds it. Without arguments, because FSDP2 reshards a unit once the
  gradient of its call's inputs is made: after the loss's backward, before the final norm's, whose parameters
  (in the lm_head's unit or the root's) would then be read freed (an illegal memory access on a GPU). The unit's
  gradients are reduce-scattered, and it is resharded, once the whole backward is done. And the root, because the
  model's own call of it returns the last position's logits, which the loss does not use: its hooks would never
  re-gather it for the backward.
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


def within_unit(unit: torch.nn.Module, compute):
    """`compute()` run as the forward of a call of FSDP2 unit `unit` without arguments (what it reads, it takes by
    closure), so that the unit's parameters are gathered for it and re-gathered for the backward of what it
    returns, and reduce-scattered once the whole backward is done."""
    had_own = "forward" in unit.__dict__
    own = unit.__dict__.get("forward")
    unit.forward = lambda **_: compute()
    try:
        # one keyword that is no tensor: FSDP2's root hook (torch 2.11) indexes the call's arguments, so a call with
        # none at all fails there
        return unit(within_unit=True)
    finally:
        if had_own:
            unit.forward = own
        else:
            del unit.forward


def loss_within_head(lm_head: torch.nn.Module, compute, hidden: torch.Tensor, model=None) -> GRPOLossOutput:
    """`compute(weight, bias, hidden)`, a fused loss's `GRPOLossOutput`, run where the engine gathers the lm_head:
    `within_head` under ZeRO-3, `within_unit` under FSDP2 (the lm_head's unit, or `model`'s where it holds it); its
    fields travel as a tuple, whose loss tensor the engines' backward hooks find."""

    def as_fields(weight, bias, hidden):
        out = compute(weight, bias, hidden)
        return tuple(getattr(out, f.name) for f in dataclasses.fields(out))

    if hasattr(lm_head.weight, "ds_id"):
        return GRPOLossOutput(*within_head(lm_head, as_fields, hidden))
    unit = fsdp_unit_of(lm_head, model)
    if unit is not None:
        return GRPOLossOutput(*within_unit(unit, lambda: as_fields(lm_head.weight, lm_head.bias, hidden)))
    return compute(lm_head.weight, lm_head.bias, hidden)  # no engine, or one that keeps it whole


def fsdp_unit_of(lm_head: torch.nn.Module, model: torch.nn.Module | None) -> torch.nn.Module | None:
    """The FSDP2 unit whose call gathers the lm_head: itself where it is one, else the model where the model is one
    (the root unit, which holds whatever no inner unit does); None without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    if isinstance(lm_head, FSDPModule):
        return lm_head
    return model if isinstance(model, FSDPModule) else None
