"""compiled=True: a representative set against the reference, and no recompile across shapes and settings."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from cases import assert_matches, make_inputs, run_fused, run_reference
from torch._dynamo.utils import counters

from compiled_grpo import FusedLinearGRPOLoss, batch_objective
from compiled_grpo.head import Head
from compiled_grpo.kernels import Kernels

pytestmark = pytest.mark.compiled

TILES = {
    "token_tile": 64,
    "tail_tile": 64,
    "vocab_tile": 256,
    "speed_tile": 64,
    "sparse_tile": 64,
}  # one token shape; V = 1021 adds a vocab tail


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize(
    "settings, schedule, inputs",
    [
        ({"loss_type": "dapo", "top_entropy_quantile": 0.2, "entropy_coef": 0.01}, "memory", {"bias": True}),
        ({"loss_type": "grpo", "beta": 0.04}, "speed", {"ref": True, "bias": True}),
        ({"loss_type": "vespo", "importance_sampling_level": "token"}, "speed", {"is_shape": "BT"}),
        ({"loss_type": "sapo", "temperature": 0.7, "final_logit_softcapping": 3.0}, "memory", {}),
        ({"loss_type": "grpo", "top_entropy_quantile": 0.2}, "sparse", {"bias": True, "zero_advantage_rows": 1}),
        ({"loss_type": "dapo"}, "speed", {"zero_advantage_rows": 1}),
    ],
)
def test_compiled_matches_reference(settings, schedule, inputs):
    x = make_inputs(seed=3, dtype=torch.float32, **inputs)
    ref, ref_grads = run_reference(x, settings)
    out, out_grads = run_fused(FusedLinearGRPOLoss(compiled=True, schedule=schedule, **TILES, **settings), x)
    assert_matches(out, out_grads, ref, ref_grads, rtol=2e-5)


def test_no_recompile_across_batch_shapes_and_settings():
    """After a warm-up call per schedule, new batch sizes, sequence lengths, loss types, temperatures, per-call
    entropy coefficients and numbers of rows with a gradient reuse the compiled tiles."""
    torch._dynamo.reset()
    counters.clear()

    def run(schedule, B, T, seed, **settings):
        x = make_inputs(seed=seed, B=B, T=T, dtype=torch.float32, bias=True)
        loss_fn = FusedLinearGRPOLoss(compiled=True, schedule=schedule, **TILES, **settings)
        run_fused(loss_fn, x, entropy_coef=0.01 * seed)

    run("memory", 3, 37, 1, loss_type="dapo", top_entropy_quantile=0.5)
    run("speed", 3, 37, 1, loss_type="grpo")
    run("sparse", 3, 37, 1, loss_type="grpo", top_entropy_quantile=0.5)
    warm = graphs_compiled()
    assert warm > 0
    run("memory", 5, 61, 2, loss_type="grpo", top_entropy_quantile=0.2, temperature=0.5)
    run("sparse", 6, 50, 6, loss_type="dapo", top_entropy_quantile=0.2, temperature=0.9)
    run("memory", 2, 200, 3, loss_type="cispo", epsilon_high=4.0)
    run("speed", 7, 11, 4, loss_type="bnpo", temperature=1.3)
    run("speed", 4, 90, 5, loss_type="sapo")
    assert graphs_compiled() == warm, f"recompiled: {graphs_compiled() - warm} new graphs"


def test_more_tile_shapes_than_dynamos_default_recompile_limit():
    """Nine stats-tile shapes in one process: past dynamo's default limit of 8 graphs, which under fullgraph=True
    is an error."""
    kernels = Kernels(compiled=True)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 8, generator=g)
    head = torch.tensor([1.0, 1.0, 1.0])
    for rows in range(1, 10):
        x = torch.randn(rows, 8, generator=g)
        targets = torch.randint(0, 50, (rows,), generator=g)
        logp, entropy, lse = kernels.statistics(x, targets, Head(w, None, head, False))
        expected = torch.log_softmax(x @ w.T, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(logp, expected)


@pytest.mark.parametrize(
    "settings, schedule, inputs",
    [
        ({"loss_type": "dapo"}, "speed", {}),
        ({"loss_type": "grpo", "beta": 0.04, "entropy_coef": 0.01}, "speed", {"ref": True, "bias": True}),
        ({"loss_type": "vespo"}, "speed", {"is_shape": "BT"}),
        (
            {"loss_type": "luspo", "importance_sampling_level": "sequence", "off_policy_mask_threshold": 0.1},
            "speed",
            {"sampling": True},
        ),
        ({"loss_type": "sapo", "delta": 1.5}, "speed", {"zero_advantage_rows": 1}),
        ({"loss_type": "dapo", "top_entropy_quantile": 0.3, "entropy_coef": 0.01}, "memory", {"bias": True}),
        ({"loss_type": "grpo", "beta": 0.04, "top_entropy_quantile": 0.5}, "sparse", {"ref": True}),
        ({"loss_type": "cispo"}, "memory", {"zero_advantage_rows": 1}),
    ],
)
def test_compiled_objective(settings, schedule, inputs, monkeypatch):
    """The objective under torch.compile (what a GPU runs): the speed schedule's per-tile gradient, the memory and
    sparse schedules' loss with its gradients taken up front, the metrics. The reference's loss, metrics and
    gradients; new batch shapes and per-call entropy coefficients reuse the graphs."""
    from compiled_grpo.schedules import passes

    monkeypatch.setattr(passes, "COMPILE_OBJECTIVE_ON_CPU", True)
    calls = {"objective": 0, "metrics": 0}
    for name, key in (("compiled_loss_value_and_gradients", "objective"), ("compiled_metrics", "metrics")):
        monkeypatch.setattr(batch_objective, name, counted(getattr(batch_objective, name), calls, key))
    loss_fn = FusedLinearGRPOLoss(compiled=True, schedule=schedule, **TILES, **settings)
    for i, (B, T) in enumerate(((3, 37), (4, 29), (5, 41))):
        x = make_inputs(seed=10 + i, B=B, T=T, dtype=torch.float32, **inputs)
        ref, ref_grads = run_reference(x, settings)
        coef = {"entropy_coef": 0.01 * (i + 1)} if "entropy_coef" in settings else {}
        ref, ref_grads = run_reference(x, {**settings, **coef})
        out, out_grads = run_fused(loss_fn, x, **coef)
        assert_matches(out, out_grads, ref, ref_grads, rtol=2e-5)
        if i == 0:
            graphs = graphs_compiled()
    assert calls["objective"] >= 3 and calls["metrics"] == 3, calls  # the compiled graphs ran, not eager code
    assert graphs_compiled() == graphs, "a new batch shape recompiled the objective"


def test_compiled_objective_without_grad_mode(monkeypatch):
    """Without grad mode the compiled loss's value comes from the grad-mode call's compiled graph (an eager
    objective there could differ in the last bit): the same loss bits under no_grad and inference_mode."""
    from compiled_grpo.schedules import passes

    monkeypatch.setattr(passes, "COMPILE_OBJECTIVE_ON_CPU", True)
    calls = {"objective": 0}
    original = batch_objective.compiled_loss_value_and_gradients
    monkeypatch.setattr(batch_objective, "compiled_loss_value_and_gradients", counted(original, calls, "objective"))
    loss_fn = FusedLinearGRPOLoss(compiled=True, schedule="memory", loss_type="dapo", **TILES)
    x = make_inputs(seed=12, B=3, T=37, dtype=torch.float32)
    grad_mode, _ = run_fused(loss_fn, x)
    args = [x[k] for k in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")]
    for context in (torch.no_grad, torch.inference_mode):
        before = calls["objective"]
        with context():
            out = loss_fn(*args, old_per_token_logps=x["old_per_token_logps"])
        assert calls["objective"] == before + 1, context  # the compiled graph, not the eager objective
        assert torch.equal(out.loss, grad_mode.loss.detach()), context


def counted(function, calls: dict, key: str):
    def call(*args, **kwargs):
        calls[key] += 1
        return function(*args, **kwargs)

    return call


def test_the_first_compiled_call_says_once_that_it_compiles(monkeypatch):
    import warnings

    from compiled_grpo import CompilingNotice, kernels

    monkeypatch.setattr(kernels, "_compiling_noticed", False)
    x = make_inputs(seed=9, dtype=torch.float32)
    loss_fn = FusedLinearGRPOLoss(compiled=True, schedule="memory", **TILES)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            run_fused(loss_fn, x)
    notices = [w for w in seen if issubclass(w.category, CompilingNotice)]
    assert len(notices) == 1 and "torch.compile" in str(notices[0].message)
