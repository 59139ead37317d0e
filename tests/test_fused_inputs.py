"""Bad settings and inputs raise a clear error naming the argument; edge batches give TRL's values."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from cases import TILES, assert_matches, make_inputs, run_fused, run_reference

from audits.harness import pack
from compiled_grpo import LOSS_TYPES, FusedLinearGRPOLoss, GRPOLossConfig, fused_linear_grpo_loss, schedules
from compiled_grpo.loss import CONSTRUCTOR_OPTIONS


@pytest.mark.parametrize(
    "settings, name",
    [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"importance_sampling_level": "batch"}, "importance_sampling_level"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile"),
        ({"top_entropy_quantile": -0.1}, "top_entropy_quantile"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"loss_type": "dr_grpo"}, "max_completion_length"),
        ({"sapo_temperature_pos": 0.0}, "sapo_temperature_pos"),
        ({"sapo_temperature_neg": -1.0}, "sapo_temperature_neg"),
        ({"delta": 0.0}, "delta"),
        ({"epsilon_low": -0.1}, "epsilon_low"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"final_logit_softcapping": 0.0}, "final_logit_softcapping"),
        # settings that make the loss meaningless: refused with the reason
        ({"beta": -0.1}, "beta must be >= 0"),
        ({"delta": 0.5}, "delta must be > 1"),
        ({"delta": 1.0}, "delta must be > 1"),
        ({"vespo_k_pos": -1.0}, "vespo_k_pos must be >= 0"),
        ({"vespo_lambda_pos": -1.0}, "vespo_lambda_pos must be >= 0"),
        ({"vespo_k_neg": -1.0}, "vespo_k_neg"),
        ({"vespo_lambda_neg": -0.5}, "vespo_lambda_neg"),
        ({"off_policy_mask_threshold": -1.0}, "off_policy_mask_threshold must be >= 0"),
        ({"logit_scale": 0.0}, "logit_scale must be > 0"),
        ({"logit_scale": float("nan")}, "logit_scale"),
    ],
)
def test_bad_settings(settings, name):
    with pytest.raises(ValueError, match=name):
        FusedLinearGRPOLoss(**settings)
    with pytest.raises(ValueError, match=name):
        GRPOLossConfig(**settings)


def test_unknown_setting_and_schedule():
    with pytest.raises(TypeError, match="epsilon"):
        FusedLinearGRPOLoss(epsilon=0.2)
    with pytest.raises(ValueError, match="schedule"):
        FusedLinearGRPOLoss(schedule="fast")


def test_speed_with_entropy_quantile_says_why():
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        FusedLinearGRPOLoss(schedule="speed", top_entropy_quantile=0.2)


SHARED = {"captures": None}  # captures every call of a test shares (the `checks` fixture's captured case)


def call(x, settings=None, schedule="auto", **overrides):
    x = {**x, **overrides}
    args = [x.pop(k) for k in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")]
    captures = SHARED["captures"]
    fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, capture=captures is not None, **TILES,
                             **(settings or {}))  # fmt: skip
    if captures is not None:
        fn.captures = captures
    return fn(*args, **x)


def bad(x, name, settings=None, schedule="auto", **overrides):
    with pytest.raises((ValueError, TypeError), match=name):
        call(x, settings, schedule, **overrides)


def test_bad_inputs_name_the_argument():
    x = make_inputs(dtype=torch.float32)
    B, T, H = x["hidden"].shape
    V = x["weight"].shape[0]
    bad(x, "hidden", hidden=x["hidden"][0])
    bad(x, "weight", weight=x["weight"][:, :-1])
    bad(x, "weight", weight=x["weight"].double())
    bad(x, "bias", bias=torch.zeros(V + 1))
    bad(x, "completion_ids", completion_ids=x["completion_ids"][:, :-1])
    bad(x, "completion_ids", completion_ids=x["completion_ids"].float())
    bad(x, "completion_mask", completion_mask=x["completion_mask"][:-1])
    bad(x, "advantages", advantages=torch.zeros(B + 1))
    bad(x, "advantages", advantages=torch.ones(B, dtype=torch.bool))
    bad(x, "old_per_token_logps", old_per_token_logps=torch.zeros(B, T + 1))
    bad(x, "importance_sampling_ratio", importance_sampling_ratio=torch.ones(B, 2))
    bad(x, "ref_hidden", ref_hidden=x["hidden"][:, :-1])


@pytest.fixture(params=["eager", "captured"])
def checks(request, monkeypatch):
    """The value checks as eager reductions, or as replays (capture=True on a GPU): a stand-in for the CUDA
    graphs, shared by the calls of the test so that a layout's first call warms up and the later ones replay."""
    captures = None
    if request.param == "captured":
        from test_capture import ReplayOnTheStaticInputs

        from compiled_grpo.schedules import captured_call

        captures = ReplayOnTheStaticInputs()
        monkeypatch.setattr(captured_call, "LENGTH_BUCKET", 1)  # every length a bucket's: the checks are captured
    monkeypatch.setitem(SHARED, "captures", captures)
    yield captures
    assert captures is None or captures.replays_of["value checks"] > 0


def test_bad_values_at_active_positions(checks):
    x = make_inputs(dtype=torch.float32)
    m = x["completion_mask"].bool()
    ids = x["completion_ids"].clone()
    ids[0, 0] = x["weight"].shape[0]
    bad(x, "completion_ids", completion_ids=ids)
    ids[0, 0] = -1
    bad(x, "completion_ids", completion_ids=ids)
    bad(x, "completion_mask", completion_mask=x["completion_mask"] * 2)
    adv = x["advantages"].clone()
    adv[0] = float("nan")
    bad(x, "advantages", advantages=adv)
    old = x["old_per_token_logps"].clone()
    old[0, 0] = float("inf")
    bad(x, "old_per_token_logps", old_per_token_logps=old)
    old[0, 0] = 0.5  # a probability above 1
    bad(x, "old_per_token_logps", old_per_token_logps=old)
    ref = x["old_per_token_logps"].clone()
    ref[0, 0] = 0.2
    with pytest.raises(ValueError, match="ref_per_token_logps: a value above 0"):
        call(x, {"beta": 0.1}, ref_per_token_logps=ref)
    old[0, 0] = 0.005  # rounding of a log-probability near 0: accepted
    assert torch.isfinite(call(x, {}, old_per_token_logps=old).loss)
    ratio = torch.ones_like(old)
    ratio[0, 0] = -0.5
    bad(x, "importance_sampling_ratio", importance_sampling_ratio=ratio)
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        call(x, {"beta": 0.1})
    # masked positions may hold anything; NaN sampling log-probs are "unscored" and allowed when active
    poisoned = torch.where(m, x["old_per_token_logps"], float("nan"))
    ids = torch.where(m, x["completion_ids"], 10**9)
    sampling = torch.full_like(poisoned, float("nan"))
    out = call(x, {"off_policy_mask_threshold": 0.1}, old_per_token_logps=poisoned, completion_ids=ids,
               sampling_per_token_logps=sampling)  # fmt: skip
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("schedule", ["memory", "speed", "sparse"])
def test_non_finite_hidden_or_weight_is_named(schedule, checks):
    """NaN or inf in hidden (at an active position), weight or bias: an error naming it, never a NaN loss; at a
    masked position of hidden, anything goes."""
    x = make_inputs(dtype=torch.float32, bias=True)
    m = x["completion_mask"].bool()
    hidden = x["hidden"].clone()
    hidden[0, 0, 3] = float("nan")
    bad(x, "hidden", {}, schedule, hidden=hidden)
    weight = x["weight"].clone()
    weight[5, 1] = float("inf")
    bad(x, "weight", {}, schedule, weight=weight)
    bias = x["bias"].clone()
    bias[7] = float("-inf")
    bad(x, "bias", {}, schedule, bias=bias)
    masked = torch.where(m.unsqueeze(-1), x["hidden"], float("nan"))
    assert torch.isfinite(call(x, {}, schedule, hidden=masked).loss)


def test_inputs_on_another_device_are_named():
    x = make_inputs(dtype=torch.float32, bias=True)
    on_meta = lambda t: torch.empty_like(t, device="meta")
    for name in ("weight", "bias", "completion_ids", "advantages", "old_per_token_logps"):
        with pytest.raises(TypeError, match=f"{name}: is on meta, hidden on cpu"):
            call(x, **{name: on_meta(x[name])})


@pytest.mark.compiled
@pytest.mark.parametrize("schedule", ["memory", "speed"])
def test_validate_false_out_of_range_id_does_not_end_the_process(schedule):
    """Unchecked ids outside the vocabulary give meaningless values for those tokens, not a device-side assert."""
    x = make_inputs(dtype=torch.float32)
    x["completion_ids"][0, 0] = x["weight"].shape[0] + 5
    loss_fn = FusedLinearGRPOLoss(compiled=True, validate=False, schedule=schedule, **TILES)
    out, _ = run_fused(loss_fn, x)
    assert out.per_token_logps.shape == x["completion_ids"].shape


def test_validate_false_skips_host_checks():
    x = make_inputs(dtype=torch.float32)
    adv = x["advantages"].clone()
    adv[0] = float("nan")
    x.pop("advantages")
    args = [x.pop(k) for k in ("hidden", "weight", "completion_ids", "completion_mask")]
    FusedLinearGRPOLoss(compiled=False, validate=False, **TILES)(*args, adv, **x)  # no error raised


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("schedule", ["memory", "speed", "sparse"])
@pytest.mark.parametrize("edge", ["all masked", "one token", "zero advantages", "masked rows"])
def test_edge_batches_match_reference(loss_type, schedule, edge):
    x = make_inputs(seed=5, dtype=torch.float64, B=4, T=9)
    m = x["completion_mask"]
    if edge == "all masked":
        x["completion_mask"] = torch.zeros_like(m)
    elif edge == "one token":
        x["completion_mask"] = torch.zeros_like(m)
        x["completion_mask"][2, 4] = 1
    elif edge == "zero advantages":
        x["advantages"] = torch.zeros_like(x["advantages"])
    else:
        x["completion_mask"][1:3] = 0
    settings = {"loss_type": loss_type, "max_completion_length": 9, "entropy_coef": 0.02}
    if schedule != "speed":
        settings["top_entropy_quantile"] = 0.5
    ref, ref_grads = run_reference(x, settings)
    out, out_grads = run_fused(FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **settings), x)
    assert math.isfinite(float(out.loss.detach()))
    if edge == "all masked":
        assert float(out.loss.detach()) == 0.0
        if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            assert math.isnan(float(out.metrics["clip_ratio/low_min"]))  # as TRL reports it
    assert_matches(out, out_grads, ref, ref_grads, rtol=1e-10)


def test_frozen_lm_head_skips_its_gradient():
    x = make_inputs(dtype=torch.float32, bias=True)
    for schedule in ("memory", "speed", "sparse"):
        h = x["hidden"].clone().requires_grad_()
        w, b = x["weight"].clone(), x["bias"].clone()
        loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES)
        out = loss_fn(h, w, x["completion_ids"], x["completion_mask"], x["advantages"], bias=b)
        out.loss.backward()
        assert h.grad is not None and w.grad is None and b.grad is None


def test_reference_logps_streamed_from_a_reference_head():
    """beta != 0 without ref_per_token_logps: computed from ref_hidden / ref_weight (no grad)."""
    x = make_inputs(dtype=torch.float64, seed=8)
    g = torch.Generator().manual_seed(9)
    ref_hidden = x["hidden"] + 0.1 * torch.randn(x["hidden"].shape, generator=g, dtype=torch.float64)
    ref_weight = x["weight"] + 0.05 * torch.randn(x["weight"].shape, generator=g, dtype=torch.float64)
    for rh, rw in ((ref_hidden, None), (ref_hidden, ref_weight), (None, ref_weight)):
        ref_logps = run_reference(
            {**x, "hidden": x["hidden"] if rh is None else rh, "weight": x["weight"] if rw is None else rw}, {}
        )[0].per_token_logps
        settings = {"beta": 0.1}
        expected, expected_grads = run_reference({**x, "ref_per_token_logps": ref_logps}, settings)
        loss_fn = FusedLinearGRPOLoss(compiled=False, **TILES, **settings)
        out, out_grads = run_fused(loss_fn, x, ref_hidden=rh, ref_weight=rw)
        assert_matches(out, out_grads, expected, expected_grads, rtol=1e-10)


def test_functional_form_and_per_call_entropy_coef():
    x = make_inputs(dtype=torch.float64)
    a = run_reference(x, {"entropy_coef": 0.3})[0]
    y = dict(x)
    args = [y.pop(k) for k in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")]
    b = fused_linear_grpo_loss(*args, **y, entropy_coef=0.3, token_tile=64, compiled=False)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-10, atol=1e-12)
    c = FusedLinearGRPOLoss(compiled=False, entropy_coef=0.0)(*args, **y, entropy_coef=0.3)
    torch.testing.assert_close(c.loss, a.loss, rtol=1e-10, atol=1e-12)


def test_autocast_runs_the_gemms_in_the_autocast_dtype():
    """fp32 master weights under bf16 autocast: the same as bf16 inputs, with fp32 gradients for the weight."""
    x = make_inputs(dtype=torch.float32, seed=4, H=32)
    y = dict(x)
    args = [y.pop(k) for k in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")]
    loss_fn = FusedLinearGRPOLoss(compiled=False, **TILES)
    w32 = args[1].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = loss_fn(args[0], w32, *args[2:], **y)
    a.loss.backward()
    w16 = args[1].to(torch.bfloat16).requires_grad_()
    b = loss_fn(args[0].to(torch.bfloat16), w16, *args[2:], **y)
    b.loss.backward()
    assert w32.grad.dtype == torch.float32
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(w32.grad, w16.grad.float())


# torch.distributed is not initialized here: a group object stands for a group of this process alone, so
# nothing is communicated and the result is the single-process one.
ONE_PROCESS_GROUP = object()


@pytest.mark.parametrize(
    "settings, options, expected",
    [
        ({}, {}, "speed"),  # the speed schedule's workspace fits the default budget
        ({}, {"logits_budget_bytes": 1 << 10}, "memory"),  # ... and not a 1 KiB one
        ({"top_entropy_quantile": 0.5}, {}, "sparse"),  # the threshold needs every entropy first
        ({"top_entropy_quantile": 0.5}, {"logits_budget_bytes": 1 << 10}, "memory"),
        ({}, {"vocab_parallel_group": ONE_PROCESS_GROUP}, "speed"),  # a vocabulary-parallel head: the same rule
        ({"top_entropy_quantile": 0.5}, {"vocab_parallel_group": ONE_PROCESS_GROUP}, "sparse"),
    ],
)
def test_auto_schedule_choice(settings, options, expected, monkeypatch):
    ran = []
    for name in ("speed", "memory", "sparse"):
        module = getattr(schedules, name)
        monkeypatch.setattr(module, "run", lambda *a, f=module.run, n=name: ran.append(n) or f(*a))
    x = make_inputs(seed=8, dtype=torch.float64)
    loss_fn = FusedLinearGRPOLoss(compiled=False, **options, **TILES, **settings)
    out, grads = run_fused(loss_fn, x)
    ref, ref_grads = run_reference(x, settings)
    assert ran == [expected]
    assert_matches(out, grads, ref, ref_grads, rtol=1e-10)


@pytest.mark.parametrize("budget, zero_rows, expected", [("lean", 0, "speed"), (1 << 10, 2, "sparse")])
def test_auto_under_a_tight_budget(budget, zero_rows, expected, monkeypatch):
    """Where the speed schedule's usual workspace does not fit, "auto" takes it with one dW GEMM per tile if that
    fits; else sparse when some rows are at advantage 0 (their gradient is known to be 0), memory otherwise."""
    x = make_inputs(seed=8, dtype=torch.float64, zero_advantage_rows=zero_rows)
    V, H = x["weight"].shape
    tile = TILES["speed_tile"]
    kept = x["weight"].element_size()  # the logits gradients kept for dW, in the weight's dtype
    lean = 4 * tile * V + kept * tile * V + 4 * V * H  # speed_group (256 on a CPU) > tile: the usual plan is larger
    plans = []
    for name in ("speed", "memory", "sparse"):
        module = getattr(schedules, name)
        monkeypatch.setattr(module, "run", lambda *a, f=module.run, n=name: plans.append((n, a[3])) or f(*a))
    loss_fn = FusedLinearGRPOLoss(compiled=False, logits_budget_bytes=lean if budget == "lean" else budget, **TILES)
    out, grads = run_fused(loss_fn, x)
    ref, ref_grads = run_reference(x, {})
    assert [n for n, _ in plans] == [expected]
    if expected == "speed":
        assert plans[0][1].group == tile >= plans[0][1].tile
    assert_matches(out, grads, ref, ref_grads, rtol=1e-10)


def test_misspelt_keywords_name_the_call_and_suggest():
    x = make_inputs(dtype=torch.float64)
    with pytest.raises(TypeError, match=r"__call__\(\).*'old_per_token_logp'.*did you mean 'old_per_token_logps'"):
        call(x, old_per_token_logp=x["old_per_token_logps"])
    with pytest.raises(TypeError, match=r"FusedLinearGRPOLoss\(\).*did you mean 'top_entropy_quantile'"):
        FusedLinearGRPOLoss(top_entropy_quantil=0.2)
    with pytest.raises(TypeError, match=r"FusedLinearGRPOLoss\(\).*did you mean 'speed_tile'"):
        FusedLinearGRPOLoss(speed_tiles=64)
    with pytest.raises(TypeError, match=r"fused_linear_grpo_loss\(\).*did you mean 'num_items_in_batch'"):
        fused_linear_grpo_loss(*(x[k] for k in ("hidden", "weight", "completion_ids", "completion_mask",
                                                "advantages")), num_item_in_batch=3)  # fmt: skip


OPTION_VALUES = {
    "compiled": False,
    "schedule": "memory",
    "validate": False,
    "token_tile": 16,
    "tail_tile": 8,
    "vocab_tile": 128,
    "stats_rows": 16,
    "speed_tile": 32,
    "speed_group": 32,
    "sparse_tile": 16,
    "logits_budget_bytes": 1 << 20,
    "process_group": ONE_PROCESS_GROUP,
    "vocab_parallel_group": ONE_PROCESS_GROUP,
    "sequence_parallel_group": ONE_PROCESS_GROUP,  # no process group: the single-process loss
    "capture": True,  # on a CPU, calls run as without it
    "round_logits": True,  # float64 inputs: nothing to round
}


@pytest.mark.parametrize("option", CONSTRUCTOR_OPTIONS)
def test_functional_form_takes_every_constructor_option(option, monkeypatch):
    built = []
    init = FusedLinearGRPOLoss.__init__
    monkeypatch.setattr(FusedLinearGRPOLoss, "__init__", lambda self, **k: built.append(k) or init(self, **k))
    x = make_inputs(seed=4, dtype=torch.float64)
    settings = {"loss_type": "grpo", "beta": 0.04}
    value = OPTION_VALUES[option]
    options = {"compiled": False, **TILES, option: value}
    out, grads = run_fused(
        lambda *a, **k: fused_linear_grpo_loss(*a, **k, **options, **settings),
        x,
        ref_per_token_logps=x["old_per_token_logps"],
    )
    assert built[0][option] is value
    ref, ref_grads = run_reference({**x, "ref_per_token_logps": x["old_per_token_logps"]}, settings)
    assert_matches(out, grads, ref, ref_grads, rtol=1e-10)


@pytest.mark.parametrize(
    "settings, schedule, expected",
    [
        ({}, "auto", "speed"),
        ({"top_entropy_quantile": 0.2}, "auto", "sparse"),
        ({}, "memory", "memory"),
        ({}, "sparse", "sparse"),
    ],
)
def test_the_output_names_the_schedule_that_ran(settings, schedule, expected):
    x = make_inputs(seed=8)
    assert call(x, settings, schedule).schedule == expected
    budget = FusedLinearGRPOLoss(compiled=False, logits_budget_bytes=1, **TILES, **settings)  # nothing fits: memory
    args = [x[k] for k in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")]
    if schedule == "auto":
        assert budget(*args, old_per_token_logps=x["old_per_token_logps"]).schedule == "memory"


def test_sequence_parallel_refusals():
    """A sequence-parallel loss says what it does not take: the speed schedule (a tile needs every token of a
    sequence), a vocabulary-parallel head, a packed call."""
    with pytest.raises(ValueError, match="schedule='speed'"):
        FusedLinearGRPOLoss(schedule="speed", sequence_parallel_group=ONE_PROCESS_GROUP)
    with pytest.raises(ValueError, match="vocab_parallel_group"):
        FusedLinearGRPOLoss(sequence_parallel_group=ONE_PROCESS_GROUP, vocab_parallel_group=ONE_PROCESS_GROUP)
    x = make_inputs(dtype=torch.float64)
    packed = pack(x)
    loss_fn = FusedLinearGRPOLoss(compiled=False, sequence_parallel_group=ONE_PROCESS_GROUP, **TILES)
    args = [packed.pop(k) for k in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")]
    with pytest.raises(ValueError, match="segment_ids: a packed call does not take a sequence_parallel_group"):
        loss_fn(*args, **packed)


@pytest.mark.parametrize(
    "overrides, name, error",
    [
        ({"entropy_coef": math.nan}, "entropy_coef", ValueError),
        ({"entropy_coef": math.inf}, "entropy_coef", ValueError),
        ({"entropy_coef": "0.1"}, "entropy_coef", TypeError),
        ({"entropy_coef": torch.tensor([0.1, 0.2])}, "entropy_coef", ValueError),
        ({"entropy_coef": torch.tensor(1)}, "entropy_coef", TypeError),
        ({"entropy_coef": torch.tensor(math.nan)}, "entropy_coef", ValueError),
        ({"num_items_in_batch": -5}, "num_items_in_batch", ValueError),
        ({"num_items_in_batch": math.nan}, "num_items_in_batch", ValueError),
        ({"num_items_in_batch": torch.tensor(-5.0)}, "num_items_in_batch", ValueError),
        ({"num_items_in_batch": torch.tensor([3, 4])}, "num_items_in_batch", ValueError),
        ({"num_items_in_batch": "12"}, "num_items_in_batch", TypeError),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps", ValueError),
        ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps", TypeError),
        ({"steps_per_generation": -1}, "steps_per_generation", ValueError),
        ({"num_processes": 0}, "num_processes", ValueError),
        ({"vocab_start": 10}, "vocab_start", ValueError),
        ({"vocab_start": -1}, "vocab_start", ValueError),
        ({"vocab_start": 1.0}, "vocab_start", TypeError),
    ],
)
def test_bad_call_arguments_name_the_argument(overrides, name, error):
    """Per-call numbers (given as Python numbers or one-element tensors) are checked like the tensors."""
    x = make_inputs(dtype=torch.float32)
    with pytest.raises(error, match=name):
        call(x, **overrides)


@pytest.mark.parametrize(
    "options, name, error",
    [
        ({"logits_budget_bytes": -1}, "logits_budget_bytes", ValueError),
        ({"logits_budget_bytes": 1.5e9}, "logits_budget_bytes", TypeError),
        ({"compiled": "no"}, "compiled", TypeError),
        ({"validate": 0}, "validate", TypeError),
        ({"capture": None}, "capture", TypeError),
        ({"round_logits": "yes"}, "round_logits", TypeError),
        ({"temperature": torch.tensor([0.7, 0.8])}, "temperature", ValueError),
    ],
)
def test_bad_constructor_options_name_the_option(options, name, error):
    with pytest.raises(error, match=name):
        FusedLinearGRPOLoss(**options)


def test_a_one_element_tensor_setting_means_its_number():
    assert FusedLinearGRPOLoss(temperature=torch.tensor(0.5)).config.temperature == 0.5
    assert FusedLinearGRPOLoss(epsilon_low=torch.tensor([0.25])).config.epsilon_low == 0.25


def test_row_advantages_as_b1_equal_b():
    """[B, 1] advantages (TRL's own layout) give the [B] call's loss, gradients and metrics, on every schedule."""
    x = make_inputs(dtype=torch.float64)
    for schedule in ("memory", "speed", "sparse"):
        loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, loss_type="grpo", **TILES)
        out_b, grads_b = run_fused(loss_fn, x)
        out_b1, grads_b1 = run_fused(loss_fn, {**x, "advantages": x["advantages"].unsqueeze(1)})
        assert torch.equal(out_b.loss, out_b1.loss)
        assert out_b.metrics.keys() == out_b1.metrics.keys()
        for k, g in grads_b.items():
            assert torch.equal(g, grads_b1[k]), (schedule, k)


def test_dr_grpo_warns_where_completions_exceed_max_completion_length():
    """More completion positions than max_completion_length: warned with what TRL computes (rows x the setting),
    and computed as TRL does; none at the sampler's maximum."""
    x = make_inputs(dtype=torch.float64, T=12)
    short = FusedLinearGRPOLoss(compiled=False, loss_type="dr_grpo", max_completion_length=8, **TILES)
    with pytest.warns(UserWarning, match=r"12 positions, more than max_completion_length=8; .* rows x 8") as seen:
        out, _ = run_fused(short, x)
    assert seen[0].filename.endswith("harness.py")  # the caller's line (the audit harness here), not the library's
    ref, _ = run_reference(x, {"loss_type": "dr_grpo", "max_completion_length": 8})
    assert torch.allclose(out.loss, ref.loss, rtol=1e-10, atol=0)
    exact = FusedLinearGRPOLoss(compiled=False, loss_type="dr_grpo", max_completion_length=12, **TILES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_fused(exact, x)
