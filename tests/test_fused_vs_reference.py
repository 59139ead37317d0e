"""The fused loss against the float64 reference: every loss type crossed with each option (pairwise), every
schedule where valid, eagerly, on odd sizes (T = 37, V = 1021: not multiples of any tile)."""

from __future__ import annotations

import warnings

import pytest
import torch
from cases import TILES, assert_matches, make_inputs, option_cases, run_fused, run_reference

from compiled_grpo import LOSS_TYPES, FusedLinearGRPOLoss, tiling
from compiled_grpo.schedules import sparse_gradients, speed

warnings.filterwarnings("ignore", message=".* is meant for importance_sampling_level")

TIED = {"zero_advantage_rows": 2, "B": 5}  # the last two of five rows at advantage 0

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
    ("zero-advantage rows", {}, TIED),
    ("zero-advantage rows q=0.5", {"top_entropy_quantile": 0.5}, TIED),
    ("zero-advantage rows q=0.2 beta", {"top_entropy_quantile": 0.2, "beta": 0.04}, {**TIED, "ref": True}),
    ("zero-advantage rows q=0.2 bonus", {"top_entropy_quantile": 0.2, "entropy_coef": 0.05}, TIED),
    ("zero-advantage rows beta", {"beta": 0.04}, {**TIED, "ref": True}),
    ("zero-advantage rows bonus", {"entropy_coef": 0.05}, TIED),
    ("zero-advantage tokens", {}, {**TIED, "adv_shape": "BT"}),
    ("zero-advantage tokens sequence IS", {"importance_sampling_level": "sequence"}, {**TIED, "adv_shape": "BT"}),
    ("zero-advantage rows OPSM", {"off_policy_mask_threshold": 0.01}, TIED),
]


def settings_for(loss_type, extra):
    s = {"loss_type": loss_type, "max_completion_length": 40, **extra}
    if loss_type == "cispo":
        s.setdefault("epsilon_high", 1.05)
    return s


CASES, OPTION = option_cases(OPTIONS, LOSS_TYPES)


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


def rows_through_gradient_pass(monkeypatch) -> list[int]:
    """Spy: the number of rows each sparse backward sends through the gradient pass."""
    counted = []
    original = sparse_gradients.gradients_of_rows

    def spy(engine, x, head, selected, *rest):
        counted.append(selected.numel())
        return original(engine, x, head, selected, *rest)

    monkeypatch.setattr(sparse_gradients, "gradients_of_rows", spy)
    return counted


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("q", [0.2, 0.5])
def test_sparse_pass_runs_only_over_rows_with_a_gradient(q, dtype, monkeypatch):
    """beta = 0, no bonus, zero-advantage rows: exactly the masked-in tokens of the other rows go through the
    gradient pass, and every other token's hidden-state gradient is exactly 0. bf16 with H = 64 takes the
    token-outer pass (rows <= 2H), H = 16 in float64 the token-outer pass with a float sum."""
    counted = rows_through_gradient_pass(monkeypatch)
    x = make_inputs(
        seed=6, B=6, dtype=dtype, H=64 if dtype == torch.bfloat16 else 16, zero_advantage_rows=3, off_policy=False
    )  # on-policy: no token sits in a clipped branch
    settings = settings_for("dapo", {"top_entropy_quantile": q})
    out, out_grads = run_fused(FusedLinearGRPOLoss(compiled=False, schedule="sparse", **TILES, **settings), x)
    trained = out.entropy_mask & (x["advantages"] != 0).unsqueeze(1)
    assert counted == [int(trained.sum())]
    assert bool((out_grads["hidden"][~trained] == 0).all())
    assert bool((out_grads["hidden"][trained].abs().sum(-1) > 0).all())
    if dtype == torch.float64:
        ref, ref_grads = run_reference(x, settings)
        assert_matches(out, out_grads, ref, ref_grads, rtol=1e-10)


def test_sparse_pass_vocabulary_outer_beyond_2h_rows(monkeypatch):
    """bf16 with more selected rows than 2H: the vocabulary-outer pass over the selected rows (no float32
    [V, H] sum), still exactly 0 elsewhere."""
    counted = rows_through_gradient_pass(monkeypatch)
    x = make_inputs(seed=7, B=8, dtype=torch.bfloat16, H=8, zero_advantage_rows=3, off_policy=False)
    settings = settings_for("grpo", {"top_entropy_quantile": 0.8})
    out, out_grads = run_fused(FusedLinearGRPOLoss(compiled=False, schedule="sparse", **TILES, **settings), x)
    trained = out.entropy_mask & (x["advantages"] != 0).unsqueeze(1)
    assert counted == [int(trained.sum())] and counted[0] > 16
    assert bool((out_grads["hidden"][~trained] == 0).all())


def test_speed_schedule_skips_zero_advantage_rows(monkeypatch):
    """Rows at advantage 0 (beta = 0, no bonus) get statistics only: they are not in the gradient plan, their
    hidden-state gradient is exactly 0, and logp, entropy and metrics still cover them."""
    x = make_inputs(seed=8, B=6, dtype=torch.float64, zero_advantage_rows=3)
    settings = settings_for("grpo", {})
    plans = []
    original = speed.plan
    monkeypatch.setattr(speed, "plan", lambda *a: plans.append(original(*a)) or plans[-1])
    out, out_grads = run_fused(FusedLinearGRPOLoss(compiled=False, schedule="speed", **TILES, **settings), x)
    zero_rows = (x["advantages"] == 0).unsqueeze(1) & x["completion_mask"].bool()
    assert plans[0].gradient.active.numel() == int(x["completion_mask"].sum() - zero_rows.sum())
    assert plans[0].statistics_only.active.numel() == int(zero_rows.sum()) > 0
    assert bool((out_grads["hidden"][zero_rows] == 0).all())
    ref, ref_grads = run_reference(x, settings)
    assert_matches(out, out_grads, ref, ref_grads, rtol=1e-10)
