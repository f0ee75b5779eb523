"""isoloco_ray.aggregators against its plain float64 SVD reference (aggregators/reference.py).

Outputs are compared as matrices (singular vectors have arbitrary signs), by relative
Frobenius error, with the tolerances docs/strategies.md sets per strategy.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from isoloco_ray.aggregators.reference import (
    realistic_deltas,
    ref_disjoint_merge_loop,
    ref_isoc,
    ref_magnitude_sparsify,
    ref_merge,
    ref_polar,
    ref_tsv,
)

from isoloco_ray.strategies import MERGES
from isoloco_ray.aggregators import (
    disjoint_merge,
    isoc,
    isocts_sizes,
    merge,
    merge_all,
    polar,
    sparsify,
    tsv_rank,
)

merge_module = importlib.import_module("isoloco_ray.aggregators.merge")
linalg = importlib.import_module("isoloco_ray.aggregators.linalg")


# Small matrices: one thread is faster, and immune to a busy machine's oversubscription.
pytestmark = pytest.mark.usefixtures("one_thread")


TOL = {"mean": 1e-5, "ties": 1e-5, "isoc": 1e-4, "tsv": 1e-3, "isocts": 3e-3}
SHAPES = [(64, 48), (48, 64), (96, 32), (40, 40)]
REPLICAS = [1, 2, 3, 8]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_deltas(kind: str, shape: tuple[int, int], replicas: int, seed: int,
                **kwargs) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return [torch.randn(*shape, generator=g) for _ in range(replicas)]
    return realistic_deltas(shape, replicas, g, **kwargs)


# --- exactness against the SVD reference -------------------------------------------------

@pytest.mark.parametrize("strategy", list(TOL))
@pytest.mark.parametrize("kind", ["random", "realistic"])
@pytest.mark.parametrize("replicas", REPLICAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matches_reference(strategy, kind, replicas, shape):
    deltas = make_deltas(kind, shape, replicas, seed=replicas * 1000 + shape[0] + shape[1])
    out = merge(strategy, deltas)
    assert out.dtype == torch.float32 and out.shape == shape
    assert rel_err(out, ref_merge(strategy, deltas)) <= TOL[strategy]


@pytest.mark.parametrize("options", [
    {"keep_fraction": 1.0}, {"keep_fraction": 0.3}, {"keep_fraction": 0.5, "decorrelate": False},
], ids=str)
@pytest.mark.parametrize("shape", [(64, 48), (40, 40), (32, 80)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("replicas", [2, 3])
def test_tsv_options(options, shape, replicas):
    deltas = make_deltas("realistic", shape, replicas, seed=7)
    assert rel_err(merge("tsv", deltas, **options), ref_merge("tsv", deltas, **options)) <= 1e-3


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("shape", [(64, 48), (48, 64), (40, 40)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("replicas", [2, 3])
def test_isocts_common_fraction(fraction, shape, replicas):
    deltas = make_deltas("realistic", shape, replicas, seed=11)
    out = merge("isocts", deltas, common_fraction=fraction)
    assert rel_err(out, ref_merge("isocts", deltas, common_fraction=fraction)) <= 3e-3


@pytest.mark.parametrize("strategy", ["isoc", "tsv", "isocts"])
@pytest.mark.parametrize("shape", [(64, 48), (48, 64), (40, 40)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_hard_inputs(strategy, shape):
    """Nearly rank-deficient deltas (noise 1e-5 beside a rank-k/2 signal, where the fast path
    must notice the Gram matrix is too ill-conditioned) and replicas that almost coincide
    (TSV's stacked bases then nearly rank-deficient)."""
    g = torch.Generator().manual_seed(3)
    faint = realistic_deltas(shape, 3, g, noise=1e-5)
    base = realistic_deltas(shape, 1, g)[0]
    close = [base + 1e-3 * torch.randn(*shape, generator=g) / math.sqrt(shape[0])
             for _ in range(4)]
    for deltas in (faint, close):
        assert rel_err(merge(strategy, deltas), ref_merge(strategy, deltas)) <= TOL[strategy]


@pytest.mark.parametrize("strategy", ["isoc", "tsv", "isocts"])
def test_cuda_polar_path_on_cpu(strategy, monkeypatch):
    """On CUDA the polar factors come from QDWH: the same merges, run here on CPU."""
    monkeypatch.setattr(linalg, "POLAR_METHOD", "qdwh")
    for shape, replicas in [((64, 48), 3), ((48, 64), 8), ((40, 40), 2)]:
        deltas = make_deltas("realistic", shape, replicas, seed=24)
        assert rel_err(merge(strategy, deltas), ref_merge(strategy, deltas)) <= TOL[strategy]
    zeros = [torch.zeros(40, 40)] * 2
    assert torch.equal(merge(strategy, zeros), zeros[0])


# --- structural properties -----------------------------------------------------------------

@pytest.mark.parametrize("shape", [(64, 48), (48, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_tsv_single_replica_returns_delta(shape):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(*shape, generator=g)
    low_rank = torch.randn(shape[0], 5, generator=g) @ torch.randn(5, shape[1], generator=g)
    for delta in (full, low_rank):
        assert rel_err(merge("tsv", [delta]), delta) <= 1e-6


def test_isocts_single_replica_is_isoc():
    """With R = 1 the task block holds exactly the rest of Δ_1's singular triplets."""
    delta = make_deltas("realistic", (64, 48), 1, seed=4)[0]
    assert rel_err(merge("isocts", [delta]), isoc(delta)) <= 1e-5


@pytest.mark.parametrize("kind", ["random", "realistic"])
def test_isoc_singular_values_equal(kind):
    m = make_deltas(kind, (64, 48), 1, seed=5)[0]
    s = torch.linalg.svdvals(isoc(m).double())
    s_ref = torch.linalg.svdvals(m.double()).mean()
    assert torch.allclose(s, s_ref.expand_as(s), rtol=1e-5)


@pytest.mark.parametrize("shape", [(64, 48), (48, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_zero_and_rank_deficient_inputs(shape):
    zeros = [torch.zeros(shape)] * 3
    for strategy in TOL:
        out = merge(strategy, zeros)
        assert torch.equal(out, torch.zeros(shape)), strategy
    g = torch.Generator().manual_seed(1)
    low = torch.randn(shape[0], 3, generator=g) @ torch.randn(3, shape[1], generator=g)
    out = isoc(low).double()
    # The polar factor of a rank-deficient matrix is not unique, but <Q, M> = ||M||_* for all.
    nuclear = torch.linalg.svdvals(low.double()).sum()
    assert torch.isfinite(out).all()
    assert math.isclose((out * low.double()).sum().item(), (nuclear ** 2 / 48).item(),
                        rel_tol=1e-5)
    for strategy in ("tsv", "isocts"):
        assert torch.isfinite(merge(strategy, [low, 2 * low])).all()


@pytest.mark.parametrize("strategy", ["isoc", "tsv", "isocts"])
def test_larger_matrices(strategy):
    for shape in [(240, 160), (160, 240)]:
        deltas = make_deltas("realistic", shape, 8, seed=21)
        assert rel_err(merge(strategy, deltas), ref_merge(strategy, deltas)) <= TOL[strategy]


@pytest.mark.parametrize("method", ["auto", "gram", "qdwh", "svd"])
def test_polar(method):
    g = torch.Generator().manual_seed(2)
    for shape in [(64, 48), (48, 64), (40, 40)]:
        a = torch.randn(*shape, generator=g, dtype=torch.float64)
        u, _, vh = torch.linalg.svd(a, full_matrices=False)
        ill = (u * torch.logspace(0, -8, min(shape), dtype=torch.float64)) @ vh
        for m in (a, ill):
            assert rel_err(polar(m, method=method), ref_polar(m)) <= 1e-7
    batch = torch.randn(2, 3, 20, 12, generator=g)
    out = polar(batch, method=method)
    assert out.shape == batch.shape and out.dtype == torch.float32
    assert rel_err(out[1, 2], ref_polar(batch[1, 2])) <= 1e-6
    assert torch.equal(polar(torch.zeros(8, 5), method=method).isnan(),
                       torch.zeros(8, 5, dtype=torch.bool))


@pytest.mark.parametrize("failures", [1, 2, 99])
def test_svd_robust_when_lapack_fails(failures, monkeypatch):
    """gesdd can fail to converge; retried per matrix, transposed, then by QDWH + eigh."""
    g = torch.Generator().manual_seed(22)
    a = torch.randn(3, 30, 20, generator=g, dtype=torch.float64)
    real_svd, calls = torch.linalg.svd, {"n": 0}

    def flaky(x, full_matrices=True):
        calls["n"] += 1
        if calls["n"] <= failures:
            raise torch.linalg.LinAlgError("did not converge")
        return real_svd(x, full_matrices=full_matrices)

    monkeypatch.setattr(torch.linalg, "svd", flaky)
    u, s, vh = linalg.svd_robust(a)
    monkeypatch.setattr(torch.linalg, "svd", real_svd)
    assert torch.allclose((u * s.unsqueeze(-2)) @ vh, a, atol=1e-12)
    assert torch.allclose(s, torch.linalg.svdvals(a), atol=1e-12)
    assert torch.allclose(u.mT @ u, torch.eye(20, dtype=torch.float64).expand(3, 20, 20),
                          atol=1e-12)


def test_polar_error_bound():
    """The bound that decides between the Gram route and the SVD is not optimistic."""
    g = torch.Generator().manual_seed(23)
    u, _, vh = torch.linalg.svd(torch.randn(200, 120, generator=g, dtype=torch.float64),
                                full_matrices=False)
    for low in (-3, -5, -6, -7):
        m = (u * torch.logspace(0, low, 120, dtype=torch.float64)) @ vh
        h, _ = linalg.psd_inv_sqrt(m.mT @ m)
        actual = rel_err(m @ h, ref_polar(m))
        bound = linalg.polar_error_bound(torch.linalg.eigvalsh(m.mT @ m)).item()
        assert actual <= 2 * bound


def test_polar_error_bound_scale():
    """The bound depends on the condition number only, except that a Gram matrix near
    underflow is never trusted; polar factors stay exact at any scale (SVD where needed)."""
    values = torch.logspace(0, -8, 50, dtype=torch.float64).unsqueeze(0)
    bound = linalg.polar_error_bound(values)
    assert torch.allclose(linalg.polar_error_bound(values * 1e-200), bound, rtol=1e-5)
    assert torch.isinf(linalg.polar_error_bound(values * 1e-290)).all()
    g = torch.Generator().manual_seed(27)
    a = torch.randn(30, 20, generator=g, dtype=torch.float64)
    for scale in (1e-200, 1e-120, 1e120):
        assert rel_err(polar(a * scale), ref_polar(a)) <= 1e-10
        assert rel_err(isoc(a * scale) / scale, ref_isoc(a)) <= 1e-10


# --- fast-path building blocks ------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(3, 40, 33), (2, 9, 64), (700, 520), (520, 700)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gram_cols_blocks(shape, monkeypatch):
    """The blocked symmetric product aᵀa: the plain product up to rounding, exactly symmetric;
    tiny blocks force several levels of splitting and uneven halves."""
    g = torch.Generator().manual_seed(25)
    a = torch.randn(*shape, generator=g, dtype=torch.float64)
    if shape[-1] < 512:
        monkeypatch.setattr(linalg, "_SYM_BLOCK", 4)
    out = linalg.gram_cols(a)
    assert out.shape == (*shape[:-2], shape[-1], shape[-1])
    assert torch.equal(out, out.mT)
    assert rel_err(out, a.mT @ a) <= 1e-14
    for x in (a, a.mT):  # the Gram matrix of the smaller side, tall or wide
        plain = x.mT @ x if x.shape[-2] >= x.shape[-1] else x @ x.mT
        out = linalg.gram(x)
        assert rel_err(out, plain) <= 1e-14 and torch.equal(out, out.mT)


@pytest.mark.parametrize("strategy", ["isoc", "tsv", "isocts"])
def test_merges_through_blocked_products(strategy, monkeypatch):
    """Every Gram matrix and G^{-1/2} of the merges from blocks (as for n >= 512), on
    realistic, nearly rank-deficient and nearly coinciding replicas."""
    monkeypatch.setattr(linalg, "_SYM_BLOCK", 5)
    g = torch.Generator().manual_seed(26)
    for shape in [(64, 48), (48, 64), (40, 40)]:
        base = realistic_deltas(shape, 1, g)[0]
        for deltas in (realistic_deltas(shape, 3, g), realistic_deltas(shape, 8, g),
                       realistic_deltas(shape, 3, g, noise=1e-5),
                       [base + 1e-3 * torch.randn(*shape, generator=g) / math.sqrt(shape[0])
                        for _ in range(4)]):
            assert rel_err(merge(strategy, deltas), ref_merge(strategy, deltas)) <= TOL[strategy]


@pytest.mark.parametrize("strategy", ["isoc", "tsv", "isocts"])
def test_fast_path_needs_no_svd(strategy, monkeypatch):
    """Realistic pseudo-gradients never need the SVD fallback (a speed regression guard)."""
    def no_svd(*args, **kwargs):
        raise AssertionError("SVD fallback used")

    deltas = {f"m{i}": make_deltas("realistic", shape, 3, seed=28 + i)
              for i, shape in enumerate([(64, 48), (48, 64), (40, 40)])}
    deltas["big"] = make_deltas("realistic", (540, 512), 2, seed=31)  # blocked Gram matrices
    monkeypatch.setattr(torch.linalg, "svd", no_svd)
    merged = merge_all(strategy, deltas)
    monkeypatch.setattr(linalg, "_SYM_BLOCK", 10**9)  # plain products for the big one
    plain = merge(strategy, deltas["big"])
    monkeypatch.undo()
    assert rel_err(merged["big"], plain) <= 1e-6
    for name, ds in deltas.items():
        if name != "big":
            assert rel_err(merged[name], ref_merge(strategy, ds)) <= TOL[strategy], name


def test_eigh_top_refined(monkeypatch):
    """The refined float32 path (q <= n/16): float64 eigh's top-q eigenpairs (vectors up to
    sign), at any scale; a zero matrix and every matrix failing the residual test get float64
    eigh's own result."""
    g = torch.Generator().manual_seed(32)
    a = torch.stack([realistic_deltas((400, 300), 1, g)[0] for _ in range(2)]).double()
    gram = a.mT @ a
    tiny = gram[:1] * 1e-100  # 0 in float32
    gram = torch.cat([gram, torch.zeros(1, 300, 300, dtype=torch.float64), tiny])
    exact_values, exact_vectors = linalg._eigh_top_exact(gram, 12)
    values, vectors = linalg.eigh_top(gram, 12)
    assert torch.allclose(values, exact_values, rtol=1e-10, atol=0)
    nonzero = [0, 1, 3]
    cosines = (vectors[nonzero] * exact_vectors[nonzero]).sum(-2).abs()
    assert torch.allclose(cosines, torch.ones_like(cosines), atol=1e-9)
    assert torch.equal(values[2], exact_values[2]) and torch.equal(vectors[2], exact_vectors[2])
    monkeypatch.setattr(linalg, "EIGH_REFINE_TRUST", 0.0)  # every matrix fails the test
    values, vectors = linalg.eigh_top(gram, 12)
    # (LAPACK's rounding may depend on where a matrix lies in memory: not bit for bit)
    assert torch.allclose(values, exact_values, rtol=1e-13, atol=0)
    assert torch.allclose(vectors, exact_vectors, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(10, 7), (1, 300, 4), (2, 5, 4), (7,), ()], ids=str)
def test_mean64_chunks(shape, monkeypatch):
    """The chunked float64 mean: the plain loop's sums bit for bit, any shape, strided inputs."""
    monkeypatch.setattr(linalg, "_MEAN_CHUNK_ROWS", 3)
    g = torch.Generator().manual_seed(29)
    deltas = [torch.randn(shape, generator=g) for _ in range(5)]
    if len(shape) == 2:
        deltas[1] = torch.randn(shape[::-1], generator=g).T  # not contiguous
    expected = deltas[0].double()
    for d in deltas[1:]:
        expected = expected + d.double()
    assert torch.equal(linalg.mean64(deltas), expected / 5)


def test_isoc_matches_reference_batched():
    g = torch.Generator().manual_seed(6)
    batch = torch.randn(3, 30, 20, generator=g)
    out = isoc(batch)
    for i in range(3):
        assert rel_err(out[i], ref_isoc(batch[i].double())) <= 1e-6


def test_non_matrix_tensors_get_the_mean():
    g = torch.Generator().manual_seed(8)
    for shape in [(17,), (3, 4, 5), ()]:
        deltas = [torch.randn(shape, generator=g) for _ in range(3)]
        expected = torch.stack([d.double() for d in deltas]).mean(0).float()
        for strategy, options in [("mean", {}), ("isoc", {}), ("isocts", {}), ("tsv", {}),
                                  ("ties", {}), ("dare", {"generator": g})]:
            state = g.get_state()
            assert torch.allclose(merge(strategy, deltas, **options), expected, rtol=1e-6)
            assert torch.equal(g.get_state(), state), "no random draws for non-2-D tensors"


def test_output_dtype_follows_input():
    deltas = make_deltas("random", (20, 12), 2, seed=9)
    for strategy in TOL:
        assert merge(strategy, [d.double() for d in deltas]).dtype == torch.float64
        assert merge(strategy, [d.bfloat16() for d in deltas]).dtype == torch.bfloat16
    stacked = torch.stack(deltas)
    assert torch.equal(merge("tsv", stacked), merge("tsv", deltas))


def test_sizes():
    assert isocts_sizes(1024, 8, 0.8) == (816, 26)      # 205/8 = 25.6 -> 26
    assert isocts_sizes(48, 8, 0.8) == (40, 1)
    assert isocts_sizes(10, 2, 0.5) == (6, 2)           # 2.5 rounds half to even: 2
    assert isocts_sizes(14, 2, 0.5) == (6, 4)           # 3.5 -> 4
    assert isocts_sizes(2, 3, 0.0) == (2, 0)            # t would exceed k: cut
    assert isocts_sizes(40, 3, 1.0) == (40, 0)
    assert tsv_rank(48, 1 / 8) == 6 and tsv_rank(5, 1 / 8) == 1 and tsv_rank(48, 1.0) == 48


# --- TIES / DARE -------------------------------------------------------------------------------

@pytest.mark.parametrize("prune_dim", ["all", "row", "column"])
@pytest.mark.parametrize("rescale", [False, True])
def test_magnitude_sparsify(prune_dim, rescale):
    x = make_deltas("random", (30, 20), 1, seed=10)[0]
    out = sparsify(x, 0.3, prune_dim=prune_dim, rescale=rescale)
    ref = ref_magnitude_sparsify(x, 0.3, prune_dim, rescale)
    assert torch.equal(out != 0, ref != 0)
    assert torch.allclose(out, ref, rtol=1e-6, atol=0)


def test_magnitude_ties_lowest_index_first():
    x = torch.tensor([1.0, -2.0, 2.0, 0.5, 2.0])
    assert torch.equal(sparsify(x, 0.5), torch.tensor([0.0, -2.0, 2.0, 0.0, 0.0]))


def test_large_magnitude_selection_is_exact():
    """Above a million entries the k-th value is found through a sampled bracket."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(1100, 1000, generator=g)
    x[:100] = 0.25                                  # many exact ties at one magnitude
    for p in (0.1, 0.95):
        out = sparsify(x, p)
        keep = math.floor((1 - p) * x.numel())
        assert int((out != 0).sum()) == keep
        dropped = x[out == 0].abs().max()
        assert out[out != 0].abs().min() >= dropped


@pytest.mark.parametrize("prune_dim", ["all", "row", "column"])
def test_random_sparsify(prune_dim):
    x = make_deltas("random", (40, 30), 1, seed=13)[0] + 10.0   # no zero entries
    p = 0.35
    out = sparsify(x, p, prune="random", prune_dim=prune_dim, rescale=True,
                   generator=torch.Generator().manual_seed(1))
    kept = out != 0
    units = {"all": x.numel(), "row": 40, "column": 30}[prune_dim]
    whole = {"all": kept.reshape(-1), "row": kept.all(1), "column": kept.all(0)}[prune_dim]
    assert int(whole.sum()) == max(1, math.floor((1 - p) * units))
    if prune_dim != "all":   # whole rows / columns, nothing partial
        assert torch.equal(kept, kept.all(1 if prune_dim == "row" else 0, keepdim=True)
                           .expand_as(kept))
    assert torch.allclose(out[kept], x[kept] / (1 - p), rtol=1e-6)
    again = sparsify(x, p, prune="random", prune_dim=prune_dim, rescale=True,
                     generator=torch.Generator().manual_seed(1))
    other = sparsify(x, p, prune="random", prune_dim=prune_dim, rescale=True,
                     generator=torch.Generator().manual_seed(2))
    assert torch.equal(out, again)
    assert not torch.equal(out, other)


@pytest.mark.parametrize("prune_dim", ["row", "column"])
def test_row_column_pruning_by_norm(prune_dim):
    x = make_deltas("random", (25, 18), 1, seed=14)[0]
    out = sparsify(x, 0.4, prune_dim=prune_dim)
    dim = 1 if prune_dim == "row" else 0
    norms = torch.linalg.vector_norm(x, dim=dim)
    kept = (out != 0).any(dim)
    assert torch.equal(out.index_select(1 - dim, kept.nonzero().squeeze(1)),
                       x.index_select(1 - dim, kept.nonzero().squeeze(1)))
    assert norms[kept].min() >= norms[~kept].max()


def test_disjoint_merge_against_loop():
    g = torch.Generator().manual_seed(15)
    # Small integers: many zeros, sign conflicts and exact zero sums.
    tensors = [torch.randint(-2, 3, (12, 9), generator=g).float() for _ in range(4)]
    assert torch.equal(disjoint_merge(tensors), ref_disjoint_merge_loop(tensors))
    tensors = [torch.randn(12, 9, generator=g) for _ in range(3)]
    assert torch.allclose(disjoint_merge(tensors), ref_disjoint_merge_loop(tensors), rtol=1e-6)


@pytest.mark.parametrize("options", [
    {}, {"prune_dim": "row"}, {"prune_dim": "column", "rescale": True}, {"disjoint": False},
    {"sparsity": 0.0}, {"sparsity": 0.7},
], ids=str)
def test_ties_options(options):
    deltas = make_deltas("realistic", (48, 40), 3, seed=16)
    assert rel_err(merge("ties", deltas, **options), ref_merge("ties", deltas, **options)) <= 1e-5


def test_dare_is_random_sparsify_then_mean():
    deltas = make_deltas("random", (20, 16), 3, seed=17)
    out = merge("dare", deltas, sparsity=0.3, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    kept = [sparsify(d, 0.3, prune="random", rescale=True, generator=g) for d in deltas]
    assert torch.allclose(out, torch.stack(kept).mean(0), rtol=1e-6)
    # One generator per replica: what a rank pruning its own replicas locally reproduces.
    per_replica = [torch.Generator().manual_seed(100 + r) for r in range(3)]
    out = merge("dare", deltas, generator=per_replica)
    kept = [sparsify(d, 0.1, prune="random", rescale=True,
                     generator=torch.Generator().manual_seed(100 + r))
            for r, d in enumerate(deltas)]
    assert torch.allclose(out, torch.stack(kept).mean(0), rtol=1e-6)


# --- merge_all ---------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy,options", [
    ("mean", {}), ("isoc", {}), ("isocts", {"common_fraction": 0.5}), ("tsv", {}),
    ("ties", {}), ("ties", {"prune": "random"}), ("dare", {}),
])
def test_merge_all_equals_per_tensor(strategy, options, monkeypatch):
    monkeypatch.setattr(merge_module, "_BATCH_BYTES", 3 * 3 * 24 * 16 * 4)  # chunks of 3
    g = torch.Generator().manual_seed(18)
    shapes = {"a": (24, 16), "norm": (16,), "b": (24, 16), "wide": (16, 24), "c": (24, 16),
              "d": (24, 16), "e": (24, 16)}
    deltas = {name: [torch.randn(*s, generator=g) for _ in range(3)]
              for name, s in shapes.items()}
    if strategy in ("ties", "dare"):
        options = {**options, "generator": torch.Generator().manual_seed(3)}
    merged = merge_all(strategy, deltas, **options)
    assert list(merged) == list(deltas)
    if strategy in ("ties", "dare"):
        options["generator"] = torch.Generator().manual_seed(3)
    for name, ds in deltas.items():
        single = merge(strategy, ds, **options)
        assert merged[name].dtype == single.dtype
        assert rel_err(merged[name], single) <= 1e-6, name


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("call,match", [
    (lambda d: merge("svd", d), r"strategy must be one of 'mean', 'isoc'"),
    (lambda d: merge("tsv", []), r"at least one"),
    (lambda d: merge("mean", [d[0], d[0].T]), r"shapes differ"),
    (lambda d: merge("ties", d, sparsity=1.0),
     r"^sparsity: Input should be less than 1 \(got 1.0\)$"),
    (lambda d: merge("dare", d, sparsity=-0.1, generator=torch.Generator()), r"sparsity"),
    (lambda d: merge("tsv", d, keep_fraction=0.0),
     r"^keep_fraction: Input should be greater than 0"),
    (lambda d: merge("tsv", d, keep_fraction=1.5), r"keep_fraction"),
    (lambda d: merge("isocts", d, common_fraction=1.5),
     r"^common_fraction: Input should be less than or equal to 1"),
    (lambda d: merge("ties", d, prune="largest"),
     r"^prune: Input should be 'magnitude' or 'random' \(got 'largest'\)$"),
    (lambda d: merge("ties", d, prune_dim="block"),
     r"^prune_dim: Input should be 'all', 'row' or 'column'"),
    (lambda d: merge("tsv", d, common_fraction=0.5), r"common_fraction do not apply to .*'tsv'"),
    (lambda d: merge("isoc", d, sparsity=0.1), r"sparsity do not apply to strategy 'isoc'"),
    (lambda d: merge("dare", d), r"needs a generator"),
    (lambda d: merge("ties", d, prune="random"), r"needs a generator"),
    (lambda d: merge("dare", d, prune="magnitude", generator=torch.Generator()),
     r"^prune must be 'random' for strategy 'dare' \(got 'magnitude'\)"),
    (lambda d: merge("dare", d, generator=[torch.Generator()]), r"one generator per replica"),
    (lambda d: merge("tsv", d, decorrelate="yes"),
     r"^decorrelate: Input should be a valid boolean \(got 'yes'\)$"),
    (lambda d: merge("ties", d, generator=3), r"generator must be a torch.Generator"),
    (lambda d: merge("ties", d, sparsity=float("nan")), r"^sparsity: Input should be a finite"),
    (lambda d: merge("ties", d, sparsity="0.2"), r"^sparsity: Input should be a valid number"),
    (lambda d: sparsify(d[0][0], 0.1, prune_dim="row"), r"prune_dim 'row' needs a 2-D"),
    (lambda d: sparsify(d[0], 0.1, prune="random"), r"needs a generator"),
    (lambda d: merge_all("mean", {"w": []}), r"deltas for 'w'"),
])
def test_errors(call, match):
    deltas = make_deltas("random", (6, 4), 2, seed=19)
    with pytest.raises(ValueError, match=match):
        call(deltas)


def test_reference_sanity():
    """The reference itself: TSV with R = 1 is Δ, ISO-C keeps the nuclear norm."""
    delta = make_deltas("random", (20, 12), 1, seed=20)[0].double()
    assert rel_err(ref_tsv([delta]), delta) <= 1e-12
    assert math.isclose(torch.linalg.svdvals(ref_isoc(delta)).sum().item(),
                        torch.linalg.svdvals(delta).sum().item(), rel_tol=1e-12)


def test_merges_change_no_process_wide_matmul_setting(monkeypatch):
    """Every spectral merge computes in float64 (untouched by TF32 and reduced-precision
    reductions), so it sets none of torch's global matmul flags: with outer.delay it runs on
    a thread beside training, whose matmuls would otherwise change precision with timing."""
    class Untouchable:
        def __getattr__(self, name):
            return getattr(torch.backends.cuda.matmul.__class__, name, False)

        def __setattr__(self, name, value):
            raise AssertionError(f"a merge set torch.backends.cuda.matmul.{name}")

    monkeypatch.setattr(torch.backends.cuda, "matmul", Untouchable())
    generator = torch.Generator().manual_seed(0)
    deltas = {"w": [torch.randn(6, 4, generator=generator) for _ in range(3)],
              "b": [torch.randn(4, generator=generator) for _ in range(3)]}
    for name, spec in MERGES.items():
        if spec.spectral:
            merged = merge_all(name, deltas)
            assert torch.isfinite(merged["w"]).all() and merged["w"].dtype == torch.float32
