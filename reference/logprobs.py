"""Float64 reference of the per-token primitive: full logits, plain autograd.

    z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature   (temperature: a float or per position)
    logp = log_softmax(z)[target];  entropy = -sum_v p_v log p_v;  both 0 where target == ignore_index

and, without gradient, what TRL 1.16's `ChunkedLogProbFunction` also offers: log_sum_sq_probs = log sum_v p_v^2,
mean_logits = mean_v z_v, is_top1 = whether the target is the first maximal logit (ties go to the lowest id).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ReferenceLogProbs(NamedTuple):
    logp: torch.Tensor  # float64, shaped like targets
    entropy: torch.Tensor
    log_sum_sq_probs: torch.Tensor
    mean_logits: torch.Tensor
    is_top1: torch.Tensor  # bool


def fused_linear_logprobs(
    hidden,
    weight,
    targets,
    *,
    bias=None,
    temperature=1.0,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    ignore_index: int = -100,
) -> ReferenceLogProbs:
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    z = z * logit_scale
    if final_logit_softcapping is not None:
        z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
    if isinstance(temperature, torch.Tensor):
        z = z / temperature.double().broadcast_to(targets.shape).unsqueeze(-1)
    else:
        z = z / temperature
    valid = targets != ignore_index
    ids = torch.where(valid, targets, 0).long().unsqueeze(-1)
    log_p = torch.log_softmax(z, dim=-1)
    zero = lambda t: torch.where(valid, t, 0.0)
    logp = zero(log_p.gather(-1, ids).squeeze(-1))
    entropy = zero(-(log_p.exp() * log_p).sum(-1))
    with torch.no_grad():
        log_sum_sq = zero(torch.logsumexp(2 * log_p, dim=-1))
        mean_logits = zero(z.mean(-1))
        is_top1 = (z.argmax(-1, keepdim=True) == ids).squeeze(-1) & valid
    return ReferenceLogProbs(logp, entropy, log_sum_sq, mean_logits, is_top1)
