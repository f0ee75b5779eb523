"""ISO-C: the isotropic merge of one matrix (docs/strategies.md, `isoc`)."""

from __future__ import annotations

import torch
from torch import Tensor

from isoloco_ray.aggregators.linalg import polar64


def isoc64(a: Tensor) -> Tensor:
    """ISO-C of each matrix in a float64 batch (b, m, n): (‖M‖_* / k) · polar(M).

    Only the polar factor Q is needed, since U diag(mean S) Vᵀ = mean(S) · Q and
    ‖M‖_* = Σ S = ⟨Q, M⟩.
    """
    q = polar64(a)
    k = min(a.shape[-2:])
    nuclear = torch.linalg.vecdot(q.flatten(-2), a.flatten(-2))
    return q.mul_((nuclear / k)[..., None, None])


def isoc(matrix: Tensor) -> Tensor:
    """ISO-C(M) = U diag(s̄) Vᵀ, s̄ the mean of all k = min(m, n) singular values of M.

    `matrix` is (m, n) or a batch (..., m, n); the result has its shape and dtype, computed in
    float64. All its singular values equal s̄. An all-zero matrix gives zeros.
    """
    if matrix.dim() < 2:
        raise ValueError(f"isoc needs a matrix (2 or more dims); got shape {tuple(matrix.shape)}")
    batch = matrix.reshape(-1, *matrix.shape[-2:]).to(torch.float64)
    result = isoc64(batch)
    return result.reshape(matrix.shape).to(matrix.dtype)
