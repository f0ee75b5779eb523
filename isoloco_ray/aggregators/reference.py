"""Plain reference versions of the merges, written straight from docs/strategies.md with
full SVDs.

Slow and simple on purpose: the tests and benchmarks/merge.py compare the fast
implementations of this package with these. Everything is computed in `dtype`
(float64 unless a caller asks otherwise) and returned in the inputs' dtype.
Also `realistic_deltas`, the synthetic pseudo-gradients both use.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import Tensor

from isoloco_ray.aggregators.linalg import LinAlgError

F64 = torch.float64


def svd(m: Tensor, dtype: torch.dtype = F64) -> tuple[Tensor, Tensor, Tensor]:
    """Reduced SVD M = U diag(S) Vh, singular values descending. LAPACK's gesdd now and then
    fails to converge on clustered singular values; the SVD of Mᵀ is the same decomposition."""
    try:
        return torch.linalg.svd(m.to(dtype), full_matrices=False)
    except LinAlgError:
        u, s, vh = torch.linalg.svd(m.to(dtype).T, full_matrices=False)
        return vh.T, s, u.T


def ref_polar(m: Tensor, dtype: torch.dtype = F64) -> Tensor:
    u, _, vh = svd(m, dtype)
    return u @ vh


def ref_isoc(m: Tensor, dtype: torch.dtype = F64) -> Tensor:
    """ISO-C(M) = U diag(mean S) Vᵀ."""
    u, s, vh = svd(m, dtype)
    return ((u * s.mean()) @ vh).to(m.dtype)


def ref_mean(deltas: list[Tensor], dtype: torch.dtype = F64) -> Tensor:
    """(1/R) Σ Δ_r computed in `dtype` and returned in `dtype`."""
    return torch.stack([d.to(dtype) for d in deltas]).mean(0)


def ref_isocts(deltas: list[Tensor], common_fraction: float = 0.8,
               dtype: torch.dtype = F64) -> Tensor:
    """ISO-CTS, docs/strategies.md steps 1-7."""
    r_count = len(deltas)
    d = [x.to(dtype) / r_count for x in deltas]                     # 1. scale
    c = cast(Tensor, sum(d))
    m, n = c.shape
    k = min(m, n)
    k_c = math.floor(k * common_fraction)                           # 2. sizes
    t = round((k - k_c) / r_count) * r_count
    t = min(t, (k // r_count) * r_count)  # t > k: cut as the package does
    k_c = k - t
    s = t // r_count
    u_c, s_c, vh_c = svd(c, dtype)                                  # 3. common
    u_c, s_c, vh_c = u_c[:, :k_c], s_c[:k_c], vh_c[:k_c]
    us, ss, vhs = [], [], []
    for d_r in d:                                                   # 4. task-specific
        e = d_r - u_c @ (u_c.T @ d_r)
        u, sv, vh = svd(e, dtype)
        us.append(u[:, :s])
        ss.append(sv[:s])
        vhs.append(vh[:s])
    u = torch.cat(us + [u_c], dim=1)                                # 5. stack
    sv = torch.cat(ss + [s_c])
    vh = torch.cat(vhs + [vh_c], dim=0)
    u, vh = ref_polar(u, dtype), ref_polar(vh, dtype)               # 6. orthogonalise
    sv = torch.full_like(sv, sv.mean().item())                      # 7. isotropic
    return ((u * sv) @ vh).to(deltas[0].dtype)


def ref_tsv(deltas: list[Tensor], keep_fraction: float | None = None, decorrelate: bool = True,
            dtype: torch.dtype = F64) -> Tensor:
    """TSV-Merge, docs/strategies.md steps 1-3."""
    rho = keep_fraction if keep_fraction is not None else 1.0 / len(deltas)
    k = min(deltas[0].shape)
    q = max(1, math.floor(rho * k))
    us, ss, vs = [], [], []
    for delta in deltas:
        u, s, vh = svd(delta, dtype)
        us.append(u[:, :q])
        ss.append(s[:q])
        vs.append(vh[:q].T)
    u, s, v = torch.cat(us, dim=1), torch.cat(ss), torch.cat(vs, dim=1)
    if decorrelate:
        u, v = ref_polar(u, dtype), ref_polar(v, dtype)
    return ((u * s) @ v.T).to(deltas[0].dtype)


def ref_magnitude_sparsify(x: Tensor, sparsity: float, prune_dim: str = "all",
                           rescale: bool = False) -> Tensor:
    """Keep max(1, floor((1-p) N)) entries / rows / columns of largest |x| / L2 norm (ties:
    lowest index first, by a stable sort)."""
    if prune_dim == "all":
        scores = x.reshape(-1).to(F64).abs()
    else:
        scores = torch.linalg.vector_norm(x.to(F64), dim=1 if prune_dim == "row" else 0)
    keep = max(1, math.floor((1.0 - sparsity) * scores.numel()))
    order = torch.sort(scores, descending=True, stable=True).indices
    mask = torch.zeros(scores.numel(), dtype=torch.bool, device=x.device)
    mask[order[:keep]] = True
    if prune_dim == "all":
        mask = mask.view(x.shape)
    else:
        mask = mask[:, None] if prune_dim == "row" else mask[None, :]
    out = torch.where(mask, x.to(F64), 0.0)
    if rescale:
        out = out / (1.0 - sparsity)
    return out.to(x.dtype)


def ref_disjoint_merge(tensors: list[Tensor]) -> Tensor:
    """TIES disjoint merge, vectorised: mean of the entries whose sign is sign(Σ T_r)."""
    t = torch.stack([x.to(F64) for x in tensors])
    elected = t.sum(0).sign()
    match = (t.sign() == elected) & (t != 0)
    count = match.sum(0)
    total = torch.where(match, t, 0.0).sum(0)
    return torch.where(count > 0, total / count.clamp_min(1), 0.0).to(tensors[0].dtype)


def ref_disjoint_merge_loop(tensors: list[Tensor]) -> Tensor:
    """TIES disjoint merge with a plain Python loop over entries (tiny tensors only)."""
    flat = [x.reshape(-1).tolist() for x in tensors]
    out = []
    for values in zip(*flat):
        total = math.fsum(values)
        elected = (total > 0) - (total < 0)
        kept = [v for v in values if v != 0 and ((v > 0) - (v < 0)) == elected]
        out.append(math.fsum(kept) / len(kept) if kept else 0.0)
    return torch.tensor(out, dtype=F64).reshape(tensors[0].shape).to(tensors[0].dtype)


def ref_merge(strategy: str, deltas: list[Tensor], dtype: torch.dtype = F64,
              **options: Any) -> Tensor:
    """The reference of `isoloco_ray.aggregators.merge` (magnitude pruning only)."""
    if deltas[0].dim() != 2 or strategy == "mean":
        return ref_mean(deltas, dtype).to(deltas[0].dtype)
    if strategy == "isoc":
        return ref_isoc(ref_mean(deltas, dtype), dtype).to(deltas[0].dtype)
    if strategy == "isocts":
        return ref_isocts(deltas, options.get("common_fraction", 0.8), dtype)
    if strategy == "tsv":
        return ref_tsv(deltas, options.get("keep_fraction"), options.get("decorrelate", True),
                       dtype)
    if strategy == "ties":
        kept = [ref_magnitude_sparsify(d, options.get("sparsity", 0.1),
                                       options.get("prune_dim", "all"),
                                       options.get("rescale", False)) for d in deltas]
        if options.get("disjoint", True):
            return ref_disjoint_merge(kept)
        return ref_mean(kept, dtype).to(deltas[0].dtype)
    raise ValueError(f"no reference for {strategy!r}")


def realistic_deltas(shape: tuple[int, int], replicas: int, generator: torch.Generator,
                     rank: int | None = None, noise: float = 0.05,
                     dtype: torch.dtype = torch.float32) -> list[Tensor]:
    """Synthetic pseudo-gradients shaped like real ones: far from isotropic.

    Δ_r = shared low-rank signal (power-law spectrum) + replica-specific low-rank part
    (weaker) + dense Gaussian noise, all seeded from `generator`.
    """
    m, n = shape
    k = min(m, n)
    rank = rank or max(2, k // 4)

    def low_rank(scale: float) -> Tensor:
        spectrum = scale / torch.arange(1, rank + 1, dtype=torch.float32).pow(0.8)
        a = torch.randn(m, rank, generator=generator) / math.sqrt(m)
        b = torch.randn(rank, n, generator=generator) / math.sqrt(n)
        return (a * spectrum) @ b

    shared = low_rank(1.0)
    unit_noise = 1.0 / math.sqrt(max(m, n))
    return [(shared + low_rank(0.4)
             + noise * unit_noise * torch.randn(m, n, generator=generator)).to(dtype)
            for _ in range(replicas)]
