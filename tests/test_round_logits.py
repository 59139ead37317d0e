"""`round_logits=True`: the lm_head product rounded to the inputs' 16-bit dtype before the softmax, as TRL's head
and plain torch keep their logits. With float32 inputs it changes nothing; with bfloat16 inputs the log-probs and
entropies are those of the rounded logits, and the loss and gradients stay within the bf16 three-way bound."""

from __future__ import annotations

import pytest
import torch
from cases import TILES, make_inputs, max_error, run_fused, run_naive_bf16, run_reference

from compiled_grpo import FusedLinearGRPOLoss, fused_linear_logprobs

SCHEDULES = ["memory", "speed", "sparse"]


def settings(schedule):
    return {"loss_type": "dapo", "beta": 0.04, "top_entropy_quantile": 0.5 if schedule == "sparse" else 1.0}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_float32_inputs_are_unchanged(schedule):
    x = make_inputs(seed=3, dtype=torch.float32, bias=True, ref=True)
    outs = [run_fused(FusedLinearGRPOLoss(compiled=False, schedule=schedule, round_logits=r, **TILES,
                                          **settings(schedule)), x) for r in (False, True)]  # fmt: skip
    (a, a_grads), (b, b_grads) = outs
    assert torch.equal(a.loss, b.loss) and torch.equal(a.per_token_logps, b.per_token_logps)
    assert all(torch.equal(a_grads[k], b_grads[k]) for k in a_grads)


def rounded_statistics(x):
    """logp and entropy of logits rounded to bfloat16 (TRL's way), in float32."""
    z = (x["hidden"].float() @ x["weight"].float().T).to(torch.bfloat16).float()
    log_p = z.log_softmax(-1)
    logp = log_p.gather(-1, x["completion_ids"].unsqueeze(-1)).squeeze(-1)
    return logp, -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bfloat16_statistics_are_the_rounded_logits(schedule):
    x = make_inputs(seed=5, dtype=torch.bfloat16, logit_std=4.0, off_policy=False, ref=True)
    s = settings(schedule)
    rounded, rounded_grads = run_fused(FusedLinearGRPOLoss(compiled=False, schedule=schedule, round_logits=True,
                                                           **TILES, **s), x)  # fmt: skip
    default = run_fused(FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES, **s), x)[0]
    mask = x["completion_mask"].bool()
    logp, entropy = rounded_statistics(x)
    assert max_error(rounded.per_token_logps[mask], logp[mask]) <= 1e-5 * max(1.0, float(logp[mask].abs().max()))
    assert max_error(rounded.entropy[mask], entropy[mask]) <= 1e-5 * max(1.0, float(entropy[mask].abs().max()))
    assert not torch.equal(rounded.per_token_logps, default.per_token_logps)  # the option acts
    ref, ref_grads = run_reference({k: v.double() if v.is_floating_point() else v for k, v in x.items()}, s)
    naive, naive_grads = run_naive_bf16(x, s)
    assert max_error(rounded.loss, ref.loss) <= max_error(naive.loss, ref.loss) + 1e-3 * abs(float(ref.loss))
    for k in ("hidden", "weight"):
        scale = float(ref_grads[k].abs().max())
        assert max_error(rounded_grads[k], ref_grads[k]) <= max_error(naive_grads[k], ref_grads[k]) + 2e-2 * scale


def test_primitive_rounds_the_same_way():
    x = make_inputs(seed=7, dtype=torch.bfloat16, logit_std=4.0)
    out = fused_linear_logprobs(x["hidden"], x["weight"], x["completion_ids"], compiled=False, round_logits=True,
                                **{k: TILES[k] for k in ("token_tile", "tail_tile", "vocab_tile")})  # fmt: skip
    logp, entropy = rounded_statistics(x)
    assert max_error(out.logp, logp) <= 1e-5 * max(1.0, float(logp.abs().max()))
    assert max_error(out.entropy, entropy) <= 1e-5 * max(1.0, float(entropy.abs().max()))


@pytest.mark.compiled
@pytest.mark.parametrize("schedule", ["memory", "speed"])
def test_compiled_tiles_round_as_the_eager_ones(schedule):
    x = make_inputs(seed=9, dtype=torch.bfloat16, logit_std=4.0, ref=True)
    s = settings(schedule)
    eager, eager_grads = run_fused(FusedLinearGRPOLoss(compiled=False, schedule=schedule, round_logits=True,
                                                       **TILES, **s), x)  # fmt: skip
    compiled, compiled_grads = run_fused(FusedLinearGRPOLoss(compiled=True, schedule=schedule, round_logits=True,
                                                             **TILES, **s), x)  # fmt: skip
    mask = x["completion_mask"].bool()
    assert max_error(compiled.per_token_logps[mask], eager.per_token_logps[mask]) <= 1e-4
    assert max_error(compiled.loss, eager.loss) <= 1e-4 * max(1.0, abs(float(eager.loss)))
    for k in eager_grads:
        assert max_error(compiled_grads[k], eager_grads[k]) <= 2e-2 * float(eager_grads[k].abs().max())


def test_rounded_products_count_two_bytes_in_the_workspace(monkeypatch):
    """The speed and sparse schedules' workspace estimates count a rounded product at 2 bytes per logit; under a
    budget between the two estimates, "auto" takes the sparse schedule with round_logits=True and the memory
    schedule without."""
    from compiled_grpo import schedules

    x = make_inputs(seed=15, dtype=torch.bfloat16)
    vocab = x["weight"].shape[0]
    estimates = {"speed": {}, "sparse": {}}
    for name, found in estimates.items():
        module = getattr(schedules, name)

        def record(engine, plan, head, f=module.workspace_bytes, found=found):
            found.setdefault(head.rounded, []).append((f(engine, plan, head), plan))
            return found[head.rounded][-1][0]

        monkeypatch.setattr(module, "workspace_bytes", record)
    for q in (1.0, 0.5):
        for rounded in (False, True):
            loss_fn = FusedLinearGRPOLoss(compiled=False, round_logits=rounded, top_entropy_quantile=q, **TILES)
            run_fused(loss_fn, x)
    (default, plan), (rounded, _) = estimates["speed"][False][0], estimates["speed"][True][0]
    assert default - rounded == 2 * plan.tile * vocab
    (sparse_default, _), (sparse_rounded, _) = estimates["sparse"][False][0], estimates["sparse"][True][0]
    assert sparse_rounded < sparse_default
    budget = (sparse_default + sparse_rounded) // 2
    ran = []
    for name in ("memory", "sparse"):
        m = getattr(schedules, name)
        monkeypatch.setattr(m, "run", lambda *a, f=m.run, n=name: ran.append(n) or f(*a))
    for rounded in (False, True):
        loss_fn = FusedLinearGRPOLoss(compiled=False, logits_budget_bytes=budget, round_logits=rounded,
                                      top_entropy_quantile=0.5, **TILES)  # fmt: skip
        run_fused(loss_fn, x)
    assert ran == ["memory", "sparse"]
