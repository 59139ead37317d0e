"""The reference against TRL 1.16.0's own code, over hundreds of random cases of every loss type and option."""

from __future__ import annotations

import math

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from trl_standin import OneProcessAccelerator, trl_compute_loss

import reference
from reference import objective as obj

LOSS_TYPES = reference.LOSS_TYPES
RTOL, ATOL = 1e-6, 1e-9


def random_case(seed: int):
    """A random micro-batch and a random combination of settings (some rows fully masked, ties, NaNs)."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=g))]
    B, T = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < pick([1.0, 0.7, 0.3])).long()
    if B > 1 and pick([True, False]):
        mask[0] = 0
    logp = -randn(B, T).abs() * 2
    entropy = randn(B, T).abs() * 3
    if pick([True, False]):
        entropy = entropy.round()  # ties at the quantile
    # float32 values, as TRL's head returns them: TRL's code, fed them in float64, then compares exactly as its runs
    # do (test_threshold_ties.py compares float64 entropies with TRL's float32 run)
    entropy = entropy.float().double()
    loss_type = pick(LOSS_TYPES)
    s = {
        "loss_type": loss_type,
        "importance_sampling_level": pick(["token", "sequence"]),
        "top_entropy_quantile": pick([1.0, 0.8, 0.5, 0.2, 0.0]),
        "epsilon_low": pick([0.2, 0.1, 0.28]),
        "epsilon_high": pick([None, 0.28, 0.4]) if loss_type != "cispo" else pick([1.0, 5.0, 0.5]),
        "delta": pick([None, None, 1.3, 3.0]),
        "beta": pick([0.0, 0.0, 0.04, 0.5]),
        "use_bias_correction_kl": pick([True, False]),
        "off_policy_mask_threshold": pick([None, 0.05, 0.5]),
        "entropy_coef": pick([0.0, 0.0, 0.01, 0.3]),
        "max_completion_length": T + pick([0, 3]),
        "sapo_temperature_pos": pick([1.0, 0.7]),
        "sapo_temperature_neg": pick([1.05, 2.0]),
        "vespo_k_pos": pick([2.0, 1.0]),
        "vespo_lambda_pos": pick([3.0, 0.5]),
        "vespo_k_neg": pick([3.0, 2.0]),
        "vespo_lambda_neg": pick([2.0, 1e-5]),
    }
    inputs = {}
    adv = randn(B) if pick([True, False]) else randn(B, T)
    if pick([True, True, False]):
        inputs["old_per_token_logps"] = logp + randn(B, T) * pick([0.05, 0.3, 1.0])
    if s["beta"]:
        inputs["ref_per_token_logps"] = logp + randn(B, T) * 0.5
    if pick([True, False]):
        shape = pick([(B, T), (B, 1), (B,)])
        inputs["importance_sampling_ratio"] = torch.rand(*shape, generator=g, dtype=torch.float64) * 2
    if s["off_policy_mask_threshold"] is not None and pick([True, False]):
        sampling = logp + randn(B, T) * 0.5
        sampling[torch.rand(B, T, generator=g) < 0.2] = float("nan")  # tokens vLLM could not score
        inputs["sampling_per_token_logps"] = sampling
    calls = {"gradient_accumulation_steps": pick([1, 2, 4])}
    calls["steps_per_generation"] = pick([None, 1, 4])
    if loss_type in ("dapo", "cispo", "vespo") and pick([True, False]):
        calls["num_items_in_batch"] = int(mask.sum()) * pick([1, 3]) + pick([0, 5])
    ids = torch.randint(0, 50, (B, T), generator=g)
    return logp, entropy, ids, mask, adv, s, inputs, calls


def trl_inputs(inputs, calls, mask):
    """The same micro-batch in the form TRL's trainer hands to `_compute_loss`."""
    out = dict(inputs)
    ratio = out.get("importance_sampling_ratio")
    if ratio is not None and ratio.dim() == 1:
        out["importance_sampling_ratio"] = ratio.unsqueeze(1)  # TRL never passes [B]; we read it as [B,1]
    gas = calls["gradient_accumulation_steps"]
    spg = calls["steps_per_generation"] or gas
    n = calls.get("num_items_in_batch", spg * int(mask.sum()))
    out["num_items_in_batch"] = torch.tensor(float(n), dtype=torch.float64)
    return out, gas, spg


def close(a, b) -> bool:
    a, b = float(torch.as_tensor(a).detach()), float(torch.as_tensor(b).detach())
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= ATOL + RTOL * abs(b)


@pytest.mark.parametrize("seed", range(400))
def test_reference_matches_trl_compute_loss(seed):
    logp, entropy, ids, mask, adv, s, inputs, calls = random_case(seed)
    T = mask.shape[1]
    lp_ref, h_ref = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    ours = reference.grpo_objective(lp_ref, h_ref, mask, adv, **inputs, **calls, **s)
    ours.loss.backward()

    lp_trl, h_trl = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    batch, gas, spg = trl_inputs(inputs, calls, mask)
    theirs, their_metrics = trl_compute_loss(lp_trl, h_trl, ids, mask, adv, inputs=batch, gas=gas, spg=spg, **s)
    theirs.backward()
    their_metrics.pop("entropy_coef", None)  # TRL logs the coefficient itself, a setting rather than a measurement

    assert close(ours.loss, theirs), (float(ours.loss), float(theirs), s)
    assert set(ours.metrics) == set(their_metrics), (sorted(ours.metrics), sorted(their_metrics))
    for name, value in their_metrics.items():
        if T == 1 and not mask.all():
            continue  # TRL averages [B,1] values over masked rows too when T = 1 (objective.is_per_sequence)
        assert close(ours.metrics[name], value), (name, float(ours.metrics[name]), value, s)
    m = mask.bool()
    for ours_g, their_g in ((lp_ref.grad, lp_trl.grad), (h_ref.grad, h_trl.grad)):
        their_g = torch.zeros_like(logp) if their_g is None else their_g
        ours_g = torch.zeros_like(logp) if ours_g is None else ours_g
        torch.testing.assert_close(ours_g[m], their_g[m], rtol=RTOL, atol=ATOL)


class MaskHolder:
    """The one attribute `get_high_entropy_mask` reads."""

    accelerator = OneProcessAccelerator()


@pytest.mark.parametrize("seed", range(50))
@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.8, 0.95])
def test_entropy_mask_matches_trl(seed, q):
    g = torch.Generator().manual_seed(seed)
    entropy = torch.rand(4, 9, generator=g) * 5
    if seed % 3 == 0:
        entropy = entropy.round()
    mask = torch.rand(4, 9, generator=g) < 0.6
    theirs = GRPOTrainer.get_high_entropy_mask(MaskHolder(), entropy, mask, 1 - q)
    ours = obj.high_entropy_mask(entropy, mask, q)
    assert torch.equal(ours.bool(), theirs)


@pytest.mark.parametrize("seed", range(50))
def test_off_policy_mask_matches_trl(seed):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(5, 1, generator=g, dtype=torch.float64)
    logp = -torch.rand(5, 7, generator=g, dtype=torch.float64)
    sampling = logp + torch.randn(5, 7, generator=g, dtype=torch.float64) * 0.3
    sampling[torch.rand(5, 7, generator=g) < 0.2] = float("nan")
    mask = (torch.rand(5, 7, generator=g) < 0.7).double()
    theirs = GRPOTrainer.get_off_policy_mask(adv, logp, sampling, mask, 0.05)
    ours = obj.off_policy_keep(adv, logp, sampling, mask.bool(), 0.05)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("seed", range(50))
def test_vespo_phi_matches_trl_gamma_weights(seed):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(5, 1, generator=g, dtype=torch.float64)
    log_ratio = torch.randn(5, 7, generator=g, dtype=torch.float64) * (0.1 if seed % 2 else 10)
    mask = (torch.rand(5, 7, generator=g) < 0.7).double()
    ratio = torch.rand(5, 7, generator=g, dtype=torch.float64) * 2 if seed % 3 else None
    s = reference.Settings(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.0)
    theirs = GRPOTrainer.get_gamma_weights(adv, log_ratio, mask, ratio, 1.5, 2.5, 2.0, 1.0)
    ours = obj.vespo_phi(adv, log_ratio, mask, ratio, s)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)
