"""Partial rounds' weights (aggregators/weights.py): equal shares leave every Δ_r untouched,
unequal ones make the mean the token-weighted mean."""

from __future__ import annotations

import pytest
import torch

from isoloco_ray import aggregators


def test_equal_shares_scale_nothing():
    deltas = [torch.randn(3, 2, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    assert aggregators.share_factors([0.5, 0.5, 0.5]) is None
    weighted = aggregators.weighted(deltas, [1.0, 1.0, 1.0])
    assert all(w is d for w, d in zip(weighted, deltas))  # the tensors themselves


def test_the_mean_of_weighted_deltas_is_the_share_weighted_mean():
    generator = torch.Generator().manual_seed(0)
    deltas = [torch.randn(4, 3, dtype=torch.float64, generator=generator) for _ in range(3)]
    shares = [1.0, 0.25, 0.5]
    factors = aggregators.share_factors(shares)
    assert factors is not None and sum(factors) == pytest.approx(3.0)
    mean = torch.stack(aggregators.weighted(deltas, shares)).mean(dim=0)
    expected = sum(s * d for s, d in zip(shares, deltas)) / sum(shares)
    torch.testing.assert_close(mean, expected, rtol=1e-12, atol=1e-12)


def test_a_replica_that_trained_nothing_is_refused():
    with pytest.raises(ValueError, match="every merged replica must have trained"):
        aggregators.share_factors([1.0, 0.0])
