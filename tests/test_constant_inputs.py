"""Per-token inputs that carry a graph (advantages, old and reference log-probs, the IS ratio requiring grad) are
constants on every schedule, as in TRL; and a second backward through any schedule (retain_graph, or
torch.autograd.grad twice) accumulates the same gradients again."""

from __future__ import annotations

import pytest
import torch
from cases import TILES, assert_matches, leaves, make_inputs, run_reference

from compiled_grpo import FusedLinearGRPOLoss, fused_linear_logprobs
from compiled_grpo.schedules import passes

SETTINGS = {"loss_type": "dapo", "beta": 0.04, "entropy_coef": 0.01}
INPUTS = ("advantages", "old_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio")
SCHEDULES = ("auto", "memory", "speed", "sparse")
POSITIONAL = ("hidden", "weight", "completion_ids", "completion_mask", "advantages")
HEAD = ("hidden", "weight", "bias")


def batch(seed=3):
    return make_inputs(seed=seed, bias=True, ref=True, is_shape="BT", adv_shape="BT")


def fused(loss_fn, x, backward: str):
    """The loss on fresh head leaves, differentiated once, twice with retain_graph, or by autograd.grad twice;
    returns (output, gradients summed over the backwards, how many backwards ran)."""
    y = leaves(x)
    out = loss_fn(*(y[k] for k in POSITIONAL), **{k: v for k, v in y.items() if k not in POSITIONAL})
    head = [y[k] for k in HEAD]
    if backward == "autograd.grad twice":
        first = torch.autograd.grad(out.loss, head, retain_graph=True)
        second = torch.autograd.grad(out.loss, head)
        return out, {k: a + b for k, a, b in zip(HEAD, first, second, strict=True)}, 2
    out.loss.backward(retain_graph=backward != "once")
    if backward != "once":
        out.loss.backward()
    return out, {k: y[k].grad for k in HEAD}, 1 if backward == "once" else 2


@pytest.mark.parametrize("backward", ["once", "backward twice", "autograd.grad twice"])
@pytest.mark.parametrize("name", INPUTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_an_input_requiring_grad_is_a_constant(schedule, name, backward):
    x = batch()
    given = x[name].clone().requires_grad_()
    ref, ref_grads = run_reference(x, SETTINGS)  # the same values, without a graph
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **SETTINGS)
    out, grads, times = fused(loss_fn, {**x, name: given}, backward)
    assert_matches(out, {k: g / times for k, g in grads.items()}, ref, ref_grads, rtol=1e-9)
    assert given.grad is None, f"{name} received a gradient"


def test_old_log_probs_computed_with_a_graph_equal_detached_ones():
    """The realistic way in: old log-probs from the primitive outside no_grad, on the same head; the loss and its
    gradients are those of the detached values (a graph through them would cancel the ratio's gradient)."""
    x = make_inputs(seed=5, off_policy=False)
    h, w = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    old = fused_linear_logprobs(h, w, x["completion_ids"], compiled=False).logp
    assert old.requires_grad
    loss_fn = FusedLinearGRPOLoss(compiled=False, **TILES)
    with_graph = loss_fn(h, w, x["completion_ids"], x["completion_mask"], x["advantages"], old_per_token_logps=old)
    got = torch.autograd.grad(with_graph.loss, (h, w))
    h2, w2 = (t.detach().clone().requires_grad_() for t in (h, w))
    plain = loss_fn(h2, w2, x["completion_ids"], x["completion_mask"], x["advantages"],
                    old_per_token_logps=old.detach())  # fmt: skip
    want = torch.autograd.grad(plain.loss, (h2, w2))
    assert float(want[0].abs().max()) > 0
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.compiled
@pytest.mark.parametrize("schedule", ["memory", "speed"])
def test_second_backward_through_the_compiled_objective(schedule, monkeypatch):
    """What a GPU runs: the objective's value and gradients from a torch.compile graph, differentiated twice, and
    an advantage requiring grad."""
    monkeypatch.setattr(passes, "COMPILE_OBJECTIVE_ON_CPU", True)
    x = {k: (v.float() if v.is_floating_point() else v) for k, v in batch(seed=4).items()}
    ref, ref_grads = run_reference(x, SETTINGS)
    loss_fn = FusedLinearGRPOLoss(compiled=True, schedule=schedule, **TILES, **SETTINGS)
    given = x["advantages"].clone().requires_grad_()
    out, grads, times = fused(loss_fn, {**x, "advantages": given}, "backward twice")
    assert_matches(out, {k: g / times for k, g in grads.items()}, ref, ref_grads, rtol=2e-5)
    assert given.grad is None
