"""The bf16 recomputing backward's shifted GEMM (`passes.shifted_tiles`): log p from one bf16 GEMM of the rows
widened by -lse / a, against the float32 recompute it replaces and the float64 reference; where it does not apply
(float16, a softcap, a zero logit scale, rounded logits) the backward is the float32 recompute's, bitwise."""

from __future__ import annotations

import math

import pytest
import torch

import reference
from compiled_grpo import fused_linear_logprobs, streaming
from compiled_grpo.head import Head
from compiled_grpo.kernels import Kernels
from compiled_grpo.schedules import passes

TILES = {"token_tile": 64, "tail_tile": 16, "vocab_tile": 512}


def make(seed, N=96, H=40, V=1500, dtype=torch.bfloat16, offset=4.0):
    """Logits of std ~3 around `offset` (LLM logits sit far from 0, which a rounded logit pays for), H not a
    multiple of 8, V not a multiple of the vocabulary tile."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 3 / math.sqrt(H)
    bias = offset + 0.5 * torch.randn(V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (N,), generator=g)
    upstream = torch.randn(N, generator=g, dtype=torch.float64), 0.3 * torch.randn(N, generator=g, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), targets, upstream, g


def gradients(hidden, weight, bias, targets, upstream, compiled=False, **options):
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    out = fused_linear_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], compiled=compiled, **TILES, **options)
    total = (out.logp * upstream[0].to(out.logp.dtype)).sum() + (out.entropy * upstream[1].to(out.logp.dtype)).sum()
    return torch.autograd.grad(total, leaves)


def reference_gradients(hidden, weight, bias, targets, upstream, **options):
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    ref = reference.fused_linear_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], **options)
    total = (ref.logp * upstream[0]).sum() + (ref.entropy * upstream[1]).sum()
    return torch.autograd.grad(total, leaves)


def error(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def float32_recompute(monkeypatch, *args, **options):
    with monkeypatch.context() as m:
        m.setattr(passes, "SHIFTED_RECOMPUTE", False)
        return gradients(*args, **options)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_shift_columns_carry_the_shift_to_float32_precision(compiled):
    """-(hi + lo) = lse / a to ~2**-16 (a bf16 shift alone is off by 2**-9): under torch.compile too, which
    would elide a cast to bf16 and back and leave the low part 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 40, generator=g).bfloat16()
    lse = 300 * torch.rand(64, generator=g) + 5
    inv_temp = torch.rand(64, generator=g) + 0.5
    head = Head(torch.zeros(8, 40, dtype=torch.bfloat16), None, torch.tensor([1.3, 1.0, 1.0]), False, inv_temp)
    widened = Kernels(compiled).shifted_rows(x, lse, head)
    assert widened.shape == (64, streaming.shifted_width(40, head)) and widened.shape[1] % 8 == 0
    assert torch.equal(widened[:, :40], x) and not widened[:, 42:].any()
    shift = lse.double() / (1.3 * inv_temp.double())
    carried = -(widened[:, 40].double() + widened[:, 41].double())
    assert float(((carried - shift) / shift).abs().max()) < 2**-15
    assert widened[:, 41].abs().max() > 0


SETTINGS = {"plain": {}, "scale-temperature": {"temperature": 0.7, "logit_scale": 1.3},
            "per-token": {"per_token_temperature": True}, "negative": {"logit_scale": -0.5}}  # fmt: skip


@pytest.mark.parametrize("options", list(SETTINGS.values()), ids=list(SETTINGS))
def test_shifted_gradients_are_as_close_to_float64_as_the_float32_recompute(options, monkeypatch):
    hidden, weight, bias, targets, upstream, g = make(1)
    options = dict(options)
    if options.pop("per_token_temperature", False):
        options["temperature"] = torch.rand(targets.shape, generator=g, dtype=torch.float64) + 0.5
    args = (hidden, weight, bias, targets, upstream)
    ref = reference_gradients(*args, **options)
    shifted = gradients(*args, **options)
    fp32 = float32_recompute(monkeypatch, *args, **options)
    for name, s, f, r in zip(("hidden", "weight", "bias"), shifted, fp32, ref, strict=True):
        assert not torch.equal(s, f), f"{name}: the shifted GEMM was not used"
        assert error(s, r) <= 1.5 * error(f, r) + 1e-4, (name, error(s, r), error(f, r))


def test_compiled_shifted_gradients_match_eager():
    args = make(2)[:5]
    eager, compiled = gradients(*args), gradients(*args, compiled=True)
    ref = reference_gradients(*args)
    for e, c, r in zip(eager, compiled, ref, strict=True):
        assert error(c, r) <= 1.5 * error(e, r) + 1e-4


@pytest.mark.parametrize("case", ["float16", "softcap", "zero logit scale", "rounded"])
def test_the_float32_recompute_where_the_shift_does_not_apply(case, monkeypatch):
    hidden, weight, bias, targets, upstream, _ = make(3, dtype=torch.float16 if case == "float16" else torch.bfloat16)
    options = {"softcap": {"final_logit_softcapping": 30.0}, "zero logit scale": {"logit_scale": 0.0},
               "rounded": {"round_logits": True}}.get(case, {})  # fmt: skip
    args = (hidden, weight, bias, targets, upstream)
    got = gradients(*args, **options)
    fp32 = float32_recompute(monkeypatch, *args, **options)
    for a, b in zip(got, fp32, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)
