"""Random micro-batches and the comparison of a fused result against the float64 reference."""

from __future__ import annotations

import math

import torch

import reference

# Small tiles so that T = 37 and V = 1021 exercise full tiles, tail tiles and a vocabulary tail.
TILES = {"token_tile": 64, "tail_tile": 8, "vocab_tile": 256, "speed_tile": 64}


def make_inputs(
    seed=0,
    B=3,
    T=37,
    H=16,
    V=1021,
    dtype=torch.float64,
    *,
    bias=False,
    adv_shape="B",
    is_shape=None,
    off_policy=True,
    sampling=False,
    ref=False,
    mask_rate=0.3,
    empty_row=True,
    logit_std=1.0,
):
    """A micro-batch with odd sizes (T, V not multiples of any tile), padded tails and one fully masked row."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    x = {
        "hidden": rn(B, T, H).to(dtype),
        "weight": (rn(V, H) * logit_std / math.sqrt(H)).to(dtype),
        "completion_ids": torch.randint(0, V, (B, T), generator=g),
        "completion_mask": (torch.rand(B, T, generator=g) > mask_rate).long(),
        "advantages": rn(B) if adv_shape == "B" else rn(B, T),
    }
    x["completion_mask"][:, 0] = 1
    if empty_row and B > 2:
        x["completion_mask"][1] = 0
    x["completion_mask"][0, T // 2 :] = 0  # a padded tail
    if bias:
        x["bias"] = (rn(V) * 0.5).to(dtype)
    with torch.no_grad():
        logp = reference.grpo_loss(x["hidden"], x["weight"], x["completion_ids"], x["completion_mask"], x["advantages"],
                                   bias=x.get("bias")).per_token_logps  # fmt: skip
    if off_policy:
        x["old_per_token_logps"] = logp + rn(B, T) * 0.2
    if ref:
        x["ref_per_token_logps"] = logp + rn(B, T) * 0.3
    if sampling:
        s = logp + rn(B, T) * 0.3
        s[torch.rand(B, T, generator=g) < 0.2] = float("nan")
        x["sampling_per_token_logps"] = s
    if is_shape is not None:
        shape = {"BT": (B, T), "B1": (B, 1), "B": (B,)}[is_shape]
        x["importance_sampling_ratio"] = torch.rand(*shape, generator=g, dtype=torch.float64) * 1.5 + 0.1
    return x


def leaves(x: dict) -> dict:
    """A copy with fresh leaves for hidden, weight and bias."""
    y = dict(x)
    for k in ("hidden", "weight", "bias"):
        if k in y:
            y[k] = x[k].detach().clone().requires_grad_()
    return y


def run_reference(x: dict, settings: dict):
    y = leaves(x)
    y64 = {k: (v.double() if k in ("hidden", "weight", "bias") else v) for k, v in y.items()}
    out = reference.grpo_loss(y64.pop("hidden"), y64.pop("weight"), y64.pop("completion_ids"),
                              y64.pop("completion_mask"), y64.pop("advantages"), **y64, **settings)  # fmt: skip
    out.loss.backward()
    return out, grads(y)


def run_fused(loss_fn, x: dict, **call):
    y = leaves(x)
    args = [y.pop(k) for k in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")]
    out = loss_fn(*args, **y, **call)
    out.loss.backward()
    y.update(zip(("hidden", "weight"), args[:2], strict=True))
    return out, grads(y)


def grads(y: dict) -> dict:
    return {k: y[k].grad for k in ("hidden", "weight", "bias") if k in y}


def assert_matches(fused, fused_grads, ref, ref_grads, rtol, atol=None):
    """Loss, every metric, logp, entropy, the entropy mask, and the gradients; errors relative to each
    quantity's largest magnitude (so near-zero entries do not make a relative error meaningless)."""
    atol = rtol * 1e-2 if atol is None else atol

    def close(a, b, what):
        a, b = a.detach().double(), b.detach().double()
        scale = max(float(b.abs().max()) if b.numel() else 0.0, 1e-12)
        err = float((a - b).abs().max()) if b.numel() else 0.0
        assert err <= rtol * scale + atol, f"{what}: error {err:.3e}, scale {scale:.3e}"

    close(fused.loss, ref.loss, "loss")
    assert set(fused.metrics) == set(ref.metrics), (sorted(fused.metrics), sorted(ref.metrics))
    for name, value in ref.metrics.items():
        if math.isnan(float(value)):
            assert math.isnan(float(fused.metrics[name])), name
        else:
            close(fused.metrics[name], value, name)
    close(fused.per_token_logps, ref.per_token_logps, "per_token_logps")
    close(fused.entropy, ref.entropy, "entropy")
    if ref.entropy_mask is None:
        assert fused.entropy_mask is None
    else:
        assert torch.equal(fused.entropy_mask, ref.entropy_mask), "entropy_mask"
    assert set(fused_grads) == set(ref_grads)
    for name, g in ref_grads.items():
        close(fused_grads[name], g, f"d {name}")
