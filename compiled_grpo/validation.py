"""Input checks: a clear ValueError or TypeError naming the argument, never a deep torch error or a silent NaN.

Shape and dtype checks are free; value checks (ids in range, 0/1 mask, finite inputs) read the data back to the
host and can be turned off with `validate=False`.
"""

from __future__ import annotations

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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
    if hidden.dim() != 3:
        _fail("hidden", f"expected [B, T, H], got shape {tuple(hidden.shape)}")
    B, T, H = hidden.shape
    if hidden.dtype not in FLOATS:
        _fail("hidden", f"expected a floating dtype, got {hidden.dtype}", TypeError)
    if weight.dim() != 2 or weight.shape[1] != H:
        _fail("weight", f"expected [V, {H}] (H of hidden), got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        _fail("weight", f"dtype {weight.dtype} differs from hidden's {hidden.dtype}", TypeError)
    if bias is not None:
        _is_tensor(bias, "bias")
        if bias.shape != (weight.shape[0],):
            _fail("bias", f"expected [{weight.shape[0]}], got shape {tuple(bias.shape)}")
    for name, x in (("completion_ids", ids), ("completion_mask", mask)):
        if x.shape != (B, T):
            _fail(name, f"expected [{B}, {T}] like hidden's first two dimensions, got {tuple(x.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        _fail("completion_ids", f"expected an integer dtype, got {ids.dtype}", TypeError)
    if advantages.shape not in ((B,), (B, T)):
        _fail("advantages", f"expected [{B}] or [{B}, {T}], got {tuple(advantages.shape)}")
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


def check_values(inputs, vocab: int) -> None:
    """Host-syncing checks of the values at active positions; `vocab` is the whole vocabulary's size."""
    ids, mask, advantages = inputs.completion_ids, inputs.completion_mask, inputs.advantages
    is_ratio = inputs.importance_sampling_ratio
    if not ((mask == 0) | (mask == 1)).all():
        _fail("completion_mask", "values must be 0 or 1")
    active = mask.bool()
    if active.any():
        a_ids = ids[active]
        if (a_ids < 0).any() or (a_ids >= vocab).any():
            bad = a_ids[(a_ids < 0) | (a_ids >= vocab)][0].item()
            _fail("completion_ids", f"id {bad} at an active position is outside [0, {vocab})")
    adv = advantages if advantages.dim() == 1 else advantages[active]
    if not torch.isfinite(adv).all():
        _fail("advantages", "non-finite value at an active position")
    for name, x in inputs.per_token().items():
        if x is None:
            continue
        v = x[active]
        ok = ~torch.isinf(v) if name == "sampling_per_token_logps" else torch.isfinite(v)  # NaN = unscored token
        if not ok.all():
            _fail(name, "non-finite value at an active position")
    if is_ratio is not None:
        r = is_ratio[active] if is_ratio.shape == mask.shape else is_ratio
        if not torch.isfinite(r).all():
            _fail("importance_sampling_ratio", "non-finite value at an active position")
        if (r < 0).any():
            _fail("importance_sampling_ratio", "negative value at an active position")
