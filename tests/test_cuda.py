"""GPU correctness (runs where CUDA is available): compiled tiles, every schedule, bf16 and fp32 (TF32 off),
against the float64 reference at a few shapes. On a machine without a GPU these are reported as skipped."""

from __future__ import annotations

import pytest
import torch
from cases import assert_matches, make_inputs, max_error, run_fused, run_naive_bf16, run_reference

from compiled_grpo import FusedLinearGRPOLoss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = [(4, 300, 256, 32003), (2, 1024, 512, 50000)]
# B*T <= 2H: the speed schedule's dW is one GEMM over every token's buffered 16-bit gradient
BF16_SHAPES = [*SHAPES, (2, 256, 512, 32003)]


def on_cuda(x):
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(
    "settings, schedule",
    [
        ({"loss_type": "dapo"}, "speed"),
        ({"loss_type": "dapo"}, "memory"),
        ({"loss_type": "grpo", "top_entropy_quantile": 0.2, "entropy_coef": 0.01}, "memory"),
        ({"loss_type": "grpo", "top_entropy_quantile": 0.2, "entropy_coef": 0.01}, "sparse"),
        ({"loss_type": "dapo", "top_entropy_quantile": 0.2}, "sparse"),  # q=0.5 puts a token on the threshold
        ({"loss_type": "luspo", "importance_sampling_level": "sequence", "beta": 0.04}, "speed"),
    ],
)
def test_fp32_matches_reference_on_gpu(shape, settings, schedule):
    B, T, H, V = shape
    x = on_cuda(make_inputs(seed=1, B=B, T=T, H=H, V=V, dtype=torch.float32, bias=True, ref=True))
    ref, ref_grads = run_reference(x, settings)
    out, out_grads = run_fused(FusedLinearGRPOLoss(compiled=True, schedule=schedule, **settings), x)
    assert_matches(out, out_grads, ref, ref_grads, rtol=1e-4)


@pytest.mark.parametrize("shape", BF16_SHAPES, ids=str)
@pytest.mark.parametrize("schedule", ["speed", "memory", "sparse"])
def test_bf16_three_way_on_gpu(shape, schedule):
    B, T, H, V = shape
    x = on_cuda(make_inputs(seed=2, B=B, T=T, H=H, V=V, dtype=torch.bfloat16, off_policy=False, logit_std=3.0))
    settings = {"loss_type": "dapo", "entropy_coef": 0.01}
    ref, ref_grads = run_reference(x, settings)
    naive, naive_grads = run_naive_bf16(x, settings)
    out, out_grads = run_fused(FusedLinearGRPOLoss(compiled=True, schedule=schedule, **settings), x)
    assert max_error(out.loss, ref.loss) <= max_error(naive.loss, ref.loss) + 1e-3 * abs(float(ref.loss))
    for name in ("hidden", "weight"):
        scale = float(ref_grads[name].abs().max())
        bound = max_error(naive_grads[name], ref_grads[name]) + 1e-3 * scale
        assert max_error(out_grads[name], ref_grads[name]) <= bound, name


def test_speed_schedule_gradient_groups_on_gpu():
    """dW summed over several groups of tiles (with a tail tile) on the GPU, float32 against the reference."""
    x = on_cuda(make_inputs(seed=3, B=2, T=1024, H=512, V=50000, dtype=torch.float32))
    settings = {"loss_type": "grpo", "entropy_coef": 0.01}
    ref, ref_grads = run_reference(x, settings)
    loss_fn = FusedLinearGRPOLoss(compiled=True, schedule="speed", speed_tile=256, tail_tile=64, speed_group=512,
                                  **settings)  # fmt: skip
    out, out_grads = run_fused(loss_fn, x)
    assert_matches(out, out_grads, ref, ref_grads, rtol=1e-4)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("schedule", ["speed", "memory", "sparse"])
def test_without_grad_mode_on_gpu(schedule, context):
    """Old, reference and evaluation log-probs: bitwise the grad-mode call's, every schedule, compiled, bf16."""
    x = on_cuda(make_inputs(seed=4, B=4, T=300, H=256, V=32003, dtype=torch.bfloat16, zero_advantage_rows=1))
    loss_fn = FusedLinearGRPOLoss(compiled=True, schedule=schedule, loss_type="dapo")
    grad_mode, _ = run_fused(loss_fn, x)
    args = [x[k] for k in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")]
    with context():
        out = loss_fn(*args, old_per_token_logps=x["old_per_token_logps"])
    assert torch.equal(out.per_token_logps, grad_mode.per_token_logps)
    assert torch.equal(out.entropy, grad_mode.entropy)
    assert torch.equal(out.loss, grad_mode.loss.detach())
