"""Random micro-batches and the comparison of a fused result against the float64 reference (the calls are the
audit's harness)."""

from __future__ import annotations

import math

import pytest
import torch

import reference
from audits.harness import leaves, run_fused, run_naive_bf16, run_reference

__all__ = [
    "TILES",
    "assert_matches",
    "max_error",
    "option_cases",
    "valid_schedules",
    "leaves",
    "make_inputs",
    "run_fused",
    "run_naive_bf16",
    "run_reference",
]

# Small tiles so that T = 37 and V = 1021 exercise full tiles, tail tiles and a vocabulary tail.
TILES = {"token_tile": 64, "tail_tile": 8, "vocab_tile": 256, "speed_tile": 64, "sparse_tile": 16}


def make_inputs(
    seed=0,
    B=3,
    T=37,
    H=16,
    V=1021,
    dtype=torch.float64,
    *,
    bias=False,
    adv_shape="B",
    is_shape=None,
    off_policy=True,
    sampling=False,
    ref=False,
    mask_rate=0.3,
    empty_row=True,
    logit_std=1.0,
    zero_advantage_rows=0,
):
    """A micro-batch with odd sizes (T, V not multiples of any tile), padded tails and one fully masked row;
    `zero_advantage_rows` rows (the last ones) with advantage exactly 0, as a group whose rewards all tied
    (with [B,T] advantages, also some tokens of the first row)."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    x = {
        "hidden": rn(B, T, H).to(dtype),
        "weight": (rn(V, H) * logit_std / math.sqrt(H)).to(dtype),
        "completion_ids": torch.randint(0, V, (B, T), generator=g),
        "completion_mask": (torch.rand(B, T, generator=g) > mask_rate).long(),
        "advantages": rn(B) if adv_shape == "B" else rn(B, T),
    }
    x["completion_mask"][:, 0] = 1
    if empty_row and B > 2:
        x["completion_mask"][1] = 0
    x["completion_mask"][0, T // 2 :] = 0  # a padded tail
    if zero_advantage_rows:
        x["advantages"][B - zero_advantage_rows :] = 0.0
        if adv_shape == "BT":  # and every third token of the first row
            x["advantages"][0, ::3] = 0.0
    if bias:
        x["bias"] = (rn(V) * 0.5).to(dtype)
    with torch.no_grad():
        logp = reference.grpo_loss(x["hidden"], x["weight"], x["completion_ids"], x["completion_mask"], x["advantages"],
                                   bias=x.get("bias")).per_token_logps  # fmt: skip
    if off_policy:
        x["old_per_token_logps"] = (logp + rn(B, T) * 0.2).clamp(max=0.0)  # log-probs stay <= 0
    if ref:
        x["ref_per_token_logps"] = (logp + rn(B, T) * 0.3).clamp(max=0.0)
    if sampling:
        s = (logp + rn(B, T) * 0.3).clamp(max=0.0)
        s[torch.rand(B, T, generator=g) < 0.2] = float("nan")
        x["sampling_per_token_logps"] = s
    if is_shape is not None:
        shape = {"BT": (B, T), "B1": (B, 1), "B": (B,)}[is_shape]
        x["importance_sampling_ratio"] = torch.rand(*shape, generator=g, dtype=torch.float64) * 1.5 + 0.1
    return x


def assert_matches(fused, fused_grads, ref, ref_grads, rtol, atol=None):
    """Loss, every metric, logp, entropy, the entropy mask, and the gradients; errors relative to each
    quantity's largest magnitude (so near-zero entries do not make a relative error meaningless)."""
    atol = rtol * 1e-2 if atol is None else atol

    def close(a, b, what):
        a, b = a.detach().double(), b.detach().double()
        scale = max(float(b.abs().max()) if b.numel() else 0.0, 1e-12)
        err = float((a - b).abs().max()) if b.numel() else 0.0
        assert err <= rtol * scale + atol, f"{what}: error {err:.3e}, scale {scale:.3e}"

    close(fused.loss, ref.loss, "loss")
    assert set(fused.metrics) == set(ref.metrics), (sorted(fused.metrics), sorted(ref.metrics))
    for name, value in ref.metrics.items():
        if math.isnan(float(value)):
            assert math.isnan(float(fused.metrics[name])), name
        else:
            close(fused.metrics[name], value, name)
    close(fused.per_token_logps, ref.per_token_logps, "per_token_logps")
    close(fused.entropy, ref.entropy, "entropy")
    if ref.entropy_mask is None:
        assert fused.entropy_mask is None
    else:
        assert torch.equal(fused.entropy_mask, ref.entropy_mask), "entropy_mask"
    assert set(fused_grads) == set(ref_grads)
    for name, g in ref_grads.items():
        close(fused_grads[name], g, f"d {name}")


def valid_schedules(settings: dict) -> list[str]:
    """The schedules a setting allows: speed cannot take top_entropy_quantile < 1."""
    if settings.get("top_entropy_quantile", 1.0) < 1:
        return ["memory", "sparse"]
    return ["memory", "speed", "sparse"]


def option_cases(options, loss_types):
    """pytest params (loss type, option name, schedule) of every loss type x option x valid schedule, and the
    options by name."""
    cases = [
        pytest.param(loss_type, name, schedule, id=f"{loss_type}-{name}-{schedule}")
        for loss_type in loss_types
        for name, extra, _ in options
        for schedule in valid_schedules(extra)
    ]
    return cases, {name: (extra, inputs) for name, extra, inputs in options}


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())
