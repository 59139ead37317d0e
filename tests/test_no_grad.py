"""Without grad mode (evaluation, old and reference log-probs): every schedule runs under `torch.no_grad()` and
`torch.inference_mode()`, gives the grad-mode call's loss and metrics, and per-token log-probs and entropies
bitwise equal to it. Inputs that do not require grad, or only some of them, get the grad-mode gradients of
those that do."""

from __future__ import annotations

import contextlib

import pytest
import torch
from cases import TILES, make_inputs

from audits.harness import POSITIONAL
from compiled_grpo import FusedLinearGRPOLoss

CONTEXTS = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
FAMILIES = [  # one setting per family of the objective: clipped token level, sequence-coupled, KL, quantile
    {"loss_type": "dapo"},
    {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04, "entropy_coef": 0.01},
    {"loss_type": "vespo", "off_policy_mask_threshold": 0.1},
    {"loss_type": "bnpo", "top_entropy_quantile": 0.5},
]


def schedules_of(settings):
    quantile = settings.get("top_entropy_quantile", 1.0) < 1
    return ["auto", "memory", "sparse"] if quantile else ["auto", "memory", "speed", "sparse"]


CASES = [pytest.param(s, sched, id=f"{s['loss_type']}-{sched}") for s in FAMILIES for sched in schedules_of(s)]


def call(loss_fn, x, requires_grad=("hidden", "weight", "bias"), context=contextlib.nullcontext):
    y = {k: v.detach().clone().requires_grad_(k in requires_grad) if k in ("hidden", "weight", "bias") else v
         for k, v in x.items()}  # fmt: skip
    with context():
        out = loss_fn(*(y[k] for k in POSITIONAL), **{k: v for k, v in y.items() if k not in POSITIONAL})
    return out, y


def assert_same_outputs(out, grad_mode):
    assert torch.equal(out.per_token_logps, grad_mode.per_token_logps)
    assert torch.equal(out.entropy, grad_mode.entropy)
    if grad_mode.entropy_mask is None:
        assert out.entropy_mask is None
    else:
        assert torch.equal(out.entropy_mask, grad_mode.entropy_mask)
    torch.testing.assert_close(out.loss, grad_mode.loss.detach(), rtol=1e-12, atol=0.0)
    assert set(out.metrics) == set(grad_mode.metrics)
    for name, value in grad_mode.metrics.items():
        torch.testing.assert_close(out.metrics[name], value, rtol=1e-12, atol=0.0, equal_nan=True, msg=name)


def inputs_for(settings, dtype=torch.float64):
    return make_inputs(seed=5, dtype=dtype, bias=True, ref=True, sampling=True, zero_advantage_rows=1)


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("settings, schedule", CASES)
def test_without_grad_mode_equals_grad_mode(settings, schedule, context):
    x = inputs_for(settings)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **settings)
    grad_mode, _ = call(loss_fn, x)
    out, _ = call(loss_fn, x, context=CONTEXTS[context])
    assert not out.loss.requires_grad
    assert_same_outputs(out, grad_mode)


@pytest.mark.parametrize("settings, schedule", [c for c in CASES if c.values[1] != "auto"])
def test_inputs_without_requires_grad(settings, schedule):
    x = inputs_for(settings)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **settings)
    grad_mode, _ = call(loss_fn, x)
    out, _ = call(loss_fn, x, requires_grad=())
    assert not out.loss.requires_grad
    assert_same_outputs(out, grad_mode)


@pytest.mark.parametrize("wanted", [("weight",), ("hidden",), ("hidden", "bias")], ids="+".join)
@pytest.mark.parametrize("settings, schedule", [c for c in CASES if c.values[1] != "auto"])
def test_some_inputs_require_grad(settings, schedule, wanted):
    """Gradients of the inputs that require grad equal the grad-mode call's; the others get none."""
    x = inputs_for(settings)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **settings)
    grad_mode, y_all = call(loss_fn, x)
    grad_mode.loss.backward()
    out, y = call(loss_fn, x, requires_grad=wanted)
    assert_same_outputs(out, grad_mode)
    out.loss.backward()
    for name in ("hidden", "weight", "bias"):
        if name in wanted:
            torch.testing.assert_close(y[name].grad, y_all[name].grad, rtol=1e-10, atol=1e-12, msg=name)
        else:
            assert y[name].grad is None, name


@pytest.mark.compiled
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("schedule", ["speed", "memory", "sparse"])
def test_compiled_without_grad_mode(schedule, context):
    settings = {"loss_type": "dapo", "entropy_coef": 0.01}
    x = inputs_for(settings, torch.float32)
    loss_fn = FusedLinearGRPOLoss(compiled=True, schedule=schedule, **TILES, **settings)
    grad_mode, _ = call(loss_fn, x)
    out, _ = call(loss_fn, x, context=CONTEXTS[context])
    assert_same_outputs(out, grad_mode)


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("schedule", ["speed", "memory", "sparse"])
def test_rounded_logits_without_grad_mode(schedule, context):
    """round_logits=True (bfloat16 inputs): the same outputs without grad mode as with it."""
    settings = {"loss_type": "dapo", "top_entropy_quantile": 0.5 if schedule == "sparse" else 1.0}
    x = inputs_for(settings, torch.bfloat16)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, round_logits=True, beta=0.04, **TILES, **settings)
    grad_mode, _ = call(loss_fn, x)
    out, _ = call(loss_fn, x, context=CONTEXTS[context])
    assert_same_outputs(out, grad_mode)


@pytest.mark.parametrize("context", CONTEXTS)
def test_rounded_primitive_without_grad_mode(context):
    """fused_linear_logprobs(round_logits=True) on bf16 outside grad mode: the grad-mode call's bits (old and
    reference log-probs that compiled_fused_head(round_logits=True) scores agree with the policy's)."""
    from compiled_grpo import fused_linear_logprobs

    x = make_inputs(seed=6, dtype=torch.bfloat16, bias=True, logit_std=4.0)
    tiles = {k: TILES[k] for k in ("token_tile", "tail_tile", "vocab_tile")}
    primitive = lambda: fused_linear_logprobs(x["hidden"], x["weight"].detach().requires_grad_(), x["completion_ids"],
                                              bias=x["bias"], compiled=False, round_logits=True, **tiles)  # fmt: skip
    trained = primitive()
    with CONTEXTS[context]():
        scored = primitive()
    assert torch.equal(scored.logp, trained.logp) and torch.equal(scored.entropy, trained.entropy)
