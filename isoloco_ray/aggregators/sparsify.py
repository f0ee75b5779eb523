"""TIES / DARE: sparsify each Δ_r, then a disjoint (sign-elected) or plain mean
(docs/strategies.md, "ties" and "dare")."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from isoloco_ray.aggregators.checks import (
    check_bool,
    check_choice,
    check_fraction,
    check_generator,
)
from isoloco_ray.aggregators.linalg import mean64

PRUNE_METHODS = ("magnitude", "random")
PRUNE_DIMS = ("all", "row", "column")

# Above this many scores the k-th value is searched in a bracket first (see _kth_smallest).
_BRACKET_MIN = 1 << 20
_BRACKET_SAMPLE = 1 << 16


def kept_count(units: int, sparsity: float) -> int:
    """Entries (or rows / columns) kept out of `units`: max(1, floor((1 − p)·N))."""
    return max(1, math.floor((1.0 - sparsity) * units))


def _kth_smallest(x: Tensor, j: int) -> Tensor:
    """The j-th smallest value (1-based) of a 1-D tensor.

    `torch.kthvalue` over tens of millions of entries is slow; a strided sample brackets the
    answer, and only the entries inside the bracket go through kthvalue. The result is exact:
    if the bracket misses (it cannot for a sane sample), the full kthvalue runs.
    """
    n = x.numel()
    if n <= _BRACKET_MIN:
        return torch.kthvalue(x, j).values
    sample = x[:: n // _BRACKET_SAMPLE].sort().values
    pos = (j - 1) * sample.numel() // n
    margin = 8 * math.isqrt(sample.numel()) + 16
    lo = sample[max(pos - margin, 0)]
    hi = sample[min(pos + margin, sample.numel() - 1)]
    below = int((x < lo).sum())
    inside = x[(x >= lo) & (x <= hi)]
    if below < j <= below + inside.numel():
        return torch.kthvalue(inside, j - below).values
    return torch.kthvalue(x, j).values


def _k_largest_mask(scores: Tensor, k: int) -> Tensor:
    """Boolean mask of exactly k of the largest scores; ties at the threshold go to the
    lowest indices (a deterministic rule, the same as a stable descending sort)."""
    n = scores.numel()
    if k >= n:
        return torch.ones_like(scores, dtype=torch.bool)
    threshold = _kth_smallest(scores, n - k + 1)
    mask = scores > threshold
    at = scores == threshold
    need = k - int(mask.sum())
    if int(at.sum()) == need:
        return mask | at
    return mask | (at & (at.cumsum(0) <= need))


def sparsify(delta: Tensor, sparsity: float, prune: str = "magnitude", prune_dim: str = "all",
             rescale: bool = False, generator: torch.Generator | None = None) -> Tensor:
    """Keep k = max(1, floor((1 − p)·N)) entries of `delta`, zero the rest (docs/strategies.md).

    - prune_dim "all": N = numel, entries ranked by |value|; "row" / "column" (2-D only):
      N = number of rows / columns, ranked by L2 norm, kept or dropped whole.
    - prune "magnitude": keep the largest (ties at the threshold: lowest index first);
      "random": keep a uniformly random k-subset, drawn from `generator` (required). The draw
      is k largest of N iid uniform float64 scores from ``torch.rand(N, generator=generator)``
      on the generator's device, so equal generator states give equal masks on every rank.
    - rescale: scale what is kept by 1/(1 − p).

    Returns a tensor of `delta`'s shape and dtype.
    """
    sparsity = check_fraction("sparsity", sparsity, 0.0, 1.0, high_open=True)
    check_choice("prune", prune, PRUNE_METHODS)
    check_choice("prune_dim", prune_dim, PRUNE_DIMS)
    check_bool("rescale", rescale)
    if prune_dim != "all" and delta.dim() != 2:
        raise ValueError(f"prune_dim {prune_dim!r} needs a 2-D tensor; got shape "
                         f"{tuple(delta.shape)} (use prune_dim 'all')")
    if prune == "random":
        if generator is None:
            raise ValueError("prune 'random' needs a generator (a seeded torch.Generator)")
        check_generator("generator", generator)

    units = delta.numel() if prune_dim == "all" else delta.shape[0 if prune_dim == "row" else 1]
    if prune == "random":
        assert generator is not None  # checked above
        scores = torch.rand(units, generator=generator, dtype=torch.float64,
                            device=generator.device).to(delta.device)
    elif prune_dim == "all":
        scores = delta.detach().reshape(-1).abs()
    else:
        # float64 norms: rows whose norms differ only in float32 rounding must rank as in
        # an exact computation.
        scores = torch.linalg.vector_norm(delta.detach().to(torch.float64),
                                          dim=1 if prune_dim == "row" else 0)
    mask = _k_largest_mask(scores, kept_count(units, sparsity))
    if prune_dim == "all":
        mask = mask.view(delta.shape)
    else:
        mask = mask[:, None] if prune_dim == "row" else mask[None, :]
    kept = delta / (1.0 - sparsity) if rescale else delta
    return torch.where(mask, kept, torch.zeros((), dtype=delta.dtype, device=delta.device))


def disjoint_merge(tensors: Sequence[Tensor]) -> Tensor:
    """TIES disjoint merge: per entry, the elected sign e = sign(Σ_r T_r) (summed in float64),
    then the mean of the T_r entries whose sign is e; zeros never count; 0 where none match.
    Result in the inputs' shape and dtype."""
    if len(tensors) == 0:
        raise ValueError("disjoint_merge needs at least one tensor")
    elected = mean64(tensors).sign_()
    total = torch.zeros_like(elected)
    count = torch.zeros_like(elected)
    for t in tensors:
        match = (t.sign() == elected) & (t != 0)
        total += torch.where(match, t, 0)
        count += match
    merged = torch.where(count > 0, total / count.clamp_min(1), 0)
    return merged.to(tensors[0].dtype)


def sparse_merge(deltas: Sequence[Tensor], *, sparsity: float, prune: str, prune_dim: str,
                 rescale: bool, disjoint: bool,
                 generators: Sequence[torch.Generator | None]) -> Tensor:
    """Sparsify each Δ_r (replica r draws from generators[r]), then the disjoint merge or the
    plain mean of what is kept."""
    kept = [sparsify(d, sparsity, prune, prune_dim, rescale, g)
            for d, g in zip(deltas, generators, strict=True)]
    if disjoint:
        return disjoint_merge(kept)
    return mean64(kept).to(deltas[0].dtype)
