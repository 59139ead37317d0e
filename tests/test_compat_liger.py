"""The Liger drop-in against liger-kernel 0.8.5 itself (on the CPU, compiled=False), where Liger follows TRL."""

from __future__ import annotations

import pytest
import torch
from cases import make_inputs

liger = pytest.importorskip(
    "liger_kernel.chunked_loss",
    reason="liger-kernel is not installed: `pip install --no-deps liger-kernel==0.8.5` (this comparison needs no "
    "Triton; .ci/run installs it so)",
)

from compiled_grpo.compat import LigerFusedLinearGRPOLoss  # noqa: E402

# luspo and the clip metric under delta are where Liger departs from TRL (compat.py's docstring); not compared.
CASES = [
    {"loss_type": "dapo"},
    {"loss_type": "grpo", "beta": 0.04},
    {"loss_type": "bnpo", "importance_sampling_level": "sequence"},
    {"loss_type": "dr_grpo", "max_completion_length": 40, "beta": 0.1, "use_bias_correction_kl": True},
    {"loss_type": "cispo", "epsilon_high": 1.1},
    {"loss_type": "sapo"},
    {"loss_type": "vespo"},
    {"loss_type": "grpo", "delta": 5.0, "temperature": 0.8},  # delta above every ratio: no metric difference
]


def close(a, b, what, rtol=2e-5):
    """Liger computes in float32 whatever the input dtype: compare to float32 accuracy, relative to the largest
    magnitude (so that tiny entries do not make a relative error meaningless)."""
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    err = float((a - b).abs().max())
    assert err <= rtol * max(float(b.abs().max()), 1e-8), f"{what}: {err:.2e} vs scale {float(b.abs().max()):.2e}"


def run(loss_fn, x, **extra):
    h = x["hidden"].detach().clone().requires_grad_()
    w = x["weight"].detach().clone().requires_grad_()
    b = x["bias"].detach().clone().requires_grad_()
    loss, metrics = loss_fn(h, w, x["completion_ids"], x["completion_mask"], x["advantages"], bias=b,
                            old_per_token_logps=x["old_per_token_logps"], **extra)  # fmt: skip
    loss.backward()
    return loss, metrics, (h.grad, w.grad, b.grad)


@pytest.mark.parametrize("settings", CASES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_matches_liger(settings):
    x = make_inputs(seed=2, dtype=torch.float64, bias=True, ref=True, empty_row=False)
    beta = settings.get("beta", 0.0)
    kw = {"beta": beta, "use_ref_model": beta != 0.0, **{k: v for k, v in settings.items() if k != "beta"}}
    extra = {"ref_per_token_logps": x["ref_per_token_logps"]} if beta else {}
    theirs = run(liger.LigerFusedLinearGRPOLoss(compiled=False, **kw), x, **extra)
    ours = run(LigerFusedLinearGRPOLoss(compiled=False, **kw), x, **extra)
    close(ours[0], theirs[0], "loss")
    assert len(ours[1]) == len(theirs[1])
    for i, (a, b) in enumerate(zip(ours[1], theirs[1], strict=True)):
        close(a, b, f"metric {i}")
    for name, a, b in zip(("hidden", "weight", "bias"), ours[2], theirs[2], strict=True):
        close(a, b, f"d {name}")


def test_ref_model_head_and_entropy_quantile():
    """beta with ref_input/ref_weight (Liger's use_ref_model) and top_entropy_quantile, which Liger lacks."""
    x = make_inputs(seed=3, dtype=torch.float64, bias=True, empty_row=False)
    ref_input = x["hidden"] + 0.05
    kw = {"beta": 0.04, "loss_type": "dapo"}
    extra = {"ref_input": ref_input, "ref_weight": x["weight"], "ref_bias": x["bias"]}
    theirs = run(liger.LigerFusedLinearGRPOLoss(compiled=False, **kw), x, **extra)
    ours = run(LigerFusedLinearGRPOLoss(compiled=False, **kw), x, **extra)
    close(ours[0], theirs[0], "loss")
    masked = run(LigerFusedLinearGRPOLoss(compiled=False, top_entropy_quantile=0.2, **kw), x, **extra)
    assert torch.isfinite(masked[0]) and not torch.allclose(masked[0], ours[0])
