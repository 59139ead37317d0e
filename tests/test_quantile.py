"""The entropy threshold: torch.quantile semantics at any size, and the mask it gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compiled_grpo import quantile


@pytest.mark.parametrize("p", [0.0, 0.2, 0.5, 0.8, 0.999, 1.0])
def test_large_path_equals_torch_quantile(monkeypatch, p):
    values = torch.rand(10_001, generator=torch.Generator().manual_seed(0))
    values[::7] = 0.5  # ties
    expected = torch.quantile(values, p)
    monkeypatch.setattr(quantile, "TORCH_QUANTILE_LIMIT", 100)
    torch.testing.assert_close(quantile.linear_quantile(values, p), expected, rtol=1e-6, atol=1e-7)


def test_more_than_2_to_the_24_values():
    """torch.quantile refuses this size; the threshold matches numpy's linear quantile of the same floats."""
    n = 2**24 + 3
    values = torch.rand(n, generator=torch.Generator().manual_seed(1)) * 4
    for p in (0.8, 0.5):
        got = float(quantile.linear_quantile(values, p))
        assert got == pytest.approx(float(np.quantile(values.numpy().astype(np.float64), p)), rel=1e-6)


def test_mask_keeps_ties_and_padding_out():
    entropy = torch.tensor([[1.0, 2.0, 2.0, 9.0], [2.0, 0.5, 3.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    got = quantile.high_entropy_mask(entropy, mask, q=0.5)
    # active values 1, 2, 2, 2, 0.5, 3: the 0.5-quantile is 2, so all three 2s are kept (>=), padding never
    assert got.tolist() == [[False, True, True, False], [True, False, True, False]]


def test_no_active_token_gives_an_empty_mask():
    got = quantile.high_entropy_mask(torch.rand(2, 3), torch.zeros(2, 3), q=0.2)
    assert not got.any()


@pytest.mark.parametrize("p", [0.0, 0.2, 0.5, 0.8, 0.999, 1.0])
def test_device_quantile_is_torch_quantile_bitwise(p):
    """The threshold a captured call takes with the count on the device: bitwise torch.quantile of the kept values,
    at random sizes, with ties, one kept value, NaN among the kept values, and none kept (+inf: nothing is >= it)."""
    g = torch.Generator().manual_seed(2)
    for trial in range(200):
        n = int(torch.randint(1, 400, (1,), generator=g))
        values = torch.randn(n, generator=g, dtype=torch.float64 if trial % 5 == 0 else torch.float32)
        if trial % 3 == 0:
            values = (values * 3).round() / 3  # ties
        keep = torch.rand(n, generator=g) < [0.0, 1.0 / n, 0.5, 1.0][trial % 4]
        if trial % 13 == 0:
            values[keep.nonzero()[:1]] = float("nan")
        got = quantile.masked_linear_quantile(values, keep, p)
        if not keep.any():
            assert got == float("inf")
            continue
        expected = torch.quantile(values[keep].float(), p)
        assert got.dtype == torch.float32 and (torch.equal(got, expected) or (got.isnan() and expected.isnan()))


def test_device_mask_equals_the_mask():
    entropy = torch.rand(4, 37, generator=torch.Generator().manual_seed(3))
    entropy[:, ::5] = 0.5  # ties at the threshold
    mask = torch.rand(4, 37, generator=torch.Generator().manual_seed(4)) < 0.7
    for q in (0.2, 0.5, 0.8):
        expected = quantile.high_entropy_mask(entropy, mask.float(), q)
        assert torch.equal(quantile.high_entropy_mask_on_device(entropy, mask.float(), q), expected)
