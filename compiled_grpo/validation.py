"""The loss's input checks: a clear ValueError or TypeError naming the argument, never a deep torch error or a
silent NaN.

Shape and dtype checks are free; value checks (ids in range, 0/1 mask, finite inputs) are
reductions on the device whose flags are read back together where the host waits anyway (`faults.Faults`), and
can be turned off with `validate=False`.
"""

from __future__ import annotations

import functools

import torch

from .checks import FLOATS, checked, first_where, weight_dtype_fault
from .faults import Faults
from .inputs import PER_TOKEN


def _fail(name: str, why: str, error=ValueError):
    raise error(f"{name}: {why}")


def _is_tensor(x, name):
    if not isinstance(x, torch.Tensor):
        _fail(name, f"expected a torch.Tensor, got {type(x).__name__}", TypeError)


def check_shapes(inputs) -> None:
    """Types, shapes and dtypes of a call's `inputs.LossInputs`."""
    hidden, weight, ids, mask = inputs.hidden, inputs.weight, inputs.completion_ids, inputs.completion_mask
    advantages, bias, is_ratio = inputs.advantages, inputs.bias, inputs.importance_sampling_ratio
    ref_hidden, ref_weight = inputs.ref_hidden, inputs.ref_weight
    for name, x in (("hidden", hidden), ("weight", weight), ("completion_ids", ids), ("completion_mask", mask)):
        _is_tensor(x, name)
    _is_tensor(advantages, "advantages")
    if inputs.packed:
        if hidden.dim() != 2:
            _fail("hidden", f"a packed call expects [rows, H], got shape {tuple(hidden.shape)}")
        (B, T), H = ids.shape, hidden.shape[1]
    elif hidden.dim() != 3:
        _fail("hidden", f"expected [B, T, H], got shape {tuple(hidden.shape)}")
    else:
        B, T, H = hidden.shape
    if hidden.dtype not in FLOATS:
        _fail("hidden", f"expected a floating dtype, got {hidden.dtype}", TypeError)
    if weight.dim() != 2 or weight.shape[1] != H:
        _fail("weight", f"expected [V, {H}] (H of hidden), got shape {tuple(weight.shape)}")
    if (why := weight_dtype_fault(hidden, weight)) is not None:
        _fail("weight", why, TypeError)
    if bias is not None:
        _is_tensor(bias, "bias")
        if bias.shape != (weight.shape[0],):
            _fail("bias", f"expected [{weight.shape[0]}], got shape {tuple(bias.shape)}")
    for name, x in (("completion_ids", ids), ("completion_mask", mask)):
        if x.shape != (B, T):
            _fail(name, f"expected [{B}, {T}] like hidden's first two dimensions, got {tuple(x.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        _fail("completion_ids", f"expected an integer dtype, got {ids.dtype}", TypeError)
    if advantages.shape not in ((B,), (B, 1), (B, T)):
        _fail("advantages", f"expected [{B}], [{B}, 1] or [{B}, {T}], got {tuple(advantages.shape)}")
    if advantages.dtype == torch.bool or advantages.dtype.is_complex:
        _fail("advantages", f"expected real numbers, got {advantages.dtype} (a bool would read as 1 and 0)", TypeError)
    for name, x in inputs.per_token().items():
        if x is not None:
            _is_tensor(x, name)
            if x.shape != (B, T):
                _fail(name, f"expected [{B}, {T}], got {tuple(x.shape)}")
    if is_ratio is not None:
        _is_tensor(is_ratio, "importance_sampling_ratio")
        if is_ratio.shape not in ((B, T), (B, 1), (B,)):
            _fail("importance_sampling_ratio", f"expected [{B}, {T}], [{B}, 1] or [{B}], got {tuple(is_ratio.shape)}")
    if ref_hidden is not None:
        _is_tensor(ref_hidden, "ref_hidden")
        if ref_hidden.shape != hidden.shape:
            _fail("ref_hidden", f"expected the shape of hidden {tuple(hidden.shape)}, got {tuple(ref_hidden.shape)}")
    if ref_weight is not None:
        _is_tensor(ref_weight, "ref_weight")
        if ref_weight.shape != weight.shape:
            _fail("ref_weight", f"expected the shape of weight {tuple(weight.shape)}, got {tuple(ref_weight.shape)}")


def check_devices(inputs) -> None:
    """Every tensor on hidden's device (a TypeError naming the first that is not), before any kernel sees them."""
    if not isinstance(inputs.hidden, torch.Tensor):
        return  # check_shapes names it
    device = inputs.hidden.device
    for name in TENSOR_INPUTS:
        x = getattr(inputs, name)
        if isinstance(x, torch.Tensor) and x.device != device:
            _fail(name, f"is on {x.device}, hidden on {device}: every input must be on one device", TypeError)


TENSOR_INPUTS = ("weight", "bias", "completion_ids", "completion_mask", "advantages", *PER_TOKEN,
                 "importance_sampling_ratio", "ref_hidden", "ref_weight", "ref_bias")  # fmt: skip


def value_faults(inputs, vocab: int, captures=None) -> Faults:
    """Checks of the values at active positions, as device flags; `vocab` is the whole vocabulary's size.
    `captures`: the flags as a CUDA graph replay (`checked`)."""
    ids, mask = inputs.completion_ids, inputs.completion_mask
    present = {name: x for name, x in inputs.per_token().items() if x is not None}
    # a NaN sampling log-prob marks a token vLLM did not score: only infinities are faults there
    nan_allowed = tuple(name == "sampling_per_token_logps" for name in present)
    is_ratio = inputs.importance_sampling_ratio
    flags = functools.partial(value_flags, nan_allowed, vocab)
    key = ("value checks", nan_allowed, vocab)
    flags = checked(captures, key, flags, (ids, mask, inputs.advantages, is_ratio, *present.values()))
    flags, first_bad = flags[:-1], flags[-1]
    errors = [
        lambda _: ValueError("completion_mask: values must be 0 or 1"),
        lambda bad: ValueError(f"completion_ids: id {bad} at an active position is outside [0, {vocab})"),
        non_finite("advantages"),
        *(error(name) for name in present for error in (non_finite, above_zero)),
    ]
    if is_ratio is not None:
        errors += [non_finite("importance_sampling_ratio"),
                   lambda _: ValueError("importance_sampling_ratio: negative value at an active position")]  # fmt: skip
    faults = Faults()
    for i, (flag, error) in enumerate(zip(flags, errors, strict=True)):
        faults.add(flag, error, first_bad if i == 1 and first_bad is not None else None)
    return faults


def value_flags(nan_allowed: tuple, vocab: int, ids, mask, advantages, is_ratio, *per_token) -> tuple:
    """The flags of `value_faults` in its order (int64 0-d, non-zero for a fault), then the first id out of range
    (None without ids)."""
    active = mask != 0
    out_of_range = active & ((ids < 0) | (ids >= vocab))
    adv = advantages if advantages.dim() == 1 else torch.where(active, advantages, 0.0)
    flags = [~((mask == 0) | (mask == 1)).all(), out_of_range.any(), ~torch.isfinite(adv).all()]
    for x, nan_ok in zip(per_token, nan_allowed, strict=True):
        ok = ~torch.isinf(x) if nan_ok else torch.isfinite(x)
        flags += [~(ok | ~active).all(), (active & (x > LOGP_ROUNDING)).any()]
    if is_ratio is not None:
        r = torch.where(active, is_ratio, 1.0) if is_ratio.shape == mask.shape else is_ratio
        flags += [~torch.isfinite(r).all(), (r < 0).any()]
    return (*(f.long() for f in flags), first_where(ids.reshape(-1), out_of_range.reshape(-1)))


# How far above 0 a log-probability may come from rounding (a 16-bit logsumexp near a near-certain token's logit is off
# by up to half a bf16 step, 0.004): beyond it a value is no log-probability (a probability above 1, or another sign).
LOGP_ROUNDING = 1e-2


def above_zero(name: str):
    return lambda _: ValueError(f"{name}: a value above 0 (beyond {LOGP_ROUNDING}, rounding) at an active position; "
                                "log-probabilities are <= 0")  # fmt: skip


def non_finite(name: str):
    return lambda _: ValueError(f"{name}: non-finite value at an active position")


def check_packed(inputs, segment_ids, row_index, sequences: int | None) -> None:
    """A packed call's shapes, before its layout is made: hidden [rows, H], every per-target input [M],
    advantages and importance_sampling_ratio [M] or per sequence."""
    hidden, ids = inputs.hidden, inputs.completion_ids
    for name, x in (("hidden", hidden), ("completion_ids", ids), ("segment_ids", segment_ids)):
        _is_tensor(x, name)
    if hidden.dim() != 2:
        _fail("hidden", f"a packed call (segment_ids given) expects [rows, H], got shape {tuple(hidden.shape)}")
    if ids.dim() != 1:
        _fail("completion_ids", f"a packed call expects [M] targets, got shape {tuple(ids.shape)}")
    M = ids.shape[0]
    for name in ("completion_mask", "segment_ids", *PER_TOKEN):
        x = segment_ids if name == "segment_ids" else getattr(inputs, name)
        if x is not None and (not isinstance(x, torch.Tensor) or x.shape != (M,)):
            _fail(name, f"a packed call expects [{M}] (one per target), got {getattr(x, 'shape', type(x))}")
    for name, x in (("segment_ids", segment_ids), ("row_index", row_index)):
        if isinstance(x, torch.Tensor) and x.device not in (hidden.device, torch.device("cpu")):
            _fail(name, f"expected on hidden's device ({hidden.device}) or the host, got {x.device}")
    if segment_ids.dtype.is_floating_point or segment_ids.dtype == torch.bool:
        _fail("segment_ids", f"expected an integer dtype, got {segment_ids.dtype}", TypeError)
    if row_index is None and hidden.shape[0] != M:
        _fail("hidden", f"expected [{M}, H] (one row per target) without row_index, got {tuple(hidden.shape)}")
    if row_index is not None:
        _is_tensor(row_index, "row_index")
        if row_index.shape != (M,) or row_index.dtype.is_floating_point:
            _fail("row_index", f"expected [{M}] integer rows of hidden, got {tuple(row_index.shape)} {row_index.dtype}")
    per_sequence = {"advantages": inputs.advantages, "importance_sampling_ratio": inputs.importance_sampling_ratio}
    for name, x in per_sequence.items():
        if x is not None and (not isinstance(x, torch.Tensor) or x.dim() != 1):
            _fail(name, f"a packed call expects [M] or [num_sequences], got {getattr(x, 'shape', type(x))}")
    if sequences is not None and (not isinstance(sequences, int) or sequences < 0):
        _fail("num_sequences", f"expected a non-negative int, got {sequences!r}")


def check_packed_values(segment_ids, row_index, rows: int, sequences: int) -> None:
    """Host-syncing checks: sequence ids in [0, num_sequences), rows of hidden in range; one wait for those on a
    GPU, none for those given on the host."""
    checks = {"segment_ids": (segment_ids, sequences, f"[0, num_sequences={sequences})"),
              "row_index": (row_index, rows, f"[0, {rows}) (rows of hidden)")}  # fmt: skip
    given = {name: check for name, check in checks.items() if check[0] is not None and check[0].numel()}
    for device in {x.device for x, _, _ in given.values()}:  # each device's bounds read back at once
        mine = {name: check for name, check in given.items() if check[0].device == device}
        values = iter(torch.stack([v for x, _, _ in mine.values() for v in (x.min(), x.max())]).tolist())
        for name, (_, limit, shown) in mine.items():
            low, high = next(values), next(values)
            if low < 0 or high >= limit:
                _fail(name, f"values must lie in {shown}")


def check_per_sequence(inputs, packing) -> None:
    """After the layout is known: [S] inputs match the number of sequences."""
    M, S = packing.position.numel(), packing.sequences
    for name in ("advantages", "importance_sampling_ratio"):
        x = getattr(inputs, name)
        if x is not None and x.shape[0] not in (M, S):
            _fail(name, f"a packed call expects [{M}] (per target) or [{S}] (per sequence), got {tuple(x.shape)}")
