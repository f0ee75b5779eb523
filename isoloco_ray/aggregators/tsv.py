"""TSV-Merge: task singular vectors (docs/strategies.md, `tsv`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from isoloco_ray.aggregators.linalg import polar64, top_svd


def tsv_rank(k: int, keep_fraction: float) -> int:
    """Triplets kept per replica: q = max(1, floor(ρ·k))."""
    return max(1, math.floor(keep_fraction * k))


def tsv64(deltas: Sequence[Tensor], keep_fraction: float, decorrelate: bool) -> Tensor:
    """TSV-Merge of R replicas, each a batch (b, m, n); returns float64 (b, m, n).

    Per replica the top-q triplets of Δ_r (not divided by R); U = [U_1 … U_R],
    V = [V_1 … V_R], Σ = blockdiag(S_r). With `decorrelate`, U and V are replaced by their
    polar factors (computed in float64 from the small qR × qR Gram matrices: when replicas
    share directions, U is nearly rank-deficient and float32 would lose those directions).
    Result U Σ Vᵀ; with R = 1 and ρ = 1 it is Δ_1.
    """
    k = min(deltas[0].shape[-2:])
    q = tsv_rank(k, keep_fraction)
    triplets = [top_svd(delta.to(torch.float64), q) for delta in deltas]
    u = torch.cat([t[0] for t in triplets], dim=-1)
    s = torch.cat([t[1] for t in triplets], dim=-1)
    v = torch.cat([t[2] for t in triplets], dim=-1)
    del triplets
    if decorrelate:
        u, v = polar64(u), polar64(v)
    return (u * s.unsqueeze(-2)) @ v.mT
