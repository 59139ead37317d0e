"""The fp32 head (`cast_lm_head_to_fp32`): a float32 lm_head weight against bf16 hidden states. The hidden states are
widened (exactly) and the head is a float32 one; on a GPU its products come from bf16 terms (`products`), run here
on the CPU with `products.SPLIT_ON_CPU` (each term's GEMM then in float32, so only the split's own error shows)."""

from __future__ import annotations

import pytest
import torch
from cases import TILES, make_inputs, max_error, run_fused, run_reference

from compiled_grpo import FusedLinearGRPOLoss, GRPOLossConfig, fused_linear_logprobs, products

SETTINGS = {"loss_type": "dapo", "beta": 0.04, "entropy_coef": 0.01}


def fp32_head_inputs(seed: int) -> dict:
    """bf16 hidden states, a float32 weight and bias (not bf16 values), a reference model's log-probs."""
    x = make_inputs(seed=seed, dtype=torch.float32, bias=True, ref=True, logit_std=3.0, V=517)
    x["hidden"] = x["hidden"].bfloat16()
    return x


def schedule_settings(schedule: str) -> dict:
    return {**SETTINGS, "top_entropy_quantile": 0.5 if schedule == "sparse" else 1.0}


@pytest.mark.parametrize("schedule", ["memory", "speed", "sparse"])
def test_bf16_hidden_states_run_as_float32_ones(schedule):
    """Without the split (a CPU), the call is the one with the hidden states given in float32: the same numbers,
    and the hidden states' gradient in their own dtype."""
    x = fp32_head_inputs(seed=1)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **schedule_settings(schedule))
    out, grads = run_fused(loss_fn, x)
    wide, wide_grads = run_fused(loss_fn, {**x, "hidden": x["hidden"].float()})
    assert torch.equal(out.loss, wide.loss) and torch.equal(out.per_token_logps, wide.per_token_logps)
    assert grads["hidden"].dtype == torch.bfloat16 and grads["weight"].dtype == torch.float32
    assert torch.equal(grads["hidden"], wide_grads["hidden"].bfloat16())
    assert torch.equal(grads["weight"], wide_grads["weight"]) and torch.equal(grads["bias"], wide_grads["bias"])


def errors(out, grads, ref, ref_grads) -> dict[str, float]:
    scaled = lambda a, b: max_error(a, b) / max(float(b.abs().max()), 1e-12)
    found = {"loss": scaled(out.loss, ref.loss), "logp": scaled(out.per_token_logps, ref.per_token_logps),
             "entropy": scaled(out.entropy, ref.entropy)}  # fmt: skip
    return found | {f"d {k}": scaled(grads[k], ref_grads[k]) for k in ("hidden", "weight", "bias")}


@pytest.mark.parametrize("schedule", ["memory", "speed", "sparse"])
def test_split_products_are_as_accurate_as_float32_gemms(schedule, monkeypatch):
    """The products from SPLIT_TERMS bf16 terms against float64: within 2x the error of float32 GEMMs on the same
    inputs (plus a float32 rounding), the hidden states' gradient rounded to bf16 as the cast returns it; and they
    are the split's numbers, not float32 GEMMs' (the weight rounded to bf16 alone would be far off)."""
    x = fp32_head_inputs(seed=2)
    s = schedule_settings(schedule)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **s)
    wide, wide_grads = run_fused(loss_fn, {**x, "hidden": x["hidden"].float()})
    wide_grads["hidden"] = wide_grads["hidden"].bfloat16()
    monkeypatch.setattr(products, "SPLIT_ON_CPU", True)
    split, split_grads = run_fused(loss_fn, x)
    ref, ref_grads = run_reference({k: v.double() if v.is_floating_point() else v for k, v in x.items()}, s)
    if split.entropy_mask is not None and not torch.equal(split.entropy_mask, ref.entropy_mask):  # on the threshold
        ref, ref_grads = run_reference({k: v.double() if v.is_floating_point() else v for k, v in x.items()}, s,
                                       entropy_mask_override=split.entropy_mask)  # fmt: skip
    exact, ours = errors(wide, wide_grads, ref, ref_grads), errors(split, split_grads, ref, ref_grads)
    for what, err in ours.items():
        assert err <= 2 * exact[what] + 2e-7, f"{what}: split {err:.2e}, float32 GEMMs {exact[what]:.2e}"
    assert not torch.equal(split_grads["weight"], wide_grads["weight"])  # the split path ran
    rounded = errors(*run_fused(loss_fn, {**x, "weight": x["weight"].bfloat16(), "bias": x["bias"].bfloat16()}),
                     ref, ref_grads)  # fmt: skip
    assert ours["logp"] * 50 < rounded["logp"] and ours["d weight"] * 50 < rounded["d weight"]


def test_terms_sum_to_the_weight():
    w = torch.randn(64, 32) * 0.1
    for count, bits in ((1, 8), (2, 16), (3, 24)):
        terms = products.bf16_terms(w, count)
        assert all(t.dtype == torch.bfloat16 for t in terms)
        total = sum(t.double() for t in terms)
        assert float(((total - w.double()).abs() / w.double().abs()).max()) <= 2.0**-bits
    side_by_side = products.weight_terms(w)
    assert side_by_side.shape == (64, 32 * products.SPLIT_TERMS)
    assert torch.equal(side_by_side[:, :32], w.bfloat16())


SPLIT_PEAK = """
import resource, sys, torch
from compiled_grpo import products
weight = torch.randn(65536, 2048)  # 512 MiB of float32; its terms take 768 MiB of bf16
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
terms = products.weight_terms(weight)
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(grown / terms.numel() / terms.element_size())
"""


def test_splitting_the_weight_holds_the_terms_and_one_slice():
    """The weight's terms are made a slice of rows at a time: the process's peak grows by the terms and a few
    slices' temporaries (1.17x the terms here, the bound 1.33x; the whole-weight split held the terms twice: 2.0x)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SPLIT_PEAK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    slice_share = products.TERM_ROWS * 2048 * 4 / (65536 * 3 * 2048 * 2)  # one float32 slice against the terms
    assert float(done.stdout) <= 1.0 + 4 * slice_share, done.stdout  # the whole-weight split: 2.0


def test_primitive_takes_the_fp32_head(monkeypatch):
    x = fp32_head_inputs(seed=3)
    h = x["hidden"].detach().requires_grad_()
    w = x["weight"].detach().requires_grad_()
    monkeypatch.setattr(products, "SPLIT_ON_CPU", True)
    out = fused_linear_logprobs(h, w, x["completion_ids"], bias=x["bias"], compiled=False)
    (out.logp.sum() + out.entropy.sum()).backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    exact = fused_linear_logprobs(h.detach().double(), w.detach().double(), x["completion_ids"],
                                  bias=x["bias"].double(), compiled=False)  # fmt: skip
    assert max_error(out.logp, exact.logp) <= 1e-5 * float(exact.logp.abs().max())


@pytest.mark.parametrize("hidden, weight", [(torch.bfloat16, torch.float16), (torch.float64, torch.float32),
                                            (torch.float32, torch.bfloat16)])  # fmt: skip
def test_other_mixed_dtypes_are_refused(hidden, weight):
    x = fp32_head_inputs(seed=4)
    h, w = x["hidden"].to(hidden), x["weight"].to(weight)
    with pytest.raises(TypeError, match="weight: dtype .* differs from hidden's"):
        FusedLinearGRPOLoss(compiled=False)(h, w, x["completion_ids"], x["completion_mask"], x["advantages"])
    with pytest.raises(TypeError, match="weight: dtype .* differs from hidden's"):
        fused_linear_logprobs(h, w, x["completion_ids"], compiled=False)


@pytest.mark.compiled
def test_compiled_split_matches_eager(monkeypatch):
    monkeypatch.setattr(products, "SPLIT_ON_CPU", True)
    x = fp32_head_inputs(seed=5)
    s = schedule_settings("speed")
    eager, eager_grads = run_fused(FusedLinearGRPOLoss(compiled=False, schedule="speed", **TILES, **s), x)
    compiled, compiled_grads = run_fused(FusedLinearGRPOLoss(compiled=True, schedule="speed", **TILES, **s), x)
    assert max_error(compiled.per_token_logps, eager.per_token_logps) <= 1e-5
    for k in eager_grads:
        assert max_error(compiled_grads[k], eager_grads[k]) <= 1e-4 * float(eager_grads[k].abs().max())


@pytest.mark.parametrize("schedule", ["speed", "memory", "sparse"])
def test_captured_calls_make_the_terms_from_the_weight_as_it_is(schedule, monkeypatch):
    """Captured calls (the CPU stand-in graph) with a float32 weight that changes in place between calls, as an
    optimizer changes it: every replay equals the uncaptured work on the same plan, bitwise (its weight terms are
    made inside the captured work from the weight read in place, not kept from the call that captured)."""
    from test_capture import Model, captured_and_plain

    from compiled_grpo.schedules import passes

    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 16)
    monkeypatch.setattr(products, "SPLIT_ON_CPU", True)
    captured, plain = captured_and_plain(schedule, schedule_settings(schedule))
    mask = fp32_head_inputs(seed=20)["completion_mask"]
    model = Model(fp32_head_inputs(seed=20))
    for seed in range(4):
        x = {**fp32_head_inputs(seed=20 + seed), "completion_mask": mask}
        out, grads = model.call(captured, x)
        same, same_grads = model.call(plain, x)
        assert torch.equal(out.loss, same.loss) and torch.equal(out.per_token_logps, same.per_token_logps)
        assert all(torch.equal(grads[k], same_grads[k]) for k in grads), schedule
    assert captured.captures.replays >= 2


@pytest.mark.parametrize("schedule", ["speed", "sparse"])
def test_packed_calls_take_the_fp32_head(schedule, monkeypatch):
    """A packed call (segment_ids, [rows, H] bf16 hidden states) with a float32 weight: the padded call's loss,
    log-probs and gradients (the split products on the CPU), the hidden rows' gradient in bf16."""
    from audits.harness import pack

    monkeypatch.setattr(products, "SPLIT_ON_CPU", True)
    x = fp32_head_inputs(seed=6)
    s = schedule_settings(schedule)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **s)
    padded, padded_grads = run_fused(loss_fn, x)
    packed, packed_grads = run_fused(loss_fn, pack(x))
    mask = x["completion_mask"].bool()
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(packed.per_token_logps, padded.per_token_logps[mask], rtol=1e-6, atol=1e-6)
    assert packed_grads["hidden"].dtype == torch.bfloat16
    torch.testing.assert_close(packed_grads["weight"], padded_grads["weight"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("schedule", ["memory", "speed", "sparse"])
def test_fp32_head_without_grad_mode(context, schedule, monkeypatch):
    """Under no_grad and inference_mode the fp32 head (split products) gives the grad-mode call's loss, log-probs
    and entropies, the loss's and the primitive's alike."""
    monkeypatch.setattr(products, "SPLIT_ON_CPU", True)
    x = fp32_head_inputs(seed=7)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **schedule_settings(schedule))
    with_grad, _ = run_fused(loss_fn, x)
    args = [x[k] for k in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")]
    rest = {k: v for k, v in x.items() if k not in ("hidden", "weight", "completion_ids", "completion_mask",
                                                    "advantages")}  # fmt: skip
    primitive = fused_linear_logprobs(x["hidden"], x["weight"], x["completion_ids"], bias=x["bias"], compiled=False)
    with context():
        out = loss_fn(*args, **rest)
        bare = fused_linear_logprobs(x["hidden"], x["weight"], x["completion_ids"], bias=x["bias"], compiled=False)
    torch.testing.assert_close(out.loss, with_grad.loss.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(out.per_token_logps, with_grad.per_token_logps.detach())
    assert torch.equal(out.entropy, with_grad.entropy.detach())
    assert torch.equal(bare.logp, primitive.logp) and torch.equal(bare.entropy, primitive.entropy)


@pytest.mark.parametrize("ref_head", [False, True])
def test_memory_schedule_splits_the_weight_slice_by_slice(ref_head, monkeypatch):
    """The memory schedule's passes (statistics, the reference log-probs, the gradients) make a split head's terms
    one vocabulary slice at a time, never the whole weight's; its statistics equal the whole terms' token-outer
    pass to float32 rounding; speed and sparse hold the whole terms."""
    from compiled_grpo.head import VocabShard, make_head
    from compiled_grpo.schedules import passes
    from compiled_grpo.tiling import Tiles

    monkeypatch.setattr(products, "SPLIT_ON_CPU", True)
    made = []
    split = products.weight_terms
    monkeypatch.setattr(products, "weight_terms", lambda w: made.append(w.shape[0]) or split(w))
    x = fp32_head_inputs(seed=3)
    if ref_head:  # the reference log-probs streamed from the policy's own head
        x = {**{k: v for k, v in x.items() if k != "ref_per_token_logps"}, "ref_hidden": x["hidden"]}
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule="memory", **TILES, **SETTINGS)
    out, grads = run_fused(loss_fn, x)
    assert made and max(made) <= TILES["vocab_tile"] < x["weight"].shape[0], made
    for schedule in ("speed", "sparse"):
        made.clear()
        other = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **schedule_settings(schedule))
        run_fused(other, x)
        assert x["weight"].shape[0] in made, (schedule, made)
    tiles = Tiles.for_device(torch.device("cpu"), **TILES)
    engine = passes.Engine(loss_fn.kernels, tiles, VocabShard())
    hidden = x["hidden"].float().reshape(-1, x["hidden"].shape[-1])
    targets = x["completion_ids"].reshape(-1)
    head = make_head(x["weight"], x["bias"], loss_fn.config, torch.float32, split=True)
    pieces = [(s, min(64, hidden.shape[0] - s)) for s in range(0, hidden.shape[0], 64)]
    sliced = passes.statistics_pass(engine, hidden, targets, head, pieces)
    whole = passes.statistics_pass(engine, hidden, targets, head.with_whole_terms(), pieces)
    for a, b in zip(sliced, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


def test_auto_counts_the_whole_terms_in_the_speed_schedules_workspace(monkeypatch):
    """The speed schedule's workspace counts a split head's whole terms: auto runs it for the split head where the
    budget holds them and the memory schedule where it falls one byte short."""
    from compiled_grpo.head import VocabShard, make_head
    from compiled_grpo.schedules import passes, speed
    from compiled_grpo.tiling import Tiles

    x = fp32_head_inputs(seed=4)
    tiles = Tiles.for_device(torch.device("cpu"), **TILES)
    engine = passes.Engine(FusedLinearGRPOLoss(compiled=False).kernels, tiles, VocabShard())
    head = make_head(x["weight"].clone().requires_grad_(), None, GRPOLossConfig(), torch.float32, split=True)
    bound = speed.workspace_bound(engine, head)
    terms = products.SPLIT_TERMS * 2 * head.weight.numel()
    monkeypatch.setattr(products, "whole_terms_bytes", lambda head: 0)
    assert bound == speed.workspace_bound(engine, head) + terms
    monkeypatch.undo()
    monkeypatch.setattr(products, "SPLIT_ON_CPU", True)
    for budget, expected in ((bound, "speed"), (bound - 1, "memory")):
        loss_fn = FusedLinearGRPOLoss(compiled=False, logits_budget_bytes=budget, loss_type="dapo", **TILES)
        assert run_fused(loss_fn, x)[0].schedule == expected, budget


def test_audit_product_ratio_runs_the_split_product(monkeypatch):
    """The audit's fp32-head scale: 1 where the head's products are float32 GEMMs, and computed from the split
    product (as on a GPU) where it splits; the split's exact float32 sums here stay within float32 GEMMs' error."""
    from audits import harness

    x, w = torch.randn(148, 32).bfloat16(), torch.randn(1021, 32)
    assert harness.fp32_head_product_ratio(x, w, 1e-30) == 1.0
    monkeypatch.setattr(products, "SPLIT_ON_CPU", True)
    assert 1.0 <= harness.fp32_head_product_ratio(x, w, 1e-30) < 2.0


def test_audit_row_sum_ratio_runs_the_split_product(monkeypatch):
    """The audit's note beside the scale: each row's summed target log-probs under the head's product against float32
    GEMMs' (1 where the products are float32 GEMMs; the split's exact float32 sums here stay near float32 GEMMs')."""
    from audits import harness
    from audits.loss_audit import QUICK, make_batch

    x = make_batch(QUICK, torch.bfloat16, "cpu", weight_dtype=torch.float32)
    assert harness.fp32_head_row_sum_ratio(x, 1e-30) == 1.0
    monkeypatch.setattr(products, "SPLIT_ON_CPU", True)
    assert 1.0 <= harness.fp32_head_row_sum_ratio(x, 1e-30) < 3.0
