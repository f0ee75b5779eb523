"""ISO-CTS: isotropic merge in common and task-specific subspaces (docs/strategies.md, `isocts`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from isoloco_ray.aggregators.linalg import (
    eigh_desc,
    eigh_top,
    gram_cols,
    mean64,
    polar_with_orthonormal_block,
    repair,
    svd_robust,
    top_svd,
    trusted,
)


def isocts_sizes(k: int, replicas: int, common_fraction: float) -> tuple[int, int]:
    """(k_c, s): common-subspace size and per-replica task-specific size (docs/strategies.md,
    `isocts` step 2).

    k_c = floor(k·f); t = round((k − k_c)/R)·R (Python's round, half to even); k_c = k − t;
    s = t/R. The definition leaves open the corner where rounding up makes t exceed k (only
    possible with a tiny k·f, e.g. f = 0, k = 3, R = 2); there t is cut to the largest multiple
    of R not above k.
    """
    k_c = math.floor(k * common_fraction)
    t = round((k - k_c) / replicas) * replicas
    t = min(t, (k // replicas) * replicas)
    return k - t, t // replicas


def _common_wide(c: Tensor, k_c: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Top-k_c triplets of C (m <= n) and an orthonormal basis of the complement of U_c.

    Both come from eigh of C Cᵀ (m × m, m = k): its trailing m − k_c = t eigenvectors span
    exactly the complement, which makes the residuals E_r cheap (see `_task_wide`).
    """
    values, vectors = eigh_desc(gram_cols(c.mT))
    u_c, basis = vectors[..., :k_c], vectors[..., k_c:]
    s_c = values[..., :k_c].clamp_min(0).sqrt()
    v_c = (c.mT @ u_c) / s_c.unsqueeze(-2)
    if k_c == 0:
        return u_c, s_c, v_c, basis
    ok = trusted(values[..., k_c - 1], values[..., 0])

    def exact(index: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        u, s, vh = svd_robust(c[index])  # u is m × m: a full basis
        return u[..., :k_c], s[..., :k_c], vh[..., :k_c, :].mT, u[..., k_c:]

    repair(ok, (u_c, s_c, v_c, basis), exact)
    return u_c, s_c, v_c, basis


def _task_wide(d: Tensor, basis: Tensor, s: int) -> tuple[Tensor, Tensor, Tensor]:
    """Top-s triplets of E = (I − U_c U_cᵀ) D when [U_c, basis] is a full orthonormal basis:
    E = basis (basisᵀ D), so the SVD of the t × n matrix basisᵀ D gives them."""
    u, sv, v = top_svd(basis.mT @ d, s)
    return basis @ u, sv, v


def _task_tall(d: Tensor, u_c: Tensor, s: int) -> tuple[Tensor, Tensor, Tensor]:
    """Top-s triplets of E = D − U_c U_cᵀ D for tall D, without forming E:
    EᵀE = DᵀD − WᵀW with W = U_cᵀ D, and E v = D v − U_c (W v)."""
    w = u_c.mT @ d
    g = gram_cols(d)
    scale = g.diagonal(dim1=-2, dim2=-1).sum(-1)  # ‖D‖_F²: the size of the cancellation error
    g -= gram_cols(w)
    values, v = eigh_top(g, s)
    sv = values.clamp_min(0).sqrt()
    u = (d @ v - u_c @ (w @ v)) / sv.unsqueeze(-2)
    ok = trusted(values[..., -1], scale)

    def explicit(index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        e = d[index] - u_c[index] @ w[index]
        return top_svd(e, s)

    repair(ok, (u, sv, v), explicit)
    return u, sv, v


def isocts64(deltas: Sequence[Tensor], common_fraction: float) -> Tensor:
    """ISO-CTS of R replicas, each a batch (b, m, n); returns float64 (b, m, n).

    Steps as docs/strategies.md: D_r = Δ_r/R, C = Σ D_r; top-k_c triplets of C; top-s triplets
    of each residual E_r = D_r − U_c U_cᵀ D_r; stack [task blocks in replica order, common block];
    polar factors of the stacked U and V; all singular values replaced by their mean.

    Fast path: the polar factors use that U_c and V_c are orthonormal already
    (`polar_with_orthonormal_block`); the residual SVDs use the complement basis of U_c when
    m <= n and the Gram identity EᵀE = DᵀD − (U_cᵀD)ᵀ(U_cᵀD) when m > n.
    """
    replicas = len(deltas)
    m, n = deltas[0].shape[-2:]
    k_c, s = isocts_sizes(min(m, n), replicas, common_fraction)
    c = mean64(deltas)
    if m <= n:
        u_c, s_c, v_c, basis = _common_wide(c, k_c)
    else:
        u_c, s_c, v_c = top_svd(c, k_c)
    del c
    blocks = []
    if s > 0:
        for delta in deltas:
            # The residual of D_r = Δ_r/R is that of Δ_r over R: the same singular vectors.
            d = delta.to(torch.float64)
            u, sv, v = _task_wide(d, basis, s) if m <= n else _task_tall(d, u_c, s)
            blocks.append((u, sv / replicas, v))
    u_task = torch.cat([b[0] for b in blocks] + [u_c[..., :0]], dim=-1)
    v_task = torch.cat([b[2] for b in blocks] + [v_c[..., :0]], dim=-1)
    s_bar = torch.cat([b[1] for b in blocks] + [s_c], dim=-1).mean(-1)
    pu = polar_with_orthonormal_block(u_task, u_c)
    pv = polar_with_orthonormal_block(v_task, v_c)
    return (pu * s_bar[..., None, None]) @ pv.mT
