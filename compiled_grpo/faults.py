"""Value checks as device flags, read back where the host waits for the device anyway.

A check of values (ids in range, finite inputs, finite statistics) is a reduction on the device; reading each
result with `bool(...)` makes the host wait for the GPU once per check, and in a step bound by the host's launch
rate every wait throws away the host's lead. Here each check is a flag (a 0-d tensor, non-zero for a fault)
with the error it stands for; `Faults.issue` starts one copy of every flag (and a detail value each, such as the
first bad id) into pinned host memory, and `Faults.raise_first` reads them after an event: free once the host
has waited for the device for another reason (the plan's read of counts), a wait of its own otherwise.

On a CPU the copy is immediate. On a GPU the check after a call's statistics (`checks.statistics_faults`)
is deferred: raised at the next call of the same loss, after its plan, or by `check()`, naming the call it came
from (`Deferred`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

DEFER_ON_CPU = False  # tests set it to run the deferred path where no GPU is


@dataclass
class Faults:
    """Flags and their errors; `errors[i](detail)` builds the exception for flag i."""

    flags: list = field(default_factory=list)
    details: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    host: torch.Tensor | None = None  # int64 on the host once issued: every flag, then the details given
    event: object = None  # the copy's CUDA event, None on a CPU

    def add(self, flag: torch.Tensor, error: Callable[[int], Exception], detail: torch.Tensor | None = None):
        self.flags.append(flag.reshape(()).to(torch.int64))
        self.details.append(None if detail is None else detail.reshape(()).long())  # None: no kernel for it
        self.errors.append(error)

    def issue(self) -> Faults:
        """Start the copy of every flag to the host (no wait on a GPU); once."""
        if not self.flags or self.host is not None:
            return self
        values = torch.stack(self.flags + [d for d in self.details if d is not None])
        if values.is_cuda:
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values
        return self

    def raise_first(self) -> None:
        """Raise the first fault's error, if any (waits for the copy: free after another wait on the device)."""
        if self.host is None:
            return
        if self.event is not None:
            self.event.synchronize()
        values = iter(self.host.tolist())
        flags = [next(values) for _ in self.flags]
        details = [0 if d is None else next(values) for d in self.details]
        for flag, detail, error in zip(flags, details, self.errors, strict=True):
            if flag:
                raise error(detail)

    def settle(self) -> None:
        self.issue().raise_first()


def deferred(device: torch.device) -> bool:
    """Checks after a call's work are read later on a GPU (reading them now would wait for the call's work)."""
    return device.type == "cuda" or DEFER_ON_CPU


@dataclass
class Deferred:
    """Faults of earlier calls, kept until they are read: `raise_pending` after the next call's plan, or `check`."""

    pending: list = field(default_factory=list)

    def keep(self, faults: Faults) -> None:
        if faults.flags:
            self.pending.append(faults.issue())

    def raise_pending(self) -> None:
        pending, self.pending = self.pending, []
        for faults in pending:
            faults.raise_first()
