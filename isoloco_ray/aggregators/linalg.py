"""Dense linear algebra shared by the spectral merges (docs/strategies.md).

Everything here works on batches of matrices ``(b, m, n)`` in float64 and is exact up to
float rounding:

- ``top_svd``: the top-q singular triplets from ``eigh`` of the Gram matrix of the smaller
  side, which is several times cheaper than an SVD on CPU.
- ``polar64``: the polar factor U Vᵀ, from the Gram matrix on CPU and from the QDWH iteration
  (run until it has converged) on CUDA.
- ``polar_with_orthonormal_block``: the polar factor of ``[X, Q]`` when Q already has
  orthonormal columns and X has few columns, through a small eigenproblem only.
- ``eigh_top``: the top-q eigenpairs of a Gram matrix, from a refined float32 ``eigh`` on CPU
  when q is small.
- ``gram_cols`` / ``mean64``: aᵀa from blocks (symmetric: about a quarter fewer flops) and the
  float64 replica mean a cache-sized chunk at a time, the CPU costs around the eigensolver.

On CPU, LAPACK's ``eigh`` of the Gram matrix (about seven matrix products' time at n = 1024)
is the cheapest exact route to polar factors and top-q triplets that was found, square
matrices included (σ_min/σ_max ~ 1e-5 for the tests' synthetic 1024² ones): QDWH (4-5
iterations of QR or Cholesky solves) is 2-4 times slower even given σ_min, the scaled Newton
iteration (about 12 inversions) about 3 times, Newton-Schulz has not converged after 30
iterations, and a float32 eigensolver refined in float64 loses the accuracy the merges need
where replicas nearly coincide. Only where a few top eigenvectors are wanted (ISO-CTS's
task-specific blocks, ``eigh_top``) does a float32 ``eigh`` pay: it starts one float64
subspace-iteration step whose Ritz residuals are checked.

A Gram matrix squares the condition number, so every Gram-based result is checked, per
matrix, and recomputed with a plain SVD where it fails (numerically rank-deficient matrices,
an all-zero one): singular triplets need the eigenvalues they use above ``GRAM_TRUST`` times
the largest; polar factors need a first-order bound of their error below ``POLAR_TRUST``
(`polar_error_bound`). So the fast path never changes the function that is computed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

# LAPACK's failure to converge.
LinAlgError: type[Exception] = torch.linalg.LinAlgError

# Eigenvalue ratio below which Gram-based singular triplets are recomputed by SVD. Singular
# vectors from a float64 Gram carry errors of about eps64 * (sigma_1 / sigma_j)^2 / relative
# gap; at 1e-10 that stays near 1e-6, far inside the tolerances of docs/strategies.md.
GRAM_TRUST = 1e-10
# Largest Ritz residual, relative to the largest eigenvalue, accepted from the refined
# float32 eigensolver (`eigh_top`). It bounds each eigenvector's angle error by 1e-7 λ_1 / gap;
# measured on the tests' pseudo-gradients: residuals 2e-8 to 8e-8, angles below 1e-6.
EIGH_REFINE_TRUST = 1e-6
# Largest estimated relative error (Frobenius) of a polar factor built from a Gram matrix;
# above it the SVD is used. ISO-C's tolerance against the SVD version is 1e-4.
POLAR_TRUST = 1e-5

# QDWH: starting lower bound for the smallest singular value of A / ||A||_F. Any value
# below the true one converges in at most six iterations (Nakatsukasa, Bai & Gygi 2010);
# matrices with even smaller singular values still converge, the convergence test sees to it.
_QDWH_L0 = {torch.float64: 1e-12, torch.float32: 1e-6}
_QDWH_MAX_ITER = 30

# Symmetric products (`gram_cols`) split their output into blocks down to this size.
_SYM_BLOCK = 256
# Rows per chunk when `mean64` accumulates: the float64 chunk stays in cache across replicas.
_MEAN_CHUNK_ROWS = 128

# How the merges compute polar factors (see polar64); "auto" picks by device. Tests set it to
# "qdwh" to run the CUDA path on CPU.
POLAR_METHOD = "auto"


def eigh_desc(gram: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues (descending) and eigenvectors (columns, same order) of symmetric matrices."""
    values, vectors = torch.linalg.eigh(gram)
    return values.flip(-1), vectors.flip(-1)


def eigh_top(gram: Tensor, q: int) -> tuple[Tensor, Tensor]:
    """The q largest eigenvalues (descending) and their eigenvectors of symmetric float64
    matrices.

    On CPU, when q is at most n/16 (ISO-CTS's task-specific blocks; n >= 256), a float32
    ``eigh`` (about 40% less time than float64 at n = 512) gives a starting block of 2q
    vectors; one float64 subspace-iteration step and a Rayleigh-Ritz projection onto it give
    the top q with float64 eigenvalues and eigenvectors within about 1e-6 (angle). Each matrix
    whose Ritz residuals ‖G y − θ y‖ exceed ``EIGH_REFINE_TRUST`` times its largest eigenvalue
    is recomputed with a float64 ``eigh``.
    """
    n = gram.shape[-1]
    if gram.is_cuda or 16 * q > n or n < 256:
        return _eigh_top_exact(gram, q)
    # Scaled to a largest entry of 1 so that float32 neither underflows nor overflows.
    scale = gram.abs().amax((-2, -1), keepdim=True).clamp_min(torch.finfo(gram.dtype).tiny)
    start = torch.linalg.eigh((gram / scale).float()).eigenvectors[..., -2 * q:]
    basis = torch.linalg.qr(gram @ start.to(gram.dtype)).Q
    theta, rotation = torch.linalg.eigh(basis.mT @ gram @ basis)
    values, vectors = theta[..., -q:].flip(-1), basis @ rotation[..., -q:].flip(-1)
    residual = torch.linalg.vector_norm(gram @ vectors - vectors * values.unsqueeze(-2), dim=-2)
    # An all-zero matrix passes the residual test with zero vectors: it takes eigh's basis.
    ok = (residual <= EIGH_REFINE_TRUST * values[..., :1]).all(-1) & (values[..., 0] > 0)
    repair(ok, (values, vectors), lambda index: _eigh_top_exact(gram[index], q))
    return values, vectors


def _eigh_top_exact(gram: Tensor, q: int) -> tuple[Tensor, Tensor]:
    values, vectors = torch.linalg.eigh(gram)
    n = gram.shape[-1]
    return values[..., n - q:].flip(-1), vectors[..., n - q:].flip(-1)


def trusted(smallest_used: Tensor, scale: Tensor) -> Tensor:
    """Per matrix: may a Gram-based result relying on eigenvalues down to `smallest_used` be
    trusted, `scale` being the largest eigenvalue (or an upper bound of it)?"""
    return smallest_used > GRAM_TRUST * scale


def repair(ok: Tensor, outputs: Sequence[Tensor],
           recompute: Callable[[Tensor], Sequence[Tensor]]) -> None:
    """Overwrite, in place, the batch entries of `outputs` where `ok` is False with
    `recompute(index)` (a slower, always-valid method applied to those entries only)."""
    if bool(ok.all()):
        return
    index = (~ok).nonzero().squeeze(1)
    for out, new in zip(outputs, recompute(index)):
        out[index] = new.to(out.dtype)


def lower_mirrored(g: Tensor) -> Tensor:
    """g (..., n, n) with its strict upper triangle replaced by the transpose of its lower one.
    A BLAS product bᵀb is symmetric only up to rounding with some CPUs' kernels (MKL's SSE4.2
    and AVX paths, AMD EPYC): mirroring copies values, so the result is symmetric exactly."""
    n = g.shape[-1]
    upper = torch.ones(n, n, dtype=torch.bool, device=g.device).triu_(1)
    return torch.where(upper, g.mT, g)


def gram_cols(a: Tensor) -> Tensor:
    """aᵀa for a batch (b, m, n), exactly symmetric on every CPU and GPU. On CPU the diagonal
    blocks are computed recursively and each off-diagonal block once, then mirrored (the
    smallest diagonal blocks too, `lower_mirrored`): a symmetric rank-k update,
    which torch does not expose (10-25% less time than one matmul for n >= 2·_SYM_BLOCK)."""
    n = a.shape[-1]
    if n < 2 * _SYM_BLOCK or a.is_cuda:
        return lower_mirrored(a.mT @ a)
    out = a.new_empty(*a.shape[:-2], n, n)

    def fill(lo: int, hi: int) -> None:
        if hi - lo < 2 * _SYM_BLOCK:
            block = a[..., lo:hi]
            out[..., lo:hi, lo:hi] = lower_mirrored(block.mT @ block)
            return
        mid = (lo + hi) // 2
        fill(lo, mid)
        fill(mid, hi)
        out[..., mid:hi, lo:mid] = a[..., mid:hi].mT @ a[..., lo:mid]
        out[..., lo:mid, mid:hi] = out[..., mid:hi, lo:mid].mT

    fill(0, n)
    return out


def gram(a: Tensor) -> Tensor:
    """The Gram matrix of the smaller side: aᵀa for tall (m >= n), a aᵀ for wide matrices."""
    return gram_cols(a) if a.shape[-2] >= a.shape[-1] else gram_cols(a.mT)


def top_svd(a: Tensor, q: int) -> tuple[Tensor, Tensor, Tensor]:
    """Top-q singular triplets (U (b,m,q), S (b,q) descending, V (b,n,q)) of float64 matrices.

    Computed from ``eigh`` of the Gram matrix of the smaller side; the other side's vectors
    are a·v/σ (or aᵀ·u/σ). Matrices whose q-th eigenvalue is too small for that to be accurate
    get a plain SVD instead (its top-q triplets, with LAPACK's orthonormal completion for any
    zero singular values).
    """
    tall = a.shape[-2] >= a.shape[-1]
    if q == 0:
        return a.new_zeros(*a.shape[:-1], 0), a.new_zeros(*a.shape[:-2], 0), \
            a.new_zeros(*a.shape[:-2], a.shape[-1], 0)
    values, vectors = eigh_top(gram(a), q)
    s = values.clamp_min(0).sqrt()
    ok = trusted(values[..., -1], values[..., 0])
    # Entries that fail the test may divide by zero here; they are replaced below.
    other = (a @ vectors if tall else a.mT @ vectors) / s.unsqueeze(-2)
    u, v = (other, vectors) if tall else (vectors, other)

    def exact(index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        uu, ss, vh = svd_robust(a[index])
        return uu[..., :q], ss[..., :q], vh[..., :q, :].mT

    repair(ok, (u, s, v), exact)
    return u, s, v


def polar_error_bound(values: Tensor) -> Tensor:
    """Estimated relative error of the polar factor A (AᵀA)^{-1/2} when AᵀA has eigenvalues
    `values` (b, k) and is known up to rounding: a perturbation δG of the Gram matrix moves
    the polar factor by δG_ij / (σ_j (σ_i + σ_j)) in the singular bases, and eigh's backward
    error is |δG| ≈ eps·λ_max. Infinite (or NaN) for singular matrices, and for Gram matrices
    whose smallest eigenvalue is within a factor 1/eps of underflow."""
    k = values.shape[-1]
    # On singular values scaled to [0, 1], in float32 (an estimate; it overflows only where
    # the bound is far above any trust level): eps·λ_max·‖·‖ becomes eps·‖·‖.
    s = (values / values.amax(-1, keepdim=True)).clamp_min(0).sqrt().float()
    amplification = torch.linalg.matrix_norm(
        1.0 / (s.unsqueeze(-2) * (s.unsqueeze(-1) + s.unsqueeze(-2))))
    finfo = torch.finfo(values.dtype)
    bound = finfo.eps * amplification.to(values.dtype) / math.sqrt(k)
    # A Gram matrix this close to underflow has lost its relative accuracy: not trusted either.
    return bound.masked_fill_(values.amin(-1) < finfo.tiny / finfo.eps, math.inf)


def psd_inv_sqrt(g: Tensor) -> tuple[Tensor, Tensor]:
    """G^{-1/2} of Gram matrices G = AᵀA, and per matrix whether A G^{-1/2} (a polar factor)
    can be trusted (`polar_error_bound` at most POLAR_TRUST)."""
    values, vectors = torch.linalg.eigh(g)
    ok = polar_error_bound(values) <= POLAR_TRUST  # NaN compares False: not trusted
    # G^{-1/2} = W Wᵀ with W = V Λ^{-1/4}: a symmetric product.
    root = vectors * values.clamp_min(torch.finfo(values.dtype).tiny).pow(-0.25).unsqueeze(-2)
    return gram_cols(root.mT), ok


def _svd_one(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    try:
        return torch.linalg.svd(a, full_matrices=False)
    except LinAlgError:
        pass
    try:  # the same decomposition; LAPACK takes another path and usually converges
        u, s, vh = torch.linalg.svd(a.mT, full_matrices=False)
        return vh.mT, s, u.mT
    except LinAlgError:
        pass
    # Polar decomposition A = Q H by QDWH, then eigh of the symmetric H = W S Wᵀ.
    tall = a.shape[-2] >= a.shape[-1]
    x = a if tall else a.mT
    q = polar_qdwh(x.unsqueeze(0))[0]
    h = q.mT @ x
    s, w = eigh_desc((h + h.mT) / 2)
    u = q @ w
    return (u, s, w.mT) if tall else (w, s, u.mT)


def svd_robust(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Reduced SVD (U, S, Vh) of a batch. LAPACK's gesdd occasionally fails to converge
    (clustered singular values); such matrices are retried transposed, then by QDWH + eigh."""
    try:
        return torch.linalg.svd(a, full_matrices=False)
    except LinAlgError:
        u, s, vh = zip(*[_svd_one(x) for x in a])
        return torch.stack(u), torch.stack(s), torch.stack(vh)


def polar_svd(a: Tensor) -> Tensor:
    """Polar factor U Vᵀ from a plain SVD: the reference method, and the fallback."""
    u, _, vh = svd_robust(a)
    return u @ vh


def polar_gram(a: Tensor) -> Tensor:
    """Polar factor via the Gram matrix of the smaller side: a (aᵀa)^{-1/2} or (a aᵀ)^{-1/2} a.

    Numerically rank-deficient matrices (including zero ones) are recomputed by SVD.
    """
    h, ok = psd_inv_sqrt(gram(a))
    q = a @ h if a.shape[-2] >= a.shape[-1] else h @ a
    repair(ok, (q,), lambda index: (polar_svd(a[index]),))
    return q


def _qdwh_weights(lower: float) -> tuple[float, float, float]:
    """Dynamically weighted Halley coefficients (a, b, c) for the lower bound `lower`."""
    l2 = lower * lower
    d = (4.0 * (1.0 - l2) / (l2 * l2)) ** (1.0 / 3.0)
    sq = math.sqrt(1.0 + d)
    a = sq + 0.5 * math.sqrt(8.0 - 4.0 * d + 8.0 * (2.0 - l2) / (l2 * sq))
    b = (a - 1.0) ** 2 / 4.0
    return a, b, a + b - 1.0


def polar_qdwh(a: Tensor, max_iter: int = _QDWH_MAX_ITER) -> Tensor:
    """Polar factor by the QDWH iteration (Nakatsukasa, Bai & Gygi 2010), iterated to convergence.

    Each step maps every singular value σ to σ(a + bσ²)/(1 + cσ²) with weights chosen from a
    lower bound of the smallest σ, so all of them reach 1 in at most six steps; the steps use
    a QR factorisation while c is large (stable for any conditioning) and a Cholesky solve
    after. It stops when ||X_k − X_{k−1}||_F ≤ (5 eps)^{1/3}: the iteration is cubically
    convergent, so the last iterate is then accurate to about eps. Zero singular values stay
    zero (a rank-deficient matrix gives its partial isometry). If it has not converged after
    `max_iter` steps (not expected in float64) the SVD result is returned, with a warning.
    Meant for float64: TF32 and reduced-precision reductions, whatever torch's global
    setting, never touch float64 products (`polar64`).
    """
    if a.shape[-2] < a.shape[-1]:
        return polar_qdwh(a.mT, max_iter).mT
    m, n = a.shape[-2:]
    eps = torch.finfo(a.dtype).eps
    norm = torch.linalg.matrix_norm(a).clamp_min(torch.finfo(a.dtype).tiny)
    x = a / norm[..., None, None]
    eye = torch.eye(n, dtype=a.dtype, device=a.device).expand(*a.shape[:-2], n, n)
    lower = _QDWH_L0.get(a.dtype, 1e-6)
    stop = (5.0 * eps) ** (1.0 / 3.0)
    for _ in range(max_iter):
        wa, wb, wc = _qdwh_weights(lower)
        if wc > 100.0:
            q, _ = torch.linalg.qr(torch.cat([math.sqrt(wc) * x, eye], dim=-2))
            step = (q[..., :m, :] @ q[..., m:, :].mT) * ((wa - wb / wc) / math.sqrt(wc))
        else:
            chol = torch.linalg.cholesky(eye + wc * (x.mT @ x))
            step = torch.cholesky_solve(x.mT, chol).mT * (wa - wb / wc)
        x_next = x * (wb / wc) + step
        change = torch.linalg.matrix_norm(x_next - x).max()
        x = x_next
        lower = min(1.0, lower * (wa + wb * lower * lower) / (1.0 + wc * lower * lower))
        if float(change) <= stop and lower > 1.0 - 1e-3:
            return x
    warnings.warn("QDWH polar iteration did not converge; using the SVD", RuntimeWarning,
                  stacklevel=2)
    return polar_svd(a)


def polar64(a: Tensor, method: str | None = None) -> Tensor:
    """Polar factor of each matrix in a float64 batch. `method`: "auto" (QDWH on CUDA, Gram +
    eigh elsewhere), "gram", "qdwh" or "svd"; None means the module's POLAR_METHOD."""
    method = method or POLAR_METHOD
    if method == "auto":
        method = "qdwh" if a.is_cuda else "gram"
    if method == "gram":
        return polar_gram(a)
    if method == "qdwh":
        return polar_qdwh(a)
    if method == "svd":
        return polar_svd(a)
    raise ValueError(f"polar method must be one of 'auto', 'gram', 'qdwh', 'svd'; got {method!r}")


def polar(matrix: Tensor, method: str | None = None) -> Tensor:
    """The polar factor Q = U Vᵀ of `matrix` (reduced SVD M = U S Vᵀ; docs/strategies.md, `isoc`).

    `matrix` is (m, n) or a batch (..., m, n); the result has its shape and dtype and is
    computed in float64. `method` as in `polar64` (default: QDWH on CUDA, Gram + eigh with an
    SVD fallback elsewhere). For a rank-deficient matrix the polar factor is not unique; any
    orthonormal completion (or, with QDWH, the partial isometry) may be returned.
    """
    if matrix.dim() < 2:
        raise ValueError(f"polar needs a matrix (2 or more dims); got shape {tuple(matrix.shape)}")
    batch = matrix.reshape(-1, *matrix.shape[-2:]).to(torch.float64)
    result = polar64(batch, method)
    return result.reshape(matrix.shape).to(matrix.dtype)


def polar_with_orthonormal_block(x: Tensor, q: Tensor) -> Tensor:
    """polar([x, q]) for float64 batches where q (b,p,c) has orthonormal columns and x (b,p,t)
    has few, without any eigenproblem larger than 2t × 2t.

    With A = qᵀx, the Gram matrix is G = I + [[xᵀx − I, Aᵀ], [A, 0]]; the correction lies in
    the span of Z = blockdiag(I_t, Y), Y an orthonormal basis of range(A) (from a QR of A). So
    G^{-1/2} = I + Z (K^{-1/2} − I) Zᵀ with the small K = Zᵀ G Z, and
    polar([x, q]) = [x, q] + [x, qY] (K^{-1/2} − I) Zᵀ. Badly conditioned cases fall back to
    the general polar factor.
    """
    t = x.shape[-1]
    if q.shape[-1] == 0:
        return polar64(x)
    if t == 0:
        return q.clone()
    y, _ = torch.linalg.qr(q.mT @ x)
    xz = torch.cat([x, q @ y], dim=-1)
    h, ok = psd_inv_sqrt(xz.mT @ xz)
    h.diagonal(dim1=-2, dim2=-1).sub_(1.0)
    corr = xz @ h
    result = torch.cat([x + corr[..., :t], q + corr[..., t:] @ y.mT], dim=-1)
    repair(ok, (result,), lambda index: (polar64(torch.cat([x[index], q[index]], dim=-1)),))
    return result


def mean64(deltas: Sequence[Tensor]) -> Tensor:
    """(1/R) Σ_r Δ_r accumulated in float64, replicas in order (any shapes, all equal).

    Large tensors are summed a chunk of rows at a time, so that the float64 partial sums stay
    in cache while every replica is added (the same additions, in the same order)."""
    first = deltas[0]
    total = torch.empty(first.shape, dtype=torch.float64, device=first.device)
    if first.dim() < 2 or first.is_cuda or first.numel() <= _MEAN_CHUNK_ROWS * first.shape[-1]:
        total.copy_(first)
        for delta in deltas[1:]:
            total += delta
        return total.div_(len(deltas))
    rows = [d.reshape(-1, first.shape[-1]) for d in deltas]
    out = total.view(-1, first.shape[-1])
    for start in range(0, out.shape[0], _MEAN_CHUNK_ROWS):
        chunk = out[start:start + _MEAN_CHUNK_ROWS]
        chunk.copy_(rows[0][start:start + _MEAN_CHUNK_ROWS])
        for r in rows[1:]:
            chunk += r[start:start + _MEAN_CHUNK_ROWS]
    return total.div_(len(deltas))
