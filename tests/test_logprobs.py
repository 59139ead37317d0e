"""`fused_linear_logprobs` against the float64 reference (full logits, plain autograd): values, gradients for
upstream gradients with zero rows, per-token temperature, ignore_index, softcap and scale, any leading shape;
no_grad bitwise; the GRPO loss's log-probs bitwise; the sparse backward's skipped rows; hand-worked cases."""

from __future__ import annotations

import math

import pytest
import torch
from cases import TILES

import reference
from compiled_grpo import FusedLinearGRPOLoss, fused_linear_logprobs, streaming
from compiled_grpo.config import GRPOLossConfig
from compiled_grpo.head import make_head
from compiled_grpo.logprobs import fused_linear_extra_statistics, fused_linear_logprobs_with_extras
from compiled_grpo.schedules import sparse_gradients

PRIMITIVE_TILES = {k: v for k, v in TILES.items() if k in ("token_tile", "tail_tile", "vocab_tile", "sparse_tile")}


def make(seed=0, shape=(3, 37), H=16, V=1021, dtype=torch.float64, ignored=0.3, logit_std=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * logit_std / math.sqrt(H)).to(dtype)
    bias = (torch.randn(V, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    targets = torch.randint(0, V, shape, generator=g)
    targets[torch.rand(shape, generator=g) < ignored] = -100
    return hidden, weight, bias, targets, g


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def grads_of(logp, entropy, upstream, inputs):
    g_logp, g_entropy = upstream
    total = (logp * g_logp).sum() + (0.0 if g_entropy is None or entropy is None else (entropy * g_entropy).sum())
    return torch.autograd.grad(total, inputs)


def compare(options, shape=(3, 37), g_entropy_scale=0.7, zero_rows=True, seed=0, **primitive):
    hidden, weight, bias, targets, g = make(seed, shape)
    g_logp = torch.randn(shape, generator=g, dtype=torch.float64)
    g_entropy = None if g_entropy_scale is None else torch.randn(shape, generator=g, dtype=torch.float64)
    if zero_rows:  # most rows with no upstream gradient, as in a GRPO batch
        keep = torch.rand(shape, generator=g) < 0.3
        g_logp = g_logp * keep
        g_entropy = None if g_entropy is None else g_entropy * keep * g_entropy_scale
    ref_in = leaves(hidden, weight, bias)
    ref = reference.fused_linear_logprobs(ref_in[0], ref_in[1], targets, bias=ref_in[2], **options)
    ref_grads = grads_of(ref.logp, ref.entropy, (g_logp, g_entropy), ref_in)
    ours_in = leaves(hidden, weight, bias)
    out = fused_linear_logprobs(ours_in[0], ours_in[1], targets, bias=ours_in[2], compiled=False, **PRIMITIVE_TILES,
                                **options, **primitive)  # fmt: skip
    ours_grads = grads_of(out.logp, out.entropy, (g_logp, g_entropy), ours_in)
    assert out.logp.shape == targets.shape and out.logp.dtype == torch.float64
    torch.testing.assert_close(out.logp, ref.logp, rtol=1e-10, atol=1e-10)
    assert bool((out.logp[targets == -100] == 0).all())
    if out.entropy is not None:
        torch.testing.assert_close(out.entropy, ref.entropy, rtol=1e-10, atol=1e-10)
        assert bool((out.entropy[targets == -100] == 0).all())
    for name, a, b in zip(("hidden", "weight", "bias"), ours_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)
    return out, ours_grads


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"temperature": 0.7},
        {"logit_scale": 0.5, "final_logit_softcapping": 3.0},
        {"temperature": 1.3, "final_logit_softcapping": 2.0, "logit_scale": 2.0},
    ],
    ids=["plain", "temperature", "scale-softcap", "all"],
)
@pytest.mark.parametrize("shape", [(3, 37), (91,), (2, 3, 7)], ids=["BT", "packed", "3d"])
def test_matches_reference(options, shape):
    compare(options, shape)


@pytest.mark.parametrize("per", ["sequence", "token"])
def test_temperature_per_sequence_and_per_token(per):
    g = torch.Generator().manual_seed(3)
    shape = (3, 1) if per == "sequence" else (3, 37)
    temperature = torch.rand(shape, generator=g, dtype=torch.float64) + 0.4
    compare({"temperature": temperature, "final_logit_softcapping": 4.0})


def test_a_per_sequence_temperature_of_shape_B_is_refused_when_B_equals_T():
    """[B] against [B, T] targets with B == T would broadcast per position, silently: an error naming the argument;
    [B, 1] is the per-sequence form, and a 0-d tensor is a scalar."""
    hidden, weight = torch.randn(4, 4, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    targets = torch.randint(0, 11, (4, 4))
    per_sequence = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"temperature: .* got shape \(4,\); .* temperature\[:, None\]"):
        fused_linear_logprobs(hidden, weight, targets, temperature=per_sequence, compiled=False)
    got = fused_linear_logprobs(hidden, weight, targets, temperature=per_sequence[:, None], compiled=False)
    want = reference.fused_linear_logprobs(hidden, weight, targets, temperature=per_sequence[:, None])
    torch.testing.assert_close(got.logp, want.logp)
    for i in range(4):  # each row at its own temperature
        row = reference.fused_linear_logprobs(hidden[i], weight, targets[i], temperature=float(per_sequence[i]))
        torch.testing.assert_close(got.logp[i], row.logp)
    scalar = fused_linear_logprobs(hidden, weight, targets, temperature=torch.tensor(0.5), compiled=False)
    torch.testing.assert_close(scalar.logp, fused_linear_logprobs(hidden, weight, targets, temperature=0.5,
                                                                  compiled=False).logp)  # fmt: skip


def test_entropy_false_and_no_entropy_gradient(monkeypatch):
    """entropy=False returns None and forms no entropy term; so does an entropy whose upstream gradient is 0."""
    seen = []
    original = streaming.logits_gradient
    monkeypatch.setattr(streaming, "logits_gradient", lambda z, o, rows, h: seen.append(rows.g_entropy) or
                        original(z, o, rows, h))  # fmt: skip
    out, _ = compare({}, g_entropy_scale=None, entropy=False)
    assert out.entropy is None
    assert seen and all(g is None for g in seen)
    seen.clear()
    compare({}, g_entropy_scale=0.0)  # an entropy gradient of zeros: the same
    assert seen and all(g is None for g in seen)
    seen.clear()
    compare({}, g_entropy_scale=0.7)
    assert seen and all(g is not None for g in seen)


def test_backward_skips_rows_without_upstream_gradient(monkeypatch):
    counts = []
    original = sparse_gradients.gradients_of_rows

    def counted(e, x, h, selected, *rest):
        counts.append(selected.numel())
        return original(e, x, h, selected, *rest)

    monkeypatch.setattr(sparse_gradients, "gradients_of_rows", counted)
    hidden, weight, bias, targets, _ = make(1)
    h, w = leaves(hidden, weight)
    logp, entropy = fused_linear_logprobs(h, w, targets, compiled=False, **PRIMITIVE_TILES)
    g = torch.zeros_like(logp)
    g[0, :5] = 1.0
    torch.autograd.backward([logp, entropy], [g, torch.zeros_like(entropy)])
    assert counts == [int((targets[0, :5] != -100).sum())]
    assert bool((h.grad[1:] == 0).all()) and bool((h.grad[0, 5:] == 0).all())


def test_backward_where_every_token_has_a_gradient_runs_over_the_forwards_slots(monkeypatch):
    """16-bit, every active token with a gradient, beyond the token-outer pass's rows: no compaction (the
    memory schedule's vocabulary-outer pass over the forward's slots), the gradients those of plain autograd."""
    compacted = []
    original = sparse_gradients.gradients_of_rows
    monkeypatch.setattr(sparse_gradients, "gradients_of_rows", lambda *a: compacted.append(1) or original(*a))
    hidden, weight, bias, targets, g = make(4, dtype=torch.bfloat16)
    ins = leaves(hidden, weight, bias)
    tiles = {**PRIMITIVE_TILES, "stats_rows": 16}  # more than 2 * 16 rows: the vocabulary-outer pass
    out = fused_linear_logprobs(*ins[:2], targets, bias=ins[2], compiled=False, **tiles)
    upstream = (torch.randn(targets.shape, generator=g), torch.randn(targets.shape, generator=g))
    ours = grads_of(out.logp, out.entropy, upstream, ins)
    assert not compacted
    ref_in = leaves(hidden.float(), weight.float(), bias.float())
    ref = reference.fused_linear_logprobs(*ref_in[:2], targets, bias=ref_in[2])
    exact = grads_of(ref.logp, ref.entropy, tuple(u.double() for u in upstream), ref_in)
    for name, a, b in zip(("hidden", "weight", "bias"), ours, exact, strict=True):
        scale = float(b.abs().max())
        assert float((a.double() - b.double()).abs().max()) < 2e-2 * scale, name
    assert bool((ours[0][targets == -100] == 0).all())


def test_all_ignored_and_empty():
    hidden, weight, _, targets, _ = make(2)
    h, w = leaves(hidden, weight)
    out = fused_linear_logprobs(h, w, torch.full_like(targets, -100), compiled=False)
    assert bool((out.logp == 0).all()) and bool((out.entropy == 0).all())
    out.logp.sum().backward()
    assert bool((h.grad == 0).all()) and bool((w.grad == 0).all())
    empty = fused_linear_logprobs(hidden[:0], weight, targets[:0], compiled=False)
    assert empty.logp.shape == (0, 37)


def test_custom_ignore_index():
    hidden, weight, _, targets, _ = make(4, ignored=0.0)
    targets[0, :3] = 7
    out = fused_linear_logprobs(hidden, weight, targets, ignore_index=7, compiled=False)
    ref = reference.fused_linear_logprobs(hidden, weight, targets, ignore_index=7)
    torch.testing.assert_close(out.logp, ref.logp, rtol=1e-10, atol=1e-12)
    assert bool((out.logp[targets == 7] == 0).all())


def test_hand_worked_two_token_vocabulary():
    """Logits [0, log 3] (p = 1/4, 3/4) at temperature 1, and [0, log 9] / 2 (the same) at temperature 2."""
    weight = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    hidden = torch.tensor([[math.log(3)], [math.log(9)]], dtype=torch.float64)
    targets = torch.tensor([1, 0])
    temperature = torch.tensor([1.0, 2.0], dtype=torch.float64)
    logp, entropy = fused_linear_logprobs(hidden, weight, targets, temperature=temperature, compiled=False)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(logp, torch.tensor([math.log(0.75), math.log(0.25)], dtype=torch.float64))
    torch.testing.assert_close(entropy, torch.tensor([h, h], dtype=torch.float64))
    # d logp / d hidden = (onehot - p) . w / temperature: (1 - 3/4) * 1 and (0 - 3/4) * 1 / 2
    h_leaf = hidden.clone().requires_grad_()
    fused_linear_logprobs(h_leaf, weight, targets, temperature=temperature, compiled=False).logp.sum().backward()
    torch.testing.assert_close(h_leaf.grad, torch.tensor([[0.25], [-0.375]], dtype=torch.float64))


@pytest.mark.parametrize("primitive", [fused_linear_logprobs, fused_linear_logprobs_with_extras],
                         ids=["logprobs", "with_extras"])  # fmt: skip
@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_without_grad_mode_bitwise(context, primitive):
    from torch.utils._pytree import tree_leaves

    hidden, weight, bias, targets, _ = make(5, dtype=torch.float32)
    h, w = leaves(hidden, weight)
    grad_mode = tree_leaves(primitive(h, w, targets, bias=bias, compiled=False))
    with context():
        out = tree_leaves(primitive(hidden, weight, targets, bias=bias, compiled=False))
    assert len(out) == len(grad_mode) >= 2
    for a, b in zip(out, grad_mode, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("schedule", ["memory", "sparse"])
def test_the_grpo_loss_log_probs_are_the_primitives_bitwise(schedule):
    """The loss's memory and sparse schedules stream the same engine on the same tiles."""
    hidden, weight, bias, targets, g = make(6, dtype=torch.float32)
    mask = (targets != -100).long()
    ids = targets.clamp(min=0)
    adv = torch.randn(3, generator=g)
    tiles = {**PRIMITIVE_TILES, "stats_rows": TILES.get("stats_rows", 256)}
    loss = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **tiles)(hidden, weight, ids, mask, adv, bias=bias)
    out = fused_linear_logprobs(hidden, weight, targets, bias=bias, compiled=False, **tiles)
    assert torch.equal(loss.per_token_logps, out.logp) and torch.equal(loss.entropy, out.entropy)


def test_bf16_three_way():
    """bf16: |ours - ref64| <= |plain bf16 autograd - ref64| + a small slack, values and gradients."""
    hidden, weight, bias, targets, g = make(7, shape=(4, 64), H=64, V=2003, dtype=torch.bfloat16, logit_std=3.0)
    g_logp = torch.randn(targets.shape, generator=g)
    g_entropy = torch.randn(targets.shape, generator=g) * 0.1
    ref_in = leaves(hidden, weight)
    ref = reference.fused_linear_logprobs(*ref_in, targets)
    ref_grads = grads_of(ref.logp, ref.entropy, (g_logp.double(), g_entropy.double()), ref_in)
    naive_in = leaves(hidden, weight)
    log_p = (naive_in[0] @ naive_in[1].T).log_softmax(-1)
    valid = targets != -100
    naive_logp = torch.where(valid, log_p.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0)
    naive_entropy = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0)
    naive_grads = grads_of(naive_logp.float(), naive_entropy.float(), (g_logp, g_entropy), naive_in)
    ours_in = leaves(hidden, weight)
    out = fused_linear_logprobs(*ours_in, targets, compiled=False, **PRIMITIVE_TILES)
    ours_grads = grads_of(out.logp, out.entropy, (g_logp, g_entropy), ours_in)
    err = lambda a, b: float((a.double() - b.double()).abs().max())
    for name, a, n, r in (("logp", out.logp, naive_logp, ref.logp), ("entropy", out.entropy, naive_entropy,
                                                                        ref.entropy)):  # fmt: skip
        assert err(a, r) <= err(n, r) + 1e-5 * float(r.abs().max()), name
    for name, a, n, r in zip(("hidden", "weight"), ours_grads, naive_grads, ref_grads, strict=True):
        assert err(a, r) <= err(n, r) + 1e-3 * float(r.abs().max()), name


def test_bad_inputs_name_the_argument():
    hidden, weight, bias, targets, _ = make(8, dtype=torch.float32)
    cases = [
        ({"hidden": hidden[..., :-1]}, "weight"),
        ({"weight": weight.double()}, "weight"),
        ({"targets": targets[:, :-1]}, "targets"),
        ({"targets": targets.float()}, "targets"),
        ({"bias": bias[:-1]}, "bias"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": torch.ones(2, 5)}, "temperature"),
        ({"temperature": torch.zeros(3, 1)}, "temperature"),
        ({"targets": targets.masked_fill(targets == -100, 5000)}, "targets"),
        ({"weight": torch.empty_like(weight, device="meta")}, "weight"),
        ({"token_tiles": 64}, "token_tiles"),
        ({"temprature": 0.7}, "did you mean 'temperature'"),
        ({"ignore_idx": 5}, "did you mean 'ignore_index'"),
        ({"temperature": torch.ones(3)}, r"temperature: expected a scalar or a tensor with targets' 2 dimensions"),
        ({"temperature": torch.ones(3, 37, 1)}, "temperature"),
        # options checked as the loss checks its own, with the same messages
        ({"entropy": "no"}, "entropy: expected True or False"),
        ({"validate": "no"}, "validate: expected True or False"),
        ({"round_logits": "no"}, "round_logits: expected True or False"),
        ({"capture": 1}, "capture: expected True or False"),
        ({"ignore_index": None}, "ignore_index: expected an int"),
        ({"ignore_index": "x"}, "ignore_index: expected an int"),
        ({"ignore_index": -1.5}, "ignore_index: expected an int"),
        ({"final_logit_softcapping": 0.0}, "final_logit_softcapping must be > 0"),
        ({"final_logit_softcapping": -5.0}, "final_logit_softcapping must be > 0"),
        ({"logit_scale": 0.0}, "logit_scale must be > 0"),
        ({"logit_scale": float("nan")}, "logit_scale must be > 0 and finite"),
    ]
    for change, name in cases:
        args = {"hidden": hidden, "weight": weight, "targets": targets, "bias": bias, **change}
        with pytest.raises((ValueError, TypeError), match=name):
            fused_linear_logprobs(args.pop("hidden"), args.pop("weight"), args.pop("targets"), compiled=False, **args)
    with pytest.raises(TypeError, match="compiled: expected True or False"):
        fused_linear_logprobs(hidden, weight, targets, compiled="yes")
    bad_weight = weight.clone()
    bad_weight[3, 2] = float("nan")
    with pytest.raises(ValueError, match="weight"):
        fused_linear_logprobs(hidden, bad_weight, targets, compiled=False)


@pytest.mark.parametrize("head", [{"temperature": 0.7}, {"final_logit_softcapping": 2.0, "logit_scale": 1.3}],
                         ids=["temperature", "softcap"])  # fmt: skip
def test_with_extras_is_the_primitive_plus_the_extra_fields(head):
    """fused_linear_logprobs_with_extras: the primitive's log-probs, entropies and gradients bitwise, and the
    reference's extra fields (and fused_linear_extra_statistics' bitwise), from the one statistics pass."""
    hidden, weight, bias, targets, g = make(shape=(3, 37))
    upstream = (
        torch.randn(3, 37, generator=g, dtype=torch.float64),
        torch.randn(3, 37, generator=g, dtype=torch.float64),
    )
    options = {"compiled": False, **PRIMITIVE_TILES, **head}
    plain_in, ours_in = leaves(hidden, weight, bias), leaves(hidden, weight, bias)
    plain = fused_linear_logprobs(plain_in[0], plain_in[1], targets, bias=plain_in[2], **options)
    ours, extras = fused_linear_logprobs_with_extras(ours_in[0], ours_in[1], targets, bias=ours_in[2], **options)
    assert torch.equal(ours.logp, plain.logp) and torch.equal(ours.entropy, plain.entropy)
    for a, b in zip(grads_of(*ours, upstream, ours_in), grads_of(*plain, upstream, plain_in), strict=True):
        assert torch.equal(a, b)
    assert not any(t.requires_grad for t in extras)
    ref = reference.fused_linear_logprobs(hidden, weight, targets, bias=bias, **head)
    torch.testing.assert_close(extras.log_sum_sq_probs, ref.log_sum_sq_probs, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(extras.mean_logits, ref.mean_logits, rtol=1e-10, atol=1e-10)
    assert torch.equal(extras.is_top1, ref.is_top1)
    alone = fused_linear_extra_statistics(hidden, weight, targets, bias=bias, **options)
    for a, b in zip(extras, alone, strict=True):
        assert torch.equal(a, b)


def test_is_top1_takes_the_first_maximum_across_fold_chunks():
    """The extra fields fold the vocabulary in chunks of FOLD_CHUNK entries: a maximum tied between two chunks
    (and within one) belongs to its lowest id, as torch.argmax and TRL's head have it; the other fields match
    the reference across the chunks and the tail."""
    V, chunk = 2 * streaming.FOLD_CHUNK + 100, streaming.FOLD_CHUNK
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(V, 8, generator=g, dtype=torch.float64) * 0.1
    hidden = torch.randn(6, 8, generator=g, dtype=torch.float64)
    top = hidden[0] / hidden[0].norm() * 3
    tied = (chunk + 5, 2 * chunk + 7, 17, chunk + 9)  # one id in each later chunk (the tail included), ...
    weight[list(tied)] = top  # ... and two in the first two chunks
    hidden[:] = hidden[0]
    targets = torch.tensor([17, chunk + 5, 2 * chunk + 7, chunk + 9, 3, 17])
    _, extras = fused_linear_logprobs_with_extras(hidden, weight, targets, compiled=False)
    assert extras.is_top1.tolist() == [True, False, False, False, False, True]
    ref = reference.fused_linear_logprobs(hidden, weight, targets)
    assert torch.equal(extras.is_top1, ref.is_top1)
    torch.testing.assert_close(extras.log_sum_sq_probs, ref.log_sum_sq_probs, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(extras.mean_logits, ref.mean_logits, rtol=1e-10, atol=1e-10)


def test_with_extras_refuses_a_vocabulary_parallel_head():
    hidden, weight, _, targets, _ = make()
    with pytest.raises(TypeError, match="vocab_parallel_group"):
        fused_linear_logprobs_with_extras(hidden, weight, targets, compiled=False, vocab_parallel_group=object())


@pytest.mark.compiled
def test_compiled_matches_reference_and_reuses_graphs():
    """Compiled, float32: the reference's values and gradients; new batch shapes and temperatures reuse the
    compiled tiles (one token-tile shape here, as in tests/test_fused_compiled.py)."""
    from torch._dynamo.utils import counters

    tiles = {"token_tile": 64, "tail_tile": 64, "vocab_tile": 256, "sparse_tile": 64}

    def run(seed, shape, temperature):
        hidden, weight, bias, targets, g = make(seed, shape, dtype=torch.float32)
        ins = leaves(hidden, weight, bias)
        out = fused_linear_logprobs(*ins[:2], targets, bias=ins[2], temperature=temperature, **tiles)
        ref_in = leaves(hidden, weight, bias)
        ref = reference.fused_linear_logprobs(*ref_in[:2], targets, bias=ref_in[2], temperature=temperature)
        up = (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        for a, b in zip(grads_of(out.logp, out.entropy, up, ins), grads_of(ref.logp, ref.entropy,
                        tuple(u.double() for u in up), ref_in), strict=True):  # fmt: skip
            torch.testing.assert_close(a.double(), b.double(), rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(out.logp.double(), ref.logp, rtol=2e-5, atol=2e-5)

    run(0, (3, 37), 0.8)
    graphs = counters["stats"]["unique_graphs"]
    run(1, (5, 29), 1.3)
    run(2, (111,), 0.6)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.compiled
def test_compiled_with_extras_is_the_compiled_primitive():
    """Compiled: the statistics pass with the extra fields gives the plain pass's log-probs and entropies (to a
    float32 rounding: another compiled kernel), and the reference's extra fields."""
    tiles = {"token_tile": 64, "tail_tile": 64, "vocab_tile": 256, "sparse_tile": 64}
    hidden, weight, bias, targets, _ = make(0, (3, 37), dtype=torch.float32)
    plain = fused_linear_logprobs(hidden, weight, targets, bias=bias, temperature=0.8, **tiles)
    ours, extras = fused_linear_logprobs_with_extras(hidden, weight, targets, bias=bias, temperature=0.8, **tiles)
    torch.testing.assert_close(ours.logp, plain.logp, rtol=2e-7, atol=2e-6)
    torch.testing.assert_close(ours.entropy, plain.entropy, rtol=2e-7, atol=2e-6)
    ref = reference.fused_linear_logprobs(hidden, weight, targets, bias=bias, temperature=0.8)
    torch.testing.assert_close(extras.log_sum_sq_probs.double(), ref.log_sum_sq_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(extras.mean_logits.double(), ref.mean_logits, rtol=1e-5, atol=1e-6)
    assert torch.equal(extras.is_top1, ref.is_top1)


def test_gradient_tiles_take_int32_ids_to_the_same_bits():
    """The tiles compare int32 target ids (`streaming.compared_ids`, faster to load per logit): the same gradient as
    int64 ids, bitwise, for a vocabulary slice and for whole-vocabulary rows."""
    hidden, weight, bias, targets, g = make(11, shape=(40,), dtype=torch.float32, ignored=0.0)
    lse = torch.logsumexp(hidden @ weight.T + bias, -1)
    upstream = [torch.randn(40, generator=g) for _ in range(3)]
    head = make_head(weight, bias, GRPOLossConfig(), torch.float32)
    results = []
    for ids in (targets, streaming.compared_ids(targets)):
        rows = streaming.RowGradients(ids, lse, *upstream)
        v0 = torch.tensor(512, dtype=ids.dtype)
        sliced = streaming.gradient_vocab_tile(hidden, rows, head.vocab_slice(512, 256), v0)
        out = torch.empty(40, weight.shape[0])
        streaming.gradient_from_product_tile(hidden @ weight.T, rows, head, out, False)
        results.append((sliced[0], sliced[1], out))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert streaming.compared_ids(targets).dtype == torch.int32
