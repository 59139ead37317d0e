"""Ties at the entropy threshold: the token whose entropy the quantile lands on is kept, by TRL 1.16.0's own code
(float32 entropies), the float64 reference and the fused loss alike."""

from __future__ import annotations

import pytest
import torch
from trl_standin import trl_compute_loss

import reference
from compiled_grpo import FusedLinearGRPOLoss

QS = (0.5, 0.2)


def tied_entropies(g, B, T):
    """float64 entropies, most of them not float32 values, some repeated (ties at the quantile)."""
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 3 + 0.1
    repeated = torch.rand(B, T, generator=g) < 0.3
    return torch.where(repeated, entropy.flatten()[0], entropy)


@pytest.mark.parametrize("q", QS)
def test_reference_keeps_the_tokens_trl_keeps(q):
    """On cases whose quantile lands exactly on one entropy ((1 - q)(n - 1) an integer), the reference's loss,
    gradients and mask equal TRL's `_compute_loss` fed the same entropies as float32 (what its head returns)."""
    g = torch.Generator().manual_seed(int(q * 100))
    differing = 0
    for _ in range(40):
        B, T = 2, 16
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, 11:] = 0  # 27 active tokens: (1 - q) * 26 is an integer at q = 0.5 and q = 0.2 (not exactly)
        logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
        entropy = tied_entropies(g, B, T)
        adv = torch.randn(B, generator=g, dtype=torch.float64)
        old = (logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1).clamp(max=0.0)
        ids = torch.zeros(B, T, dtype=torch.long)
        s = {"loss_type": "dapo", "top_entropy_quantile": q}
        lp = logp.clone().requires_grad_()
        ours = reference.grpo_objective(lp, entropy, mask, adv, old_per_token_logps=old, **s)
        ours.loss.backward()
        lp_trl = logp.clone().requires_grad_()
        n = torch.tensor(float(mask.sum()), dtype=torch.float64)
        theirs, _ = trl_compute_loss(lp_trl, entropy.float(), ids, mask, adv.unsqueeze(1),
                                     inputs={"old_per_token_logps": old, "num_items_in_batch": n}, **s)  # fmt: skip
        theirs.backward()
        torch.testing.assert_close(ours.loss, theirs.double(), rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(lp.grad, lp_trl.grad, rtol=1e-6, atol=1e-9)
        float64_mask = (entropy * mask >= torch.quantile(entropy[mask.bool()].float(), 1 - q)) & mask.bool()
        differing += int(not torch.equal(float64_mask, ours.entropy_mask.bool()))
    assert differing > 0, "no case put a float64 entropy below its float32 threshold: the test checks nothing"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("q", QS)
def test_fused_mask_equals_the_reference_mask(q, dtype):
    """40 random small batches (B 2, T 16, V 100), the fused loss (eager) against the reference: the same mask,
    the same loss."""
    g = torch.Generator().manual_seed(7)
    loss_fn = FusedLinearGRPOLoss(loss_type="dapo", top_entropy_quantile=q, compiled=False)
    for _ in range(40):
        B, T, H, V = 2, 16, 8, 100
        hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
        weight = torch.randn(V, H, generator=g, dtype=torch.float64)
        ids = torch.randint(0, V, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, 11:] = 0
        adv = torch.randn(B, generator=g, dtype=torch.float64)
        ref = reference.grpo_loss(hidden, weight, ids, mask, adv, loss_type="dapo", top_entropy_quantile=q)
        out = loss_fn(hidden.to(dtype), weight.to(dtype), ids, mask, adv)
        assert torch.equal(out.entropy_mask.cpu(), ref.entropy_mask.bool())
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(out.loss.double(), ref.loss, rtol=tol, atol=tol)
