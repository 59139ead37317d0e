"""One audited cell: what was checked, its worst error against its tolerance, and the evidence."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Check:
    what: str  # e.g. "loss", "d weight", "metric clip_ratio/low_mean"
    error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance  # NaN errors fail

    @property
    def margin(self) -> float:
        """error / tolerance: above 1 fails."""
        if self.error != self.error:
            return float("inf")
        return self.error / self.tolerance if self.tolerance > 0 else (0.0 if self.error == 0 else float("inf"))


@dataclass
class CellResult:
    group: str  # "loss", "quantile", "entropy"
    name: str  # one line that says what the cell is
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # evidence worth a sentence (mask flips on the threshold)
    params: dict = field(default_factory=dict)  # for plots and tables (loss_type, q, dtype, vocab size, ...)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def worst(self) -> Check:
        return max(self.checks, key=lambda c: c.margin)

    def check(self, what: str, error: float, tolerance: float) -> None:
        self.checks.append(Check(what, float(error), float(tolerance)))
