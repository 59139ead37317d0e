"""Streaming entropy and logsumexp against scipy in float64, on adversarial logits.

The fused path's statistics come from `compiled_grpo.streaming`: logits of a tile (scale, temperature) folded
into (logp, entropy, logsumexp) with the shifted accumulation sum exp(z - m) (z - m). Here they are fed logits
through an identity lm_head (so the logits are exactly what the case says) and compared with
`scipy.special.logsumexp` and `scipy.stats.entropy` on the same float32 logits in float64.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import special, stats

from compiled_grpo import streaming
from compiled_grpo.head import Head

from . import tolerances
from .results import CellResult

QUICK_VOCABS = (1, 7, 1021, 4099)
FULL_VOCABS = QUICK_VOCABS + (32003, 151936)


def logit_cases(V: int, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, float]]:
    """name -> (logits [n, V] float32, temperature)."""
    n = 16
    normal = rng.standard_normal((n, V)).astype(np.float32)
    peaked = normal.copy()
    peaked[:, 0] += 80.0  # p(0) ~ 1, entropy ~ 1e-30..1e-34
    return {
        "normal": (normal, 1.0),
        "very peaked": (peaked, 1.0),
        "uniform": (np.zeros((n, V), np.float32), 1.0),
        "magnitude 1e4": ((1e4 + normal * 30).astype(np.float32), 1.0),
        "temperature 0.05": (normal * 3, 0.05),
        "temperature 5": (normal * 3, 5.0),
    }


def fused_statistics(logits: np.ndarray, temperature: float, targets: np.ndarray):
    """The library's tile path: identity lm_head, so x @ W.T is the logits themselves."""
    V = logits.shape[1]
    x = torch.from_numpy(logits)
    values = torch.tensor([1.0, 1.0 / temperature, 1.0])
    if V <= 4099:
        head = Head(torch.eye(V), None, values, softcap=False)
        logp, entropy, lse = streaming.statistics_tile(x, torch.from_numpy(targets), head)
    else:  # an identity of this size would be 90 GB: fold the scaled logits directly (the same fold)
        z = x * values[1]
        logp, entropy, lse = streaming.fold_statistics(z, torch.from_numpy(targets))
    return logp.double().numpy(), entropy.double().numpy(), lse.double().numpy()


def audit_case(name: str, V: int, logits: np.ndarray, temperature: float, rng) -> CellResult:
    result = CellResult("entropy", f"{name:17s} V={V}", params={"case": name, "V": V})
    targets = rng.integers(0, V, logits.shape[0])
    logp, entropy, lse = fused_statistics(logits, temperature, targets)
    # the float32 logits after the temperature, as the fused path sees them, then float64 from there on
    z = (logits * np.float32(1.0 / temperature)).astype(np.float64)
    lse_ref = special.logsumexp(z, axis=-1)
    entropy_ref = stats.entropy(special.softmax(z, axis=-1), axis=-1)
    logp_ref = np.take_along_axis(z, targets[:, None], -1)[:, 0] - lse_ref
    lse_scale = np.maximum(np.abs(lse_ref), 1.0)
    result.check("logsumexp", float(np.max(np.abs(lse - lse_ref) / lse_scale)), tolerances.LOGSUMEXP)
    result.check("entropy", float(np.max(np.abs(entropy - entropy_ref))), tolerances.ENTROPY)
    result.check("logp", float(np.max(np.abs(logp - logp_ref) / lse_scale)), tolerances.LOGSUMEXP)
    result.check("entropy >= 0", float(max(0.0, -entropy.min())), tolerances.ENTROPY)
    result.params["entropy_error"] = result.checks[1].error
    return result


def run(full: bool, advance=lambda: None) -> list[CellResult]:
    rng = np.random.default_rng(0)
    results = []
    for V in FULL_VOCABS if full else QUICK_VOCABS:
        for name, (logits, temperature) in logit_cases(V, rng).items():
            results.append(audit_case(name, V, logits, temperature, rng))
            advance()
    return results


def steps(full: bool) -> int:
    """The cells `run` reports: one per vocabulary size and logit case."""
    return len(FULL_VOCABS if full else QUICK_VOCABS) * len(logit_cases(8, np.random.default_rng(0)))
