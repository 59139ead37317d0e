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


@pytest.mark.parametrize("temperature", ["float", "per token"])
def test_primitive_fp32_matches_reference_on_gpu(temperature):
    """fused_linear_logprobs compiled, float32 (TF32 off), per-token temperature, zero-gradient rows."""
    import reference
    from compiled_grpo import fused_linear_logprobs

    g = torch.Generator().manual_seed(5)
    B, T, H, V = 4, 300, 256, 32003
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) / H**0.5
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[torch.rand(B, T, generator=g) < 0.3] = -100
    temp = 0.7 if temperature == "float" else (torch.rand(B, T, generator=g) + 0.5).cuda()
    g_logp = torch.randn(B, T, generator=g) * (torch.rand(B, T, generator=g) < 0.2)
    results = []
    for fn, dtype in ((fused_linear_logprobs, torch.float32), (reference.fused_linear_logprobs, torch.float64)):
        h, w = (t.cuda().to(dtype).requires_grad_() for t in (hidden, weight))
        logp, entropy = fn(h, w, targets.cuda(), temperature=temp)[:2]
        (logp * g_logp.cuda().to(dtype)).sum().backward()
        results.append((logp, entropy, h.grad, w.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)


def test_primitive_against_trls_triton_head_on_gpu():
    """The TRL drop-in and TRL's own ChunkedLogProbFunction (its Triton path) on the same bf16 inputs, both against
    float64 on those inputs: TRL rounds each logits tile to bf16 before its float32 statistics, this library keeps
    the GEMM output in float32, so ours must be at least as close to float64 on every output and gradient."""
    trl_kernels = pytest.importorskip("trl.kernels")
    import reference
    from compiled_grpo.integrations.trl import FusedHeadFunction

    g = torch.Generator(device="cuda").manual_seed(6)
    N, H, V = 2000, 512, 50000
    hidden = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=g) / H**0.5 * 2
    targets = torch.randint(0, V, (N,), device="cuda", generator=g)
    g_logp, g_entropy = torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g)
    outputs = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

    def run(fn, dtype=None):
        h, w = (t.to(dtype or t.dtype).clone().requires_grad_() for t in (hidden, weight))
        out = fn(h, w, targets)
        ((out[0] * g_logp.to(out[0].dtype)).sum() + (out[1] * g_entropy.to(out[1].dtype)).sum()).backward()
        return [*out, h.grad, w.grad]

    theirs = run(lambda h, w, t: trl_kernels.ChunkedLogProbFunction.apply(h, w, None, t, 0.9, 32768, None, 1.0,
                                                                            outputs))  # fmt: skip
    ours = run(lambda h, w, t: FusedHeadFunction.apply(h, w, None, t, 0.9, 32768, None, 1.0, outputs))
    exact = run(lambda h, w, t: reference.fused_linear_logprobs(h, w, t, temperature=0.9), torch.float64)
    names = ("log_probs", *outputs, "d hidden", "d weight")
    for name, a, b, r in zip(names, ours, theirs, exact, strict=True):
        if name == "is_top1":
            assert float((a != r).float().mean()) <= float((b != r).float().mean()) + 1e-3, name
            continue
        ours_error = float((a.double() - r.double()).abs().max())
        trl_error = float((b.double() - r.double()).abs().max())
        assert ours_error <= trl_error * 1.05 + 1e-6 * float(r.abs().max()), (name, ours_error, trl_error)


def test_extras_from_the_same_pass_on_gpu():
    """fused_linear_logprobs_with_extras (compiled, bf16, captured or not): log-probs and entropies the plain
    primitive's to float32 rounding (its statistics pass is another compiled kernel, whose sums Inductor may
    order differently: 1.9e-6 at logp ~ -12 measured), gradients to one bf16 rounding; the extra fields those of
    fused_linear_extra_statistics' separate pass."""
    from compiled_grpo import fused_linear_logprobs
    from compiled_grpo.logprobs import fused_linear_extra_statistics, fused_linear_logprobs_with_extras

    g = torch.Generator(device="cuda").manual_seed(8)
    N, H, V = 3000, 512, 50000
    hidden = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=g) / H**0.5 * 2
    targets = torch.randint(0, V, (N,), device="cuda", generator=g)
    targets[::7] = -100
    g_logp = torch.randn(N, device="cuda", generator=g)

    def run(fn, **options):
        h, w = (t.clone().requires_grad_() for t in (hidden, weight))
        logprobs, extras = fn(h, w, **options)
        (logprobs.logp.flatten() * g_logp).sum().backward()
        return [logprobs.logp, logprobs.entropy, h.grad, w.grad], extras

    plain, _ = run(lambda h, w: (fused_linear_logprobs(h, w, targets), None))
    alone = fused_linear_extra_statistics(hidden, weight, targets)
    for capture in (False, True):
        for _ in range(3):  # captured: the first call runs uncaptured, the second captures, the third replays
            fused, extras = run(lambda h, w, c=capture: fused_linear_logprobs_with_extras(h, w, targets, capture=c))
        for name, a, b in zip(("logp", "entropy", "d hidden", "d weight"), fused, plain, strict=True):
            error, scale = float((a.double() - b.double()).abs().max()), float(b.double().abs().max())
            ulp = 2**-22 if a.dtype == torch.float32 else 2**-7  # two float32 roundings, or one bf16 rounding
            assert error <= ulp * scale, (name, capture, error, scale)
        assert torch.equal(extras.is_top1, alone.is_top1)
        torch.testing.assert_close(extras.log_sum_sq_probs, alone.log_sum_sq_probs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(extras.mean_logits, alone.mean_logits, rtol=1e-5, atol=1e-6)


def test_audits_packed_cells_on_gpu():
    """The audit's packed (padding-free) cells on the GPU: every loss type on speed and sparse, eager, float32, all
    passing (their batch is packed on the GPU, indices included)."""
    from audits import loss_audit

    cells = [c for c in loss_audit.loss_cells(dtypes=("float32",), modes=("eager",)) if c.batch == "packed"]
    assert len(cells) == 2 * len(loss_audit.LOSS_TYPES)
    results = loss_audit.run(cells, loss_audit.QUICK, "cuda")
    failed = [r.name for r in results if not r.passed]
    assert not failed, failed


@pytest.mark.parametrize("schedule", ["speed", "memory", "sparse"])
def test_constant_inputs_and_a_second_backward_on_gpu(schedule):
    """An advantage tensor requiring grad is a constant, and a retained second backward doubles the gradients,
    through the compiled objective the GPU runs."""
    x = on_cuda(make_inputs(seed=7, B=4, T=300, H=256, V=32003, dtype=torch.float32, ref=True))
    settings = {"loss_type": "dapo", "beta": 0.04, "entropy_coef": 0.01}
    ref, ref_grads = run_reference(x, settings)
    given = x["advantages"].clone().requires_grad_()
    h, w = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    rest = {k: v for k, v in x.items() if k not in ("hidden", "weight", "completion_ids", "completion_mask",
                                                    "advantages")}  # fmt: skip
    out = FusedLinearGRPOLoss(compiled=True, schedule=schedule, **settings)(
        h, w, x["completion_ids"], x["completion_mask"], given, **rest
    )
    out.loss.backward(retain_graph=True)
    out.loss.backward()
    assert given.grad is None
    assert_matches(out, {"hidden": h.grad / 2, "weight": w.grad / 2}, ref, ref_grads, rtol=1e-4)


def captured_against_uncaptured_on_gpu(schedule, settings, seed, T=300, lengths=None, **inputs):
    """Four calls per completion length (`lengths`, default (T,), taking turns) on one lm_head (as in training)
    through a captured loss and through the same loss with its captured work run directly (same bucketed layout):
    bitwise equal, and the captured one equal to the reference in float32. Returns the captured loss's Captures."""
    from compiled_grpo import capture

    captured = FusedLinearGRPOLoss(compiled=True, schedule=schedule, capture=True, **settings)
    plain = FusedLinearGRPOLoss(compiled=True, schedule=schedule, capture=True, **settings)
    plain.captures = capture.Captures(limit=0)
    # the work run directly, in the mode and on the detached inputs a capture gives it (`Captures.run`): the same
    # compiled graphs. A graph compiled apart (grad mode on, say) is tuned apart: Inductor picks a reduction
    # kernel's configuration by timing it on the device, so two compilations can round differently
    plain.captures._run = lambda key, work, tensors: work(*tensors)
    lengths = (T,) if lengths is None else lengths
    make = lambda s, t: on_cuda(make_inputs(seed=s, B=4, T=t, H=256, V=32003, dtype=torch.float32, bias=True,
                                            **inputs))  # fmt: skip
    masks = {t: make(seed + 100 * j, t)["completion_mask"] for j, t in enumerate(lengths)}  # one layout per length
    first = make(seed, lengths[0])
    weight, bias = first["weight"].clone().requires_grad_(), first["bias"].clone().requires_grad_()
    per_token = [k for k in ("old_per_token_logps", "ref_per_token_logps") if k in first]
    for i in range(4 * len(lengths)):
        t = lengths[i % len(lengths)]
        x = make(seed + i, t)
        x["completion_mask"], x["weight"], x["bias"] = masks[t], first["weight"], first["bias"]
        results = []
        for loss_fn in (captured, plain):
            weight.grad = bias.grad = None
            h = x["hidden"].clone().requires_grad_()
            out = loss_fn(h, weight, x["completion_ids"], x["completion_mask"], x["advantages"], bias=bias,
                          num_items_in_batch=1000 + i, **{k: x[k] for k in per_token})  # fmt: skip
            out.loss.backward()
            results.append((out, {"hidden": h.grad, "weight": weight.grad.clone(), "bias": bias.grad.clone()}))
        (a, a_grads), (b, b_grads) = results
        assert torch.equal(a.loss, b.loss) and torch.equal(a.per_token_logps, b.per_token_logps)
        assert a.entropy_mask is None or torch.equal(a.entropy_mask, b.entropy_mask)
        assert all(torch.equal(a.metrics[k], b.metrics[k]) for k in b.metrics)
        assert all(torch.equal(a_grads[k], b_grads[k]) for k in b_grads)
        ref, ref_grads = run_reference(x, settings, num_items_in_batch=1000 + i)
        if ref.entropy_mask is not None and not torch.equal(a.entropy_mask.cpu(), ref.entropy_mask.cpu()):
            # a token on the threshold may land on the other side in float32: then compare with the fused mask
            flipped = a.entropy_mask.cpu() != ref.entropy_mask.cpu()
            tau = ref.entropy.cpu()[ref.entropy_mask.cpu()].min()
            assert (ref.entropy.cpu()[flipped] - tau).abs().max() <= 1e-5, "entropy mask differs off the threshold"
            override = {"entropy_mask_override": a.entropy_mask}
            ref, ref_grads = run_reference(x, settings, num_items_in_batch=1000 + i, **override)
        assert_matches(a, a_grads, ref, ref_grads, rtol=1e-4)
    assert not captured.captures.failures, captured.captures.failures
    return captured.captures


def test_captured_speed_schedule_on_gpu():
    """capture=True: the speed schedule's work as CUDA graph replays."""
    captures = captured_against_uncaptured_on_gpu("speed", {"loss_type": "dapo", "entropy_coef": 0.01, "beta": 0.04},
                                                  8, ref=True)  # fmt: skip
    assert captures.replays_of["speed"] == 3


@pytest.mark.parametrize(
    "schedule, settings",
    [
        ("memory", {"loss_type": "dapo", "entropy_coef": 0.01}),
        ("sparse", {"loss_type": "dapo", "top_entropy_quantile": 0.2}),
    ],
)
def test_captured_memory_and_sparse_passes_on_gpu(schedule, settings):
    """capture=True on the memory and sparse schedules: their whole forward (the entropy threshold included), their
    gradient pass and (at a length that is a bucket's) the value checks as replays (each graph: a warm-up, then a
    capture and a replay, then two replays)."""
    replays = captured_against_uncaptured_on_gpu(schedule, settings, 12, T=256).replays_of
    assert replays["whole forward"] == replays["value checks"] == replays["statistics checks"] == 3, replays


def test_captured_layouts_share_one_weight_gradient_on_gpu():
    """Two completion lengths taking turns (two token layouts, so two graphs of each pass): every gradient pass
    writes dW into one shared buffer, and each call's result, copied out right after its replay, is still its own
    (bitwise the uncaptured work's)."""
    from compiled_grpo import capture

    captures = captured_against_uncaptured_on_gpu("memory", {"loss_type": "dapo"}, 20, lengths=(256, 640))
    names = [capture.key_name(k) for k in captures.graphs]
    assert names.count("vocabulary-outer gradients") == 2 and captures.replays_of["vocabulary-outer gradients"] == 6
    assert [k[0] for k in captures.storages if k[0][0] == "output"].count(("output", "weight gradient")) == 1


@pytest.mark.parametrize("capture", [False, True], ids=["uncaptured", "captured"])
def test_value_checks_on_gpu(capture):
    """On a GPU: a bad id is named in its own call (its flag read with the plan's wait); a NaN in hidden is named
    at the next call (the check of a call's statistics is deferred, read from pinned memory after an event)."""
    x = on_cuda(make_inputs(dtype=torch.float32, bias=True))
    fn = FusedLinearGRPOLoss(schedule="memory", capture=capture)
    args = lambda **o: [{**x, **o}[k] for k in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")]
    ids = x["completion_ids"].clone()
    ids[0, 0] = x["weight"].shape[0]
    with pytest.raises(ValueError, match="completion_ids: id"):
        fn(*args(completion_ids=ids))
    hidden = x["hidden"].clone()
    hidden[0, 0, 1] = float("nan")
    fn(*args(hidden=hidden))
    with pytest.raises(ValueError, match="hidden: NaN or infinite value at an active position .found after an earlier"):
        fn(*args())
    out = fn(*args())
    fn.check()
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("schedule", ["memory", "sparse", "speed"])
def test_rounded_logits_on_gpu(schedule):
    """round_logits=True under compiled tiles: the log-probs are those of cuBLAS's bf16 product (a torch.compile
    that kept the product in float32 would give the default's), the gradients within the bf16 three-way bound."""
    x = on_cuda(make_inputs(seed=4, B=2, T=300, H=256, V=32003, dtype=torch.bfloat16, off_policy=False,
                            logit_std=4.0))  # fmt: skip
    settings = {"loss_type": "dapo", "top_entropy_quantile": 1.0 if schedule == "speed" else 0.5}
    default = run_fused(FusedLinearGRPOLoss(compiled=True, schedule=schedule, **settings), x)[0]
    out, grads = run_fused(FusedLinearGRPOLoss(compiled=True, schedule=schedule, round_logits=True, **settings), x)
    mask = x["completion_mask"].bool()
    z = (x["hidden"] @ x["weight"].T).float().log_softmax(-1)  # cuBLAS's bf16 output, TRL's logits
    logp = z.gather(-1, x["completion_ids"].unsqueeze(-1)).squeeze(-1)[mask]
    # mean, not max: a GEMM of another shape may round a target logit to its neighbouring bf16 value
    off = (out.per_token_logps[mask] - logp).abs().mean()
    assert off <= 1e-4 and off <= 0.1 * (default.per_token_logps[mask] - logp).abs().mean()
    over = {} if out.entropy_mask is None else {"entropy_mask_override": out.entropy_mask}
    ref, ref_grads = run_reference(x, {**settings, **over})
    naive_grads = run_naive_bf16(x, {**settings, **over})[1]
    for k in ("hidden", "weight"):
        scale = float(ref_grads[k].abs().max())
        assert max_error(grads[k], ref_grads[k]) <= max_error(naive_grads[k], ref_grads[k]) + 2e-2 * scale, k


def test_a_failed_capture_leaves_later_captures_working():
    """Work that reads the device back cannot be captured: CUDA ends the capture, and torch's capture_end raises
    before handing the graphs' pool back, so every later capture into that pool failed ("already recording to
    mempool_id"). A graph captured first (the pool made), then a key that fails: it runs uncaptured with its right
    value, its failure names the error raised inside the work, and a third key still captures into the pool."""
    from compiled_grpo.capture import CaptureNotice, Captures

    captures = Captures()
    x = torch.arange(8.0, device="cuda")
    for i in range(3):
        assert torch.equal(captures.run("doubles", lambda t: t * 2, [x + i]), (x + i) * 2)
    assert captures.replays_of["doubles"] == 2 and captures.pool is not None
    reads_back = lambda t: t * float(t.sum())  # a read of the device inside the capture
    with pytest.warns(CaptureNotice, match="could not be captured"):
        for _ in range(3):
            assert torch.equal(captures.run("reads back", reads_back, [x]), x * 28.0)
    assert len(captures.failures) == 1, captures.failures
    reason = captures.failures[0].splitlines()[0]
    assert reason.startswith("reads back:") and "previous error" not in reason, reason
    for i in range(3):
        assert torch.equal(captures.run("triples", lambda t: t * 3, [x + i]), (x + i) * 3)
    assert captures.replays_of["triples"] == 2 and len(captures.failures) == 1, captures.failures
