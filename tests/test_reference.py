"""The float64 reference on its own: hand-worked cases, invariants, gradcheck, and bad settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reference

# ---------------------------------------------------------------- a hand-worked micro-batch
# W = identity, so the hidden states *are* the logits. Two sequences, two positions, vocabulary of 3;
# the second sequence's last position is padding.
Z = np.array([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]], [[-1.0, 1.0, 3.0], [9.0, 9.0, 9.0]]])
Y = np.array([[0, 2], [1, 0]])
M = np.array([[1.0, 1.0], [1.0, 0.0]])
A = np.array([1.5, -0.5])
OLD_SHIFT = np.array([[0.3, -0.1], [-0.4, 0.0]])  # old = logp - shift  =>  r = shift


def numpy_logp_entropy():
    lse = np.log(np.exp(Z).sum(-1))
    p = np.exp(Z - lse[..., None])
    logp = np.take_along_axis(Z, Y[..., None], -1)[..., 0] - lse
    return logp, -(p * np.log(p)).sum(-1)


def run_hand_case(**settings):
    hidden = torch.tensor(Z, requires_grad=True)
    logp, _ = numpy_logp_entropy()
    old = torch.tensor(logp - OLD_SHIFT)
    return reference.grpo_loss(
        hidden,
        torch.eye(3, dtype=torch.float64),
        torch.tensor(Y),
        torch.tensor(M),
        torch.tensor(A),
        old_per_token_logps=old,
        **settings,
    )


def hand_expected(loss_type, eps=0.2):
    """Per-token losses written out from docs/semantics.md with the ratios of OLD_SHIFT, then normalized."""
    logp, _ = numpy_logp_entropy()
    coef = np.exp(OLD_SHIFT)  # [[1.3499, 0.9048], [0.6703, 1]]
    adv = A[:, None]
    if loss_type == "cispo":
        tok = -np.minimum(coef, eps) * adv * logp
    elif loss_type == "sapo":
        tau = np.where(adv > 0, 1.0, 1.05)
        tok = -4 / tau / (1 + np.exp(-tau * (coef - 1))) * adv
    elif loss_type == "vespo":
        lw = (OLD_SHIFT * M).sum(-1, keepdims=True)
        k, lam = np.where(adv >= 0, 2.0, 3.0), np.where(adv >= 0, 3.0, 2.0)
        tok = -np.exp(lam + k * lw - lam * np.exp(lw)) * adv * logp
    else:
        tok = -np.minimum(coef * adv, np.clip(coef, 1 - eps, 1 + eps) * adv)
    s = (tok * M).sum(-1)
    L = M.sum(-1)
    return {
        "grpo": (s / L).mean(),
        "sapo": (s / L).mean(),
        "bnpo": s.sum() / M.sum(),
        "dr_grpo": s.sum() / (2 * 4),
        "luspo": s.mean(),
        "dapo": s.sum() / M.sum(),
        "cispo": s.sum() / M.sum(),
        "vespo": s.sum() / M.sum(),
    }[loss_type]


@pytest.mark.parametrize("loss_type", reference.LOSS_TYPES)
def test_hand_worked_loss(loss_type):
    extra = {"max_completion_length": 4} if loss_type == "dr_grpo" else {}
    if loss_type == "cispo":
        extra["epsilon_high"] = 1.2
    out = run_hand_case(loss_type=loss_type, **extra)
    expected = hand_expected(loss_type, eps=1.2 if loss_type == "cispo" else 0.2)
    assert float(out.loss) == pytest.approx(expected, rel=1e-12)


def test_hand_worked_grpo_numbers():
    """The grpo case worked by hand: tokens (0,0) and (1,0) are clipped, (0,1) is not.
    seq 0: A=1.5, coef 1.34986 > 1.2 -> -1.2*1.5 = -1.8; coef 0.904837 -> -1.357256 ; mean -1.578628
    seq 1: A=-0.5, coef 0.670320 < 0.8 -> -min(-0.335160, -0.4) = 0.4.  loss = (-1.578628 + 0.4) / 2."""
    out = run_hand_case(loss_type="grpo")
    assert float(out.loss) == pytest.approx((-(1.8 + 1.5 * np.exp(-0.1)) / 2 + 0.4) / 2, rel=1e-12)
    assert float(out.metrics["clip_ratio/low_mean"]) == pytest.approx(1 / 3)
    assert float(out.metrics["clip_ratio/high_mean"]) == pytest.approx(1 / 3)
    assert float(out.metrics["clip_ratio/low_min"]) == 0.0
    assert float(out.metrics["clip_ratio/high_max"]) == 0.5


def test_hand_worked_statistics():
    logp, entropy = numpy_logp_entropy()
    out = run_hand_case()
    np.testing.assert_allclose(out.per_token_logps.numpy(), logp * M, rtol=1e-13)
    np.testing.assert_allclose(out.entropy.numpy(), entropy * M, rtol=1e-13)
    assert out.entropy_mask is None


def test_hand_worked_entropy_mask():
    """Active entropies sorted: e.g. three values; q = 0.5 keeps those >= their median (linear quantile)."""
    _, entropy = numpy_logp_entropy()
    active = entropy[M == 1]
    tau = np.quantile(active.astype(np.float32), 0.5)
    out = run_hand_case(top_entropy_quantile=0.5)
    np.testing.assert_array_equal(out.entropy_mask.numpy(), (entropy * M >= tau) & (M == 1))
    assert out.entropy_mask.sum() == 2


# ---------------------------------------------------------------- invariants
def random_batch(seed=0, B=4, T=6, H=5, V=13, mask_rate=0.3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > mask_rate).long()
    mask[:, 0] = 1
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return hidden, weight, ids, mask, adv


def test_quantile_one_gives_no_mask():
    out = reference.grpo_loss(*random_batch(), top_entropy_quantile=1.0)
    assert out.entropy_mask is None


def test_quantile_zero_keeps_only_the_maximum():
    out = reference.grpo_loss(*random_batch(), top_entropy_quantile=0.0)
    assert out.entropy_mask.sum() == 1
    assert out.entropy[out.entropy_mask] == out.entropy.max()


def test_on_policy_grpo_gradient_is_minus_advantage_over_length():
    _, _, ids, mask, adv = random_batch()
    logp = (-torch.rand(ids.shape, dtype=torch.float64)).requires_grad_()
    entropy = torch.rand(ids.shape, dtype=torch.float64)
    out = reference.grpo_objective(logp, entropy, mask, adv, loss_type="grpo")
    out.loss.backward()
    L = mask.sum(-1, keepdim=True).double()
    expected = -adv[:, None] / L / len(adv) * mask
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=0)


def test_sequence_advantages_equal_their_broadcast():
    hidden, weight, ids, mask, adv = random_batch()
    for loss_type in reference.LOSS_TYPES:
        kw = {"loss_type": loss_type, "max_completion_length": 6}
        a = reference.grpo_loss(hidden, weight, ids, mask, adv, **kw).loss
        b = reference.grpo_loss(hidden, weight, ids, mask, adv[:, None].expand_as(mask).clone(), **kw).loss
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_type", reference.LOSS_TYPES)
def test_gradient_accumulation_scales_like_trl(loss_type):
    """All loss types divide by gas, dapo/cispo/vespo through gas / spg, where spg defaults to gas
    (N = spg * active tokens): so with spg fixed, loss(gas=4) = loss(gas=1) / 4."""
    batch = random_batch()
    kw = {"loss_type": loss_type, "max_completion_length": 6, "steps_per_generation": 1}
    one = reference.grpo_loss(*batch, gradient_accumulation_steps=1, **kw).loss
    four = reference.grpo_loss(*batch, gradient_accumulation_steps=4, **kw).loss
    torch.testing.assert_close(four, one / 4, rtol=1e-12, atol=1e-15)


def test_masked_positions_are_ignored():
    hidden, weight, ids, mask, adv = random_batch()
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(ids.shape, generator=g, dtype=torch.float64)
    poisoned_ids = torch.where(mask.bool(), ids, 10**6)
    poisoned_old = torch.where(mask.bool(), old, float("nan"))
    kw = {"loss_type": "grpo", "top_entropy_quantile": 0.5}
    a = reference.grpo_loss(hidden, weight, ids, mask, adv, old_per_token_logps=old, **kw)
    b = reference.grpo_loss(hidden, weight, poisoned_ids, mask, adv, old_per_token_logps=poisoned_old, **kw)
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=0)
    assert torch.isfinite(b.loss)


def test_all_masked_batch_is_finite_zero():
    hidden, weight, ids, mask, adv = random_batch()
    for loss_type in reference.LOSS_TYPES:
        out = reference.grpo_loss(
            hidden,
            weight,
            ids,
            torch.zeros_like(mask),
            adv,
            loss_type=loss_type,
            max_completion_length=6,
            top_entropy_quantile=0.5,
        )
        assert float(out.loss) == 0.0
        out.loss.backward()


@pytest.mark.parametrize("loss_type", reference.LOSS_TYPES)
def test_gradcheck(loss_type):
    hidden, weight, ids, mask, adv = random_batch(B=2, T=3, H=3, V=5)
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    old = -torch.rand(ids.shape, generator=g, dtype=torch.float64) * 2
    ref = -torch.rand(ids.shape, generator=g, dtype=torch.float64) * 2
    # cispo's and vespo's weights are stop-gradient functions of logp - old: finite differences would see
    # them move, so check those two on-policy (old = logp.detach()), where the weights stay constant, and
    # without the bias-corrected KL (whose ratio is then constant to finite differences but not to autograd).
    detached_weights = loss_type in ("cispo", "vespo")
    old = None if detached_weights else old

    def f(h, w, b):
        return reference.grpo_loss(
            h,
            w,
            ids,
            mask,
            adv,
            bias=b,
            old_per_token_logps=old,
            ref_per_token_logps=ref,
            beta=0.1,
            loss_type=loss_type,
            max_completion_length=3,
            entropy_coef=0.05,
            temperature=0.7,
            use_bias_correction_kl=not detached_weights,
            epsilon_high=3.0 if loss_type == "cispo" else None,
            final_logit_softcapping=4.0,
            logit_scale=1.3,
        ).loss

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


# ---------------------------------------------------------------- bad settings
@pytest.mark.parametrize(
    "settings, name",
    [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"importance_sampling_level": "batch"}, "importance_sampling_level"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile"),
        ({"top_entropy_quantile": -0.1}, "top_entropy_quantile"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"loss_type": "dr_grpo"}, "max_completion_length"),
        ({"beta": 0.04}, "ref_per_token_logps"),
    ],
)
def test_bad_settings_raise_naming_the_setting(settings, name):
    with pytest.raises(ValueError, match=name):
        reference.grpo_loss(*random_batch(), **settings)


def test_unknown_setting_is_a_type_error():
    with pytest.raises(TypeError, match="epsilon"):
        reference.grpo_loss(*random_batch(), epsilon=0.2)


def test_trl_warnings_for_unusual_combinations():
    with pytest.warns(UserWarning, match="luspo"):
        reference.grpo_loss(*random_batch(), loss_type="luspo", importance_sampling_level="token")


def test_large_quantile_path_matches_torch_quantile_below_the_limit(monkeypatch):
    """The sort-based path (used past 2**24 values) agrees with torch.quantile where both apply."""
    from reference import objective as obj

    values = torch.rand(10_001, dtype=torch.float32)
    expected = [torch.quantile(values, p) for p in (0.0, 0.2, 0.5, 0.8, 1.0)]
    monkeypatch.setattr(obj, "QUANTILE_LIMIT", 100)
    for p, e in zip((0.0, 0.2, 0.5, 0.8, 1.0), expected, strict=True):
        torch.testing.assert_close(obj.quantile_linear(values, p), e, rtol=1e-6, atol=1e-7)
