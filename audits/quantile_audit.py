"""The entropy threshold against numpy and scipy on adversarial data.

compiled_grpo's threshold (float32, linear interpolation, torch.quantile's semantics, a sort-free path past
2**24 values) against `numpy.quantile(method="linear")` and `scipy.stats.mstats.mquantiles` with plotting
positions alphap = betap = 1 (Hyndman and Fan's type 7, the same linear interpolation), both in float64 on the
same float32 values. Also the mask it gives: `(H * m >= tau) & m`, ties kept, checked against numpy.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import mstats

from compiled_grpo import quantile

from . import tolerances
from .results import CellResult

QS = (0.8, 0.5, 0.2, 0.0, 1.0)  # top_entropy_quantile; the threshold is the (1 - q) quantile


def datasets(full: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Adversarial active-entropy sets (float32)."""
    n = 4096
    data = {
        "ties": rng.integers(0, 4, n).astype(np.float32),
        "all equal": np.full(n, 2.5, np.float32),
        "one token": np.array([1.7], np.float32),
        "two tokens": np.array([0.3, 2.9], np.float32),
        "heavy tails": (rng.standard_cauchy(n) ** 2).astype(np.float32),
        "near zero": (rng.random(n) * 1e-6).astype(np.float32),
        "exact zeros": np.where(rng.random(n) < 0.7, 0.0, rng.random(n)).astype(np.float32),
        "over 2**24 values": rng.random(2**24 + 17, dtype=np.float32) * 5,
        "three ranks concatenated": np.concatenate(
            [rng.random(1000, dtype=np.float32), np.zeros(0, np.float32), rng.random(3, dtype=np.float32) * 9]
        ),
    }
    if full:
        data["large heavy tails"] = (rng.standard_cauchy(2**24 + 5) ** 2).astype(np.float32)
    return data


def audit_threshold(name: str, values: np.ndarray, q: float) -> CellResult:
    result = CellResult("quantile", f"{name:26s} q={q}", params={"data": name, "q": q, "n": values.size})
    p = 1.0 - q
    ours = float(quantile.linear_quantile(torch.from_numpy(values), p))
    v64 = values.astype(np.float64)
    scale = max(float(v64.max() - v64.min()), abs(float(v64.max())), 1e-30)
    by_numpy = float(np.quantile(v64, p, method="linear"))
    result.check("vs numpy.quantile(linear)", abs(ours - by_numpy) / scale, tolerances.QUANTILE)
    if values.size <= 1_000_000:  # mquantiles sorts a masked array: minutes past that size
        by_scipy = float(mstats.mquantiles(v64, prob=[p], alphap=1, betap=1)[0])
        result.check("vs scipy mquantiles(1, 1)", abs(ours - by_scipy) / scale, tolerances.QUANTILE)
    return result


def audit_mask(rng: np.random.Generator) -> CellResult:
    """The mask from the threshold on a [B,T] batch with ties and padding, against numpy."""
    result = CellResult("quantile", "mask over a padded batch with ties", params={"data": "mask", "q": 0.5})
    entropy = rng.integers(0, 5, (6, 50)).astype(np.float32)
    mask = rng.random((6, 50)) < 0.6
    for q in QS[:3]:
        tau = np.quantile(entropy[mask].astype(np.float64), 1 - q, method="linear")
        expected = (entropy * mask >= tau) & mask
        got = quantile.high_entropy_mask(torch.from_numpy(entropy), torch.from_numpy(mask), q).numpy()
        result.check(f"tokens differing at q={q}", float((got != expected).sum()), 0.0)
    return result


def run(full: bool, advance=lambda: None) -> list[CellResult]:
    rng = np.random.default_rng(0)
    results = []
    for name, values in datasets(full, rng).items():
        for q in QS:
            results.append(audit_threshold(name, values, q))
            advance()
    results.append(audit_mask(rng))
    advance()
    return results


def steps(full: bool) -> int:
    """The cells `run` reports: one per dataset and quantile, then the mask's."""
    return len(datasets(full, np.random.default_rng(0))) * len(QS) + 1
