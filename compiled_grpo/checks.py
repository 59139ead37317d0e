"""Checks any call makes, the loss's and the primitive's alike: unknown keywords named with the closest valid
one, finite statistics after the statistics pass (the error naming hidden, weight or bias, or the logits'
overflow), and device flags computed as one CUDA graph replay where calls are captured.
"""

from __future__ import annotations

import difflib
import weakref

import torch

from . import products
from .faults import Faults

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_flags(**flags) -> None:
    """Options that are switches: True or False, never a truthy string or number."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected True or False, got {value!r}")


def weight_dtype_fault(hidden: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the lm_head weight's dtype does not go with the hidden states': it must be theirs, or float32 against
    16-bit ones (an fp32 head); None where it does."""
    if weight.dtype == hidden.dtype or products.fp32_head(hidden, weight):
        return None
    return (f"dtype {weight.dtype} differs from hidden's {hidden.dtype} (the weight takes hidden's dtype, or float32 "
            "against 16-bit hidden states)")  # fmt: skip


def statistics_faults(active, logp, entropy, hidden, weight, bias, *, rows=None, later=False, captures=None) -> Faults:
    """After the statistics pass: a non-finite log-prob or entropy at an `active` position comes from a NaN or an
    infinity in hidden (at an active position), weight or bias, which the error names, or from logits that
    overflowed. Two flags on the device (a reduction over the positions and one over hidden's active rows); weight
    and bias, whose reading costs a pass over the lm_head, are read only when a fault is raised, if still alive.
    `rows`: a packed call's hidden row of each position. `later`: raised after the call (`faults.Deferred`).
    `captures`: the flags as a CUDA graph replay (`checked`)."""
    tensors = (active, logp.detach(), entropy.detach(), hidden.detach(), rows)
    bad_hidden, bad_stats = checked(captures, ("statistics checks",), statistics_flags, tensors)
    when = " (found after an earlier call, whose results are not valid)" if later else ""
    faults = Faults()
    faults.add(
        bad_hidden,
        lambda _: ValueError(
            f"hidden: NaN or infinite value at an active position{when}: the log-probs and entropies would be NaN"
        ),
    )
    head = (("weight", weakref.ref(weight)), ("bias", None if bias is None else weakref.ref(bias)))
    faults.add(bad_stats, lambda _: non_finite_head(head, when))
    return faults


def statistics_flags(active, logp, entropy, hidden, rows):
    """(non-finite statistics with hidden non-finite at an active position, non-finite statistics), int64 0-d."""
    bad_stats = ~(~active | (torch.isfinite(logp) & torch.isfinite(entropy))).all()
    finite_rows = torch.isfinite(hidden.reshape(-1, hidden.shape[-1])).all(-1)
    if rows is not None:  # a packed call: no position has a row when hidden has none
        finite_rows = finite_rows[rows] if finite_rows.numel() else torch.ones_like(rows, dtype=torch.bool)
    bad_hidden = ~(~active | finite_rows.reshape(active.shape)).all()
    return (bad_stats & bad_hidden).long(), bad_stats.long()


def non_finite_head(head, when: str) -> ValueError:
    """The error for non-finite statistics with finite hidden states: weight or bias if either holds a NaN or an
    infinity (read now, if the tensor is still alive), else the logits overflowed."""
    gone = []
    for name, ref in head:
        x = None if ref is None else ref()
        if ref is not None and x is None:
            gone.append(name)
        elif x is not None and not bool(torch.isfinite(x).all()):
            return ValueError(f"{name}: NaN or infinite value{when}: the log-probs and entropies would be NaN")
    unchecked = f" ({' and '.join(gone)} no longer alive to check for NaN or infinite values)" if gone else ""
    return ValueError(f"hidden: the logits overflowed: a log-prob or entropy at an active position is not "
                      f"finite{when}{unchecked}")  # fmt: skip


def checked(captures, key, flags, tensors: tuple):
    """flags(*tensors): where calls are captured (`capture.Captures`), one CUDA graph replay per input layout in
    place of the ~25-45 small reductions of a check, whose launches are host time in a step bound by the host's
    launch rate; else as it is."""
    if captures is None:
        return flags(*tensors)
    return captures.run_with_absent(key, flags, tensors)


def first_where(values, bad):
    """The first of `values` where `bad` holds (values[0] where none does), as a device tensor: no read back."""
    if not values.numel():
        return None
    return values.gather(0, bad.to(torch.uint8).argmax().reshape(1))


def unknown_names(given, valid, where: str) -> None:
    """A TypeError naming `where` and, for each unknown name, the closest valid one."""
    unknown = sorted(set(given) - set(valid))
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(f"{where} got unknown keyword(s): {', '.join(hints)}")
