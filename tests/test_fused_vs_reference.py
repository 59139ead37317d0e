"""The fused loss against the float64 reference: every loss type crossed with each option (pairwise), both
schedules where valid, eagerly, on odd sizes (T = 37, V = 1021: not multiples of any tile)."""

from __future__ import annotations

import warnings

import pytest
import torch
from cases import TILES, assert_matches, make_inputs, run_fused, run_reference

from compiled_grpo import LOSS_TYPES, FusedLinearGRPOLoss, tiling

warnings.filterwarnings("ignore", message=".* is meant for importance_sampling_level")

# Each option against every loss type: (name, settings, input options).
OPTIONS = [
    ("defaults", {}, {}),
    ("sequence IS", {"importance_sampling_level": "sequence"}, {}),
    ("q=0.8", {"top_entropy_quantile": 0.8}, {}),
    ("q=0.5", {"top_entropy_quantile": 0.5}, {}),
    ("q=0.2", {"top_entropy_quantile": 0.2}, {}),
    ("beta", {"beta": 0.04}, {"ref": True}),
    ("beta no bias correction", {"beta": 0.1, "use_bias_correction_kl": False}, {"ref": True}),
    ("IS ratio [B,T]", {}, {"is_shape": "BT"}),
    ("IS ratio [B,1]", {}, {"is_shape": "B1"}),
    ("IS ratio [B]", {}, {"is_shape": "B"}),
    ("OPSM", {"off_policy_mask_threshold": 0.01}, {}),
    ("OPSM sampling", {"off_policy_mask_threshold": 0.05}, {"sampling": True}),
    ("entropy bonus", {"entropy_coef": 0.05}, {}),
    ("entropy bonus q=0.5", {"entropy_coef": 0.05, "top_entropy_quantile": 0.5}, {}),
    ("advantages [B,T]", {}, {"adv_shape": "BT"}),
    ("bias", {}, {"bias": True}),
    ("temperature", {"temperature": 0.7}, {}),
    ("softcap and scale", {"final_logit_softcapping": 2.0, "logit_scale": 1.7}, {}),
    ("delta", {"delta": 1.1, "epsilon_high": 0.28}, {}),
    ("on-policy", {}, {"off_policy": False}),
]


def settings_for(loss_type, extra):
    s = {"loss_type": loss_type, "max_completion_length": 40, **extra}
    if loss_type == "cispo":
        s.setdefault("epsilon_high", 1.05)
    return s


def schedules(settings):
    return ["memory"] if settings.get("top_entropy_quantile", 1.0) < 1 else ["memory", "speed"]


CASES = [
    pytest.param(loss_type, name, schedule, id=f"{loss_type}-{name}-{schedule}")
    for loss_type in LOSS_TYPES
    for name, extra, _ in OPTIONS
    for schedule in schedules(extra)
]
OPTION = {name: (extra, inputs) for name, extra, inputs in OPTIONS}


def check(loss_type, name, schedule, dtype, rtol, seed=0):
    extra, input_opts = OPTION[name]
    settings = settings_for(loss_type, extra)
    x = make_inputs(seed=seed, dtype=dtype, **input_opts)
    ref, ref_grads = run_reference(x, settings)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES,
                                  **settings)  # fmt: skip
    out, out_grads = run_fused(loss_fn, x)
    assert out.loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_matches(out, out_grads, ref, ref_grads, rtol=rtol)


@pytest.mark.parametrize("loss_type, name, schedule", CASES)
def test_float64_matches_reference(loss_type, name, schedule):
    check(loss_type, name, schedule, torch.float64, rtol=1e-10)


@pytest.mark.parametrize("loss_type, name, schedule", CASES)
def test_float32_matches_reference(loss_type, name, schedule):
    check(loss_type, name, schedule, torch.float32, rtol=2e-5)


@pytest.mark.parametrize("schedule", ["memory", "speed"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_every_position_active(loss_type, schedule):
    """No padding and B*T a multiple of the tile: the slots are a view of hidden (no compaction copy) and the
    memory schedule's single token tile writes each dW slice straight from its GEMM."""
    x = make_inputs(seed=3, B=2, T=32, dtype=torch.float64, empty_row=False)
    x["completion_mask"] = torch.ones_like(x["completion_mask"])
    assert tiling.plan_mask(x["completion_mask"], TILES["token_tile"], TILES["tail_tile"]).identity
    settings = settings_for(loss_type, {"beta": 0.04})
    x["ref_per_token_logps"] = x["old_per_token_logps"] - 0.1
    ref, ref_grads = run_reference(x, settings)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **settings)
    out, out_grads = run_fused(loss_fn, x)
    assert_matches(out, out_grads, ref, ref_grads, rtol=1e-10)


@pytest.mark.parametrize("group", [8, 24, 40, 1000])
def test_speed_schedule_gradient_groups(group):
    """dW summed over groups of tiles (tiles of 16 and tails of 8 slots): groups smaller than a tile, holding
    several tiles with a tail, and one group for everything all give the reference's gradient."""
    x = make_inputs(seed=5, dtype=torch.float64, bias=True)
    settings = settings_for("grpo", {"entropy_coef": 0.02})
    ref, ref_grads = run_reference(x, settings)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule="speed", speed_tile=16, tail_tile=8, speed_group=group,
                                  **settings)  # fmt: skip
    out, out_grads = run_fused(loss_fn, x)
    assert_matches(out, out_grads, ref, ref_grads, rtol=1e-10)
