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

An lm_head inside a larger FSDP2 unit (accelerate's TRANSFORMER_BASED_WRAP leaves it in the root unit with the
embeddings and the final norm) has no hooks of its own: the unit's are around the model's call, whose output (the
last position's logits) the loss does not use. Read after the model's call, its weight is a resharded DTensor
(gathered outside FSDP's reduce-scatter: each rank's gradient shard its own batch's alone), and as the backward
never passes the unit's output, FSDP never re-gathers the unit for it: the final norm's backward reads parameters
whose memory was freed (an illegal memory access on a GPU). So the loss runs as the forward of a call of that unit
(`within_unit`), taking the hidden states by closure: the unit's hooks gather it for the loss, register the re-gather
on the loss for the backward (before the final norm's), and its gradients are reduce-scattered once the whole
backward is done (not when the hidden states' gradient is: none is hooked on them).
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
    closure: FSDP hooks no gradient of it), so that the unit's parameters are gathered for it and re-gathered for
    the backward of what it returns."""
    had_own = "forward" in unit.__dict__
    own = unit.__dict__.get("forward")
    unit.forward = lambda: compute()
    try:
        return unit()
    finally:
        if had_own:
            unit.forward = own
        else:
            del unit.forward


def loss_within_head(lm_head: torch.nn.Module, compute, hidden: torch.Tensor, model=None) -> GRPOLossOutput:
    """`compute(weight, bias, hidden)`, a fused loss's `GRPOLossOutput`, run by `within_head`, or by `within_unit`
    where an FSDP2 unit of `model` above the lm_head holds it (its fields travel as a tuple, whose loss tensor the
    engines' backward hooks find)."""

    def as_fields(weight, bias, hidden):
        out = compute(weight, bias, hidden)
        return tuple(getattr(out, f.name) for f in dataclasses.fields(out))

    if gathered_by_its_hooks(lm_head):
        return GRPOLossOutput(*within_head(lm_head, as_fields, hidden))
    unit = fsdp_unit_holding(model, lm_head) if model is not None else None
    if unit is not None:
        return GRPOLossOutput(*within_unit(unit, lambda: as_fields(lm_head.weight, lm_head.bias, hidden)))
    return compute(lm_head.weight, lm_head.bias, hidden)  # no engine, or one that keeps it whole


def fsdp_unit_holding(model: torch.nn.Module, lm_head: torch.nn.Module) -> torch.nn.Module | None:
    """The innermost FSDP2 unit of `model` whose subtree holds `lm_head` (None: no FSDP2 unit holds it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    if not isinstance(model, FSDPModule) and not any(isinstance(m, FSDPModule) for m in model.modules()):
        return None
    names = {id(m): name for name, m in model.named_modules()}
    head = names.get(id(lm_head))
    if head is None:
        return None
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    holding = [(name, m) for name, m in units if name == "" or head == name or head.startswith(name + ".")]
    return max(holding, key=lambda pair: len(pair[0]), default=(None, None))[1]


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
