"""Where a micro-batch sits in training (`Step`), made from a call's arguments and checked.

Numbers given on the host are checked now; 0-d tensors (TRL passes `num_items_in_batch` and the trainer its
entropy coefficient on the device) are checked for shape and dtype now and for their values as device flags,
read back with the call's other value checks (`faults.Faults`), so the host never waits for them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .faults import Faults


@dataclass(frozen=True)
class Step:
    """The normalizers' context and the (per-call) entropy coefficient."""

    gradient_accumulation_steps: int = 1
    steps_per_generation: int | None = None  # None: gradient_accumulation_steps
    num_items_in_batch: int | float | torch.Tensor | None = None  # None: spg x this micro-batch's active tokens
    num_processes: int = 1
    entropy_coef: float | torch.Tensor = 0.0

    @property
    def gas(self) -> int:
        return self.gradient_accumulation_steps

    @property
    def spg(self) -> int:
        return self.gas if self.steps_per_generation is None else self.steps_per_generation

    @property
    def bonus_on(self) -> bool:
        """Whether the entropy bonus may be non-zero (a tensor coefficient is not read back to find out)."""
        return not (isinstance(self.entropy_coef, float) and self.entropy_coef == 0.0)


def _fail(name: str, why: str, error=ValueError):
    raise error(f"{name}: {why}")


def positive_int(name: str, value, optional: bool = False):
    """`value` if it is a positive int (or None where `optional`), else a TypeError/ValueError naming `name`."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(name, f"expected a positive int{' or None' if optional else ''}, got {value!r}", TypeError)
    if value <= 0:
        _fail(name, f"must be positive, got {value!r}")
    return int(value)


def scalar_tensor(name: str, value: torch.Tensor, floating: bool) -> torch.Tensor:
    """A one-element tensor (of a floating dtype where `floating`), else an error naming `name`."""
    if value.numel() != 1:
        _fail(name, f"expected a number or a one-element tensor, got a tensor of shape {tuple(value.shape)}")
    if value.dtype == torch.bool or value.is_complex() or (floating and not value.is_floating_point()):
        kind = "a floating" if floating else "a real"
        _fail(name, f"expected {kind} dtype, got {value.dtype}", TypeError)
    return value.reshape(())


def real_number(name: str, value, minimum: float | None = None):
    """A finite real number (at least `minimum`) as a float, or a one-element tensor (checked on the device)."""
    if isinstance(value, torch.Tensor):
        return scalar_tensor(name, value, floating=name == "entropy_coef")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(name, f"expected a number or a one-element tensor, got {type(value).__name__} {value!r}", TypeError)
    if not math.isfinite(value):
        _fail(name, f"must be finite, got {value!r}")
    if minimum is not None and value < minimum:
        _fail(name, f"must be >= {minimum:g}, got {value!r}")
    return float(value)


def make_step(gradient_accumulation_steps, steps_per_generation, num_items_in_batch, num_processes,
              entropy_coef) -> Step:  # fmt: skip
    """The checked `Step` of a call's arguments (`num_processes` already resolved to the world size if None)."""
    items = None if num_items_in_batch is None else real_number("num_items_in_batch", num_items_in_batch, 0.0)
    return Step(
        positive_int("gradient_accumulation_steps", gradient_accumulation_steps),
        positive_int("steps_per_generation", steps_per_generation, optional=True),
        items,
        positive_int("num_processes", num_processes),
        real_number("entropy_coef", entropy_coef),
    )


def add_step_faults(faults: Faults, step: Step) -> Faults:
    """The value checks of the step's tensors (a non-finite coefficient, a negative or non-finite token count)."""
    coef, items = step.entropy_coef, step.num_items_in_batch
    if isinstance(coef, torch.Tensor):
        faults.add(~torch.isfinite(coef), lambda _: ValueError("entropy_coef: must be finite"))
    if isinstance(items, torch.Tensor):
        bad = ~torch.isfinite(items) | (items < 0) if items.is_floating_point() else items < 0
        faults.add(bad, lambda _: ValueError("num_items_in_batch: must be a finite count >= 0"))
    return faults
