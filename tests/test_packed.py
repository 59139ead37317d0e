"""Packed batches (`segment_ids`): the fused loss against the packed float64 reference and against the padded
call on the same data, every loss type and schedule; tree-packed rows (`row_index`) sharing hidden rows."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
from cases import TILES, assert_matches, make_inputs, option_cases, run_fused
from torch._dynamo.utils import counters

from audits.harness import leaves, pack, run_packed_reference
from compiled_grpo import LOSS_TYPES, FusedLinearGRPOLoss

warnings.filterwarnings("ignore", message=".* is meant for importance_sampling_level")


def packed_reference(p: dict, settings: dict):
    return run_packed_reference(p, settings)


OPTIONS = [
    ("defaults", {}, {}),
    ("sequence IS", {"importance_sampling_level": "sequence"}, {}),
    ("q=0.5", {"top_entropy_quantile": 0.5}, {}),
    ("beta", {"beta": 0.04}, {"ref": True}),
    ("IS ratio [B,T]", {}, {"is_shape": "BT"}),
    ("IS ratio per sequence", {}, {"is_shape": "B"}),
    ("OPSM", {"off_policy_mask_threshold": 0.05}, {"sampling": True}),
    ("entropy bonus", {"entropy_coef": 0.05}, {}),
    ("advantages per token", {}, {"adv_shape": "BT"}),
    ("zero-advantage rows", {}, {"zero_advantage_rows": 2, "B": 5}),
]


CASES, OPTION = option_cases(OPTIONS, LOSS_TYPES)


def settings_for(loss_type, extra, T):
    s = {"loss_type": loss_type, "max_completion_length": T, **extra}
    if loss_type == "cispo":
        s.setdefault("epsilon_high", 1.05)
    return s


@pytest.mark.parametrize("loss_type, name, schedule", CASES)
def test_packed_matches_packed_reference(loss_type, name, schedule):
    """Padding-free targets (masked positions dropped, a sequence with no target kept by num_sequences)."""
    extra, inputs = OPTION[name]
    x = make_inputs(seed=21, dtype=torch.float64, bias=True, **inputs)
    settings = settings_for(loss_type, extra, x["completion_mask"].shape[1])
    p = pack(x)
    ref, ref_grads = packed_reference(p, settings)
    out, grads = run_fused(FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **settings), p)
    assert out.per_token_logps.shape == p["completion_ids"].shape
    assert_matches(out, grads, ref, ref_grads, rtol=1e-10)


@pytest.mark.parametrize("schedule", ["memory", "speed", "sparse"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_packed_equals_the_padded_call(loss_type, schedule):
    """Every position packed (masked ones with mask 0): the layout is the padded batch's, so loss, metrics,
    per-token outputs and gradients equal the padded call's."""
    x = make_inputs(seed=22, dtype=torch.float64, is_shape="BT", sampling=True)
    settings = settings_for(loss_type, {"off_policy_mask_threshold": 0.05}, x["completion_mask"].shape[1])
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **settings)
    padded, padded_grads = run_fused(loss_fn, x)
    packed, packed_grads = run_fused(loss_fn, pack(x, keep_masked=True))
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-12, atol=1e-14)
    for k, v in padded.metrics.items():
        torch.testing.assert_close(packed.metrics[k], v, rtol=1e-12, atol=1e-14, equal_nan=True)
    torch.testing.assert_close(packed.per_token_logps, padded.per_token_logps.reshape(-1), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(packed_grads["hidden"], padded_grads["hidden"].reshape(-1, 16), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(packed_grads["weight"], padded_grads["weight"], rtol=1e-12, atol=1e-14)


def tree_packed(seed: int = 23):
    """Two groups of three completions; in each group the three first tokens are predicted by one shared hidden
    row (the prompt's last position), as TRL's tree packing emits. Returns (inputs, shared rows)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [4, 6, 3, 5, 5, 2]
    rows, row_index, segment_ids = 0, [], []
    for group in range(2):
        shared = rows
        rows += 1
        for i in range(3):
            s = group * 3 + i
            n = lengths[s]
            row_index += [shared] + list(range(rows, rows + n - 1))
            rows += n - 1
            segment_ids += [s] * n
    M, H, V = len(row_index), 16, 1021
    x = {
        "hidden": torch.randn(rows, H, generator=g, dtype=torch.float64),
        "weight": torch.randn(V, H, generator=g, dtype=torch.float64) / 4,
        "completion_ids": torch.randint(0, V, (M,), generator=g),
        "completion_mask": (torch.rand(M, generator=g) > 0.15).long(),
        "advantages": torch.randn(6, generator=g, dtype=torch.float64),
        "segment_ids": torch.tensor(segment_ids),
        "row_index": torch.tensor(row_index),
    }
    x["old_per_token_logps"] = -5.0 + torch.randn(M, generator=g, dtype=torch.float64) * 0.1
    return x


@pytest.mark.parametrize("schedule", ["memory", "speed", "sparse"])
@pytest.mark.parametrize("loss_type", ["grpo", "vespo", "dapo"])
def test_one_target_per_sequence_and_an_empty_sequence(loss_type, schedule):
    """Sequences of one target and one of none: per-sequence metrics still average over every sequence, as in a
    padded batch (the layout is at least two positions wide)."""
    x = make_inputs(seed=28, B=4, T=1, dtype=torch.float64, empty_row=True)
    settings = settings_for(loss_type, {}, 1)
    p = pack(x)
    ref, ref_grads = packed_reference(p, settings)
    out, grads = run_fused(FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **settings), p)
    assert_matches(out, grads, ref, ref_grads, rtol=1e-10)
    # the padded batch with a second, masked position: the same loss and metrics
    widen = lambda t, fill: torch.cat([t, torch.full_like(t, fill)], 1)
    wide = {k: widen(v, 0) if v.dim() == 2 else v for k, v in x.items() if k not in ("hidden", "weight")}
    wide.update(hidden=torch.cat([x["hidden"]] * 2, 1), weight=x["weight"])
    padded, _ = run_fused(FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **settings), wide)
    torch.testing.assert_close(out.loss, padded.loss)
    for name, value in padded.metrics.items():
        torch.testing.assert_close(out.metrics[name], value, equal_nan=True)


@pytest.mark.parametrize("schedule", ["memory", "speed", "sparse"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "luspo"])
def test_tree_packed_rows_shared_by_several_targets(loss_type, schedule):
    x = tree_packed()
    level = "sequence" if loss_type == "luspo" else "token"
    settings = {"loss_type": loss_type, "importance_sampling_level": level, "entropy_coef": 0.01}
    ref, ref_grads = packed_reference(x, settings)
    out, grads = run_fused(FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **settings), x)
    assert_matches(out, grads, ref, ref_grads, rtol=1e-10)


def test_packed_inputs_name_the_argument():
    p = pack(make_inputs(seed=24, dtype=torch.float64))
    loss_fn = FusedLinearGRPOLoss(compiled=False, **TILES)

    def bad(name, **overrides):
        y = {**leaves(p), **overrides}
        args = [y.pop(k) for k in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")]
        with pytest.raises((ValueError, TypeError), match=name):
            loss_fn(*args, **y)

    M = p["completion_ids"].numel()
    bad("hidden", hidden=p["hidden"].unsqueeze(0))
    bad("completion_mask", completion_mask=p["completion_mask"][:-1])
    bad("segment_ids", segment_ids=p["segment_ids"].float())
    bad("segment_ids", num_sequences=1)  # sequence ids beyond num_sequences
    bad("advantages", advantages=torch.zeros(M + 1, dtype=torch.float64))
    bad("row_index", row_index=torch.full((M,), 10**6))
    bad("row_index", row_index=torch.full((M,), -1))
    bad("segment_ids", segment_ids=p["segment_ids"].to("meta"))  # neither hidden's device nor the host
    bad("old_per_token_logps", old_per_token_logps=p["old_per_token_logps"][:-2])
    with pytest.raises(ValueError, match="segment_ids"):
        x = make_inputs(seed=24, dtype=torch.float64)
        run_fused(loss_fn, x, num_sequences=3)


@pytest.mark.compiled
def test_packed_calls_reuse_the_compiled_tiles():
    """After a padded warm-up, packed calls of other packings compile nothing new."""
    torch._dynamo.reset()
    counters.clear()
    tiles = {"token_tile": 64, "tail_tile": 64, "vocab_tile": 256, "speed_tile": 64, "sparse_tile": 64}
    for schedule in ("speed", "sparse"):
        loss_fn = FusedLinearGRPOLoss(compiled=True, schedule=schedule, **tiles, top_entropy_quantile=0.5 if
                                      schedule == "sparse" else 1.0)  # fmt: skip
        run_fused(loss_fn, make_inputs(seed=25, dtype=torch.float32, bias=True))
    warm = counters["stats"]["unique_graphs"]
    for schedule, seed, B in (("speed", 26, 4), ("sparse", 27, 6)):
        loss_fn = FusedLinearGRPOLoss(compiled=True, schedule=schedule, **tiles, top_entropy_quantile=0.5 if
                                      schedule == "sparse" else 1.0)  # fmt: skip
        run_fused(loss_fn, pack(make_inputs(seed=seed, B=B, dtype=torch.float32, bias=True)))
    assert counters["stats"]["unique_graphs"] == warm
