"""The primitive's input checks: types, shapes, dtypes and devices (free, always made) and values (device
flags, read where the host waits anyway): a ValueError or TypeError naming the argument."""

from __future__ import annotations

import math
import numbers

import torch

from . import checks, distributed
from .faults import Faults


def check_inputs(hidden, weight, targets, bias, temperature) -> None:
    """Types, shapes, dtypes and devices: free checks, always made."""
    for name, x in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if hidden.dtype not in checks.FLOATS or hidden.dim() < 1:
        raise TypeError(f"hidden: expected a floating [..., H] tensor, got {hidden.dtype} {tuple(hidden.shape)}")
    H = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(f"weight: expected [V, {H}] (H of hidden), got shape {tuple(weight.shape)}")
    if (why := checks.weight_dtype_fault(hidden, weight)) is not None:
        raise TypeError(f"weight: {why}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets: expected {tuple(hidden.shape[:-1])} (hidden's leading shape), got "
                         f"{tuple(targets.shape)}")  # fmt: skip
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets: expected an integer dtype, got {targets.dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)):
        raise ValueError(f"bias: expected [{weight.shape[0]}], got {getattr(bias, 'shape', type(bias))}")
    named = {"weight": weight, "targets": targets, "bias": bias}
    if isinstance(temperature, torch.Tensor):
        named["temperature"] = temperature
        check_temperature_shape(temperature, targets)
    elif not isinstance(temperature, (int, float)) or not temperature > 0 or temperature == float("inf"):
        raise ValueError(f"temperature: expected a positive finite number or a tensor, got {temperature!r}")
    for name, x in named.items():
        if x is not None and x.device != hidden.device:
            raise TypeError(f"{name}: is on {x.device}, hidden on {hidden.device}: every input must be on one device")


def check_options(o) -> None:
    """The call's options, checked as the loss checks its own (same messages): flags are bools, ignore_index an int,
    logit_scale finite and > 0, final_logit_softcapping None or finite and > 0, vocab_start an int."""
    checks.check_flags(compiled=o.compiled, validate=o.validate, capture=o.capture, round_logits=o.round_logits)
    for name in ("ignore_index", "vocab_start"):
        value = getattr(o, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: expected an int, got {value!r}")
    scale, cap = o.logit_scale, o.final_logit_softcapping
    if not finite_number(scale) or scale <= 0:
        raise ValueError(f"logit_scale must be > 0 and finite, got {scale!r}")
    if cap is not None and (not finite_number(cap) or cap <= 0):
        raise ValueError(f"final_logit_softcapping must be > 0 or None, got {cap!r}")


def finite_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def check_temperature_shape(temperature: torch.Tensor, targets: torch.Tensor) -> None:
    """A temperature tensor is 0-d or has targets' number of dimensions ([B, 1] per sequence, [B, T] per token,
    [N] per packed target): a [B] tensor against [B, T] targets would broadcast along T, per position, silently."""
    shape, want = tuple(temperature.shape), tuple(targets.shape)
    if temperature.dim() not in (0, targets.dim()):
        raise ValueError(f"temperature: expected a scalar or a tensor with targets' {targets.dim()} dimensions (per "
                         f"sequence [B, 1], per token {list(want)}), got shape {shape}; for one temperature per "
                         f"sequence pass temperature[:, None]")  # fmt: skip
    try:
        torch.broadcast_shapes(shape, want)
    except RuntimeError:
        raise ValueError(f"temperature: shape {shape} does not broadcast to targets' {want}") from None


def value_checks(flat_targets, valid, weight, group, temperature) -> Faults:
    """Targets in the (whole) vocabulary or ignored, temperatures positive and finite: device flags, their
    read-back started (`faults.Faults`)."""
    vocab = weight.shape[0]
    if group is not distributed.LOCAL:
        vocab = int(distributed.all_sum(torch.tensor(vocab, device=weight.device), group))
    found = Faults()
    bad = valid & ((flat_targets < 0) | (flat_targets >= vocab))
    first_bad = checks.first_where(flat_targets, bad)
    found.add(bad.any(), lambda id_: ValueError(f"targets: id {id_} is outside [0, {vocab}) and is not ignore_index"),
              first_bad)  # fmt: skip
    if isinstance(temperature, torch.Tensor):
        found.add(~(torch.isfinite(temperature) & (temperature > 0)).all(),
                  lambda _: ValueError("temperature: every value must be positive and finite"))  # fmt: skip
    return found.issue()
