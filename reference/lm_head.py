"""Per-token statistics from full float64 logits (the expensive, obviously-correct way)."""

from __future__ import annotations

import torch

from .settings import Settings


def logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, s: Settings) -> torch.Tensor:
    """z = softcap(logit_scale * (h @ W.T + b)) / temperature, softcap(u) = c tanh(u / c), all in float64."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    z = z * s.logit_scale
    if s.final_logit_softcapping is not None:
        c = s.final_logit_softcapping
        z = c * torch.tanh(z / c)
    return z / s.temperature


def logp_and_entropy(z: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logp_t = z[y_t] - logsumexp(z);  H_t = -sum_v p_v log p_v  (both differentiable)."""
    log_p = torch.log_softmax(z, dim=-1)
    logp = log_p.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logp, entropy
