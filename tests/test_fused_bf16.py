"""bf16 inputs, three-way: the fused loss is no further from the float64 truth (taken on the bf16-rounded
inputs) than plain full-logits autograd in bf16 is, plus a small tolerance. Smooth cases only (on-policy ratio,
no masks): at a clip bound or the entropy threshold a low-precision run may legitimately land on either side,
and those are tested in float32 and float64."""

from __future__ import annotations

import pytest
import torch
from cases import TILES, make_inputs, max_error, run_fused, run_naive_bf16, run_reference

from compiled_grpo import FusedLinearGRPOLoss


# H=64: the speed schedule keeps every tile's 16-bit logits gradient for one dW GEMM (slots <= 2H);
# H=16: it accumulates dW over tiles in float32 instead.
@pytest.mark.parametrize("H", [64, 16])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "luspo", "bnpo"])
@pytest.mark.parametrize("schedule", ["memory", "speed", "sparse"])
def test_bf16_no_worse_than_naive_bf16(loss_type, schedule, H):
    x = make_inputs(seed=11, dtype=torch.bfloat16, H=H, V=1021, off_policy=False, logit_std=3.0)
    settings = {"loss_type": loss_type, "entropy_coef": 0.01}
    if loss_type == "cispo":
        settings["epsilon_high"] = 5.0
    ref, ref_grads = run_reference(x, settings)  # float64 on the bf16-rounded inputs
    naive, naive_grads = run_naive_bf16(x, settings)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **TILES,
                                  **settings)  # fmt: skip
    out, out_grads = run_fused(loss_fn, x)
    tol = 1e-3
    assert max_error(out.loss, ref.loss) <= max_error(naive.loss, ref.loss) + tol * abs(float(ref.loss))
    assert max_error(out.entropy, ref.entropy) <= max_error(naive.entropy * x["completion_mask"], ref.entropy) + tol
    for name in ("hidden", "weight"):
        scale = float(ref_grads[name].abs().max())
        assert (
            max_error(out_grads[name], ref_grads[name]) <= max_error(naive_grads[name], ref_grads[name]) + tol * scale
        ), name
