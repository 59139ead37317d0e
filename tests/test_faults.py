"""Value checks as device flags: a validated call waits for the device no more often than an unvalidated one,
bad inputs are still named before any lm_head work, and on a GPU (the deferred path, forced here on the CPU)
the check of a call's statistics is raised at the next call or by `check()`."""

from __future__ import annotations

import gc

import pytest
import torch
from cases import TILES, make_inputs

from compiled_grpo import FusedLinearGRPOLoss, faults, fused_linear_logprobs
from compiled_grpo.schedules import memory, sparse, speed

LOGPROBS_TILES = {k: TILES[k] for k in ("token_tile", "tail_tile", "vocab_tile", "sparse_tile")}


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that make the host wait for the device: a scalar read and an unsized nonzero."""

    WAITS = ("aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += any(str(func).startswith(w) for w in self.WAITS)
        return func(*args, **(kwargs or {}))


def loss_fn(schedule="auto", **settings):
    return FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **settings)


def call(fn, x, **overrides):
    x = {**x, **overrides}
    args = [x.pop(k) for k in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")]
    return fn(*args, **x)


@pytest.mark.parametrize(
    "schedule, settings", [("memory", {}), ("speed", {}), ("sparse", {"top_entropy_quantile": 0.5})]
)
def test_validation_adds_no_wait(schedule, settings):
    """Every value check of a call (inputs and statistics) is read with the plan's wait: a validated call makes
    as many reads as an unvalidated one (each check used to be a read of its own)."""
    x = make_inputs(dtype=torch.float32, bias=True, sampling=True, is_shape="BT")
    counts = {}
    for validate in (True, False):
        fn = loss_fn(schedule, validate=validate, **settings)
        with HostReads() as reads:
            call(fn, x)
        counts[validate] = reads.count
    assert counts[True] == counts[False]


def test_bad_input_is_named_before_any_lm_head_work(monkeypatch):
    x = make_inputs(dtype=torch.float32)
    ran = []
    monkeypatch.setattr(memory, "run", lambda *a: ran.append(1))
    ids = x["completion_ids"].clone()
    ids[0, 0] = x["weight"].shape[0] + 5
    with pytest.raises(ValueError, match=rf"completion_ids: id {x['weight'].shape[0] + 5} at an active position"):
        call(loss_fn("memory"), x, completion_ids=ids)
    assert not ran


@pytest.mark.parametrize("schedule", ["memory", "speed", "sparse"])
def test_deferred_statistics_check_raises_at_the_next_call(schedule, monkeypatch):
    """Deferred (as on a GPU): a NaN in hidden gives a call that returns, and the next call (before its lm_head
    work) or `check()` names hidden and says the error belongs to an earlier call."""
    monkeypatch.setattr(faults, "DEFER_ON_CPU", True)
    x = make_inputs(dtype=torch.float32, bias=True)
    hidden = x["hidden"].clone()
    hidden[0, 0, 3] = float("nan")
    fn = loss_fn(schedule)
    call(fn, x, hidden=hidden)  # returns: its statistics are read later
    module = {"memory": memory, "speed": speed, "sparse": sparse}[schedule]
    ran = []
    real_run = module.run
    monkeypatch.setattr(module, "run", lambda *a: ran.append(1) or real_run(*a))
    with pytest.raises(ValueError, match="hidden: NaN or infinite value at an active position .found after an earlier"):
        call(fn, x)
    assert not ran
    call(fn, x, hidden=hidden)
    with pytest.raises(ValueError, match="hidden: .*earlier call"):
        fn.check()
    fn.check()  # raised once
    out = call(fn, x)
    assert torch.isfinite(out.loss)


def test_deferred_check_names_the_weight_or_overflow(monkeypatch):
    monkeypatch.setattr(faults, "DEFER_ON_CPU", True)
    x = make_inputs(dtype=torch.float32, bias=True)
    weight = x["weight"].clone()
    weight[5, 1] = float("inf")
    fn = loss_fn("memory")
    call(fn, x, weight=weight)
    with pytest.raises(ValueError, match="weight: NaN or infinite value .found after an earlier call"):
        fn.check()
    # a weight freed since (a temporary cast, say) can no longer be read: the error says so
    call(fn, x, weight=weight.clone())
    gc.collect()
    with pytest.raises(ValueError, match="overflowed.*weight no longer alive to check"):
        fn.check()


def test_immediate_statistics_check_on_a_cpu():
    x = make_inputs(dtype=torch.float32, bias=True)
    bias = x["bias"].clone()
    bias[7] = float("-inf")
    with pytest.raises(ValueError, match=r"^bias: NaN or infinite value: "):
        call(loss_fn("speed"), x, bias=bias)


def test_primitive_deferred_check(monkeypatch):
    monkeypatch.setattr(faults, "DEFER_ON_CPU", True)
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(3, 37, 16, generator=g), torch.randn(1021, 16, generator=g)
    targets = torch.randint(0, 1021, (3, 37), generator=g)
    bad = hidden.clone()
    bad[1, 2, 0] = float("inf")
    fused_linear_logprobs(bad, weight, targets, compiled=False, **LOGPROBS_TILES)
    with pytest.raises(ValueError, match="hidden: NaN or infinite value at an active position .found after"):
        fused_linear_logprobs(hidden, weight, targets, compiled=False, **LOGPROBS_TILES)
    out = fused_linear_logprobs(hidden, weight, targets, compiled=False, **LOGPROBS_TILES)
    assert torch.isfinite(out.logp).all()
    with pytest.raises(ValueError, match="targets: id 5000 is outside"):
        fused_linear_logprobs(hidden, weight, targets.masked_fill(targets == targets[0, 0], 5000), compiled=False)


def test_primitive_validation_adds_no_wait():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(2, 29, 16, generator=g), torch.randn(1021, 16, generator=g)
    targets = torch.randint(0, 1021, (2, 29), generator=g).masked_fill(torch.rand(2, 29, generator=g) > 0.7, -100)
    counts = {}
    for validate in (True, False):
        with HostReads() as reads:
            out = fused_linear_logprobs(hidden, weight, targets, temperature=torch.full((2, 1), 0.7),
                                        compiled=False, validate=validate, **LOGPROBS_TILES)  # fmt: skip
        counts[validate] = reads.count
        assert torch.isfinite(out.logp).all()
    assert counts[True] == counts[False]
