"""Partial rounds: each replica's Δ_r counted by the share of the round it trained.

A straggler's inner steps may stop early (docs/fault_tolerance.md, "Stragglers"): replica r
then brings Δ_r after h_r ≤ H steps, i.e. a fraction f_r = h_r / H of the round's tokens. Every
merge takes the weighted pseudo-gradients

    Δ'_r = (n · f_r / Σ_s f_s) · Δ_r      over the n replicas merged,

so the mean of the Δ'_r is the token-weighted mean Σ_r f_r Δ_r / Σ_s f_s, and a merge of every
Δ_r (TSV, ISO-CTS, TIES) sees each replica's direction scaled by its share. With equal shares
the factors are all exactly 1: nothing is scaled and every merge is what it is without
stragglers, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def share_factors(shares: Sequence[float]) -> list[float] | None:
    """The factor n·f_r/Σf of each of n replicas that trained shares `shares` of the round
    (each > 0), or None when the shares are all equal (no replica is scaled)."""
    if any(not share > 0 for share in shares):
        raise ValueError(f"every merged replica must have trained (shares {list(shares)})")
    if len(set(shares)) <= 1:
        return None
    total = sum(shares)
    return [len(shares) * share / total for share in shares]


def weighted(deltas: Sequence[Tensor], shares: Sequence[float]) -> list[Tensor]:
    """`deltas` (one tensor's Δ_r, replica by replica) as a merge takes them when the replicas
    trained `shares` of the round: each scaled by its share_factors factor; the tensors
    themselves (not copies) when every share is equal."""
    factors = share_factors(shares)
    if factors is None:
        return list(deltas)
    return [delta * factor for delta, factor in zip(deltas, factors)]
