"""The strategy registry: one table that config, outer sync and aggregators agree on, and
random-pruning masks keyed by (seed, round, replica, tensor) wherever they are drawn."""

from __future__ import annotations

import pytest
import torch

from isoloco_ray import aggregators
from isoloco_ray.config import OPTION_STRATEGIES, OuterConfig, load_config
from isoloco_ray.strategies import MERGES, STRATEGIES, OuterMerge, Route
from isoloco_ray.workers.outer.payload import pruning_generator
from isoloco_ray.workers.outer.step import OuterSync

REPLICAS = 3


def deltas(seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return {r: {"w": torch.randn(6, 5, generator=generator),
                "norm": torch.randn(5, generator=generator)} for r in range(REPLICAS)}


def outer_step(flags: list[str], hosted, diverged=()) -> dict[str, torch.Tensor]:
    cfg = load_config(flags + [f"--scaling.replicas={REPLICAS}",
                               "--scaling.replicas_per_worker=3", "--outer.lr=1.0"])
    params = {"w": torch.zeros(6, 5), "norm": torch.zeros(5)}
    OuterSync(cfg.outer, REPLICAS, seed=7).step(params, hosted, round_index=4, diverged=diverged)
    return {name: -value for name, value in params.items()}  # lr 1, no momentum: the merge


def kept(delta: torch.Tensor, replica: int, prune: str = "random") -> torch.Tensor:
    """Replica `replica`'s DARE-pruned Δ, from its own stream."""
    return aggregators.sparsify(delta, 0.3, prune=prune, rescale=True,
                                generator=pruning_generator(7, 4, replica, "w"))


@pytest.mark.parametrize("disjoint", [False, True])
def test_dare_masks_are_keyed_by_replica_and_independent_of_who_survived(disjoint):
    flags = ["--outer.strategy=dare", "--outer.sparsity=0.3", f"--outer.disjoint={disjoint}"]
    combine = aggregators.disjoint_merge if disjoint else (
        lambda ts: torch.stack(ts).double().mean(0).float())
    every = deltas()
    merged = outer_step(flags, every)
    torch.testing.assert_close(merged["w"], combine([kept(every[r]["w"], r) for r in range(3)]),
                               rtol=0, atol=1e-6)
    # Replica 2 diverged: replicas 0 and 1 keep exactly the masks they had.
    without_2 = outer_step(flags, every, diverged=[2])
    torch.testing.assert_close(without_2["w"], combine([kept(every[r]["w"], r) for r in (0, 1)]),
                               rtol=0, atol=1e-6)


def test_ties_without_the_disjoint_step_sends_only_sums_and_merges_the_same():
    cfg = load_config(["--outer.strategy=ties", "--outer.disjoint=false",
                       f"--scaling.replicas={REPLICAS}", "--scaling.replicas_per_worker=3"])
    resolved = OuterMerge.of(cfg.outer)
    assert (resolved.merge, resolved.of_mean, resolved.prune_where_hosted) == ("mean", True, True)
    every = deltas()
    merged = outer_step(["--outer.strategy=ties", "--outer.disjoint=false"], every)
    expected = aggregators.merge("ties", [every[r]["w"] for r in range(3)], disjoint=False)
    torch.testing.assert_close(merged["w"], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(merged["norm"],
                               torch.stack([every[r]["norm"] for r in range(3)]).mean(0),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("flags, merge, of_mean, update", [
    (["--outer.strategy=diloco"], "mean", True, False),
    (["--outer.strategy=isoc"], "isoc", True, False),
    (["--outer.strategy=isoloco"], "isoc", True, False),
    (["--outer.strategy=isoloco", "--outer.orthogonalize=update"], "mean", True, True),
    (["--outer.strategy=tsv"], "tsv", False, False),
    (["--outer.strategy=isocts"], "isocts", False, False),
    (["--outer.strategy=ties"], "ties", False, False),
    (["--outer.strategy=dare"], "mean", True, False),
    (["--outer.strategy=dare", "--outer.disjoint=true"], "dare", False, False),
])
def test_each_configuration_resolves_to_its_merge(flags, merge, of_mean, update):
    resolved = OuterMerge.of(load_config(flags).outer)
    assert (resolved.merge, resolved.of_mean, resolved.orthogonalize_update) == (
        merge, of_mean, update)
    assert resolved.spectral == MERGES[merge].spectral


def test_every_registered_option_is_a_config_field_with_a_paper_value():
    fields = set(OuterConfig.model_fields)
    for spec in STRATEGIES.values():
        assert set(spec.options) <= fields, spec.name
        if spec.merge is not None:
            assert set(spec.options) <= set(MERGES[spec.merge].defaults) | {"orthogonalize"}
        resolved = load_config([f"--outer.strategy={spec.name}"])
        assert resolved.inner.lr == spec.paper["inner_lr"]
        for key, value in spec.paper.items():
            if key != "inner_lr":
                assert getattr(resolved.outer, key) == value, (spec.name, key)
    for option, takers in OPTION_STRATEGIES.items():
        assert option in fields and all(name in STRATEGIES for name in takers)


def test_sparseloco_takes_the_papers_wire_where_the_run_leaves_it_unset():
    """Its wire (int2, top 128 of 4096, gathered by every worker, error feedback decayed by
    0.95) fills only what the run leaves unset, before the wire's own checks run."""
    paper = load_config(["--outer.strategy=sparseloco"]).outer
    assert (paper.comm_dtype, paper.topk, paper.placement, paper.error_feedback,
            paper.error_decay, paper.lr, paper.momentum) == (
        "int2", 128 / 4096, "replicated", True, 0.95, 1.0, 0.0)
    assert Route.choose(paper, OuterMerge.of(paper)) == Route(sums=False, everyone_merges=True)
    own = load_config(["--outer.strategy=sparseloco", "--outer.topk=0.01",
                       "--outer.comm_dtype=int4", "--outer.error_decay=0.9"]).outer
    assert (own.topk, own.comm_dtype, own.error_decay) == (0.01, "int4", 0.9)
    # Without error feedback there is no residual to decay: β goes back to 1, not an error.
    plain = load_config(["--outer.strategy=sparseloco", "--outer.error_feedback=false"]).outer
    assert (plain.error_feedback, plain.error_decay) == (False, 1.0)
    # A resolved config loads again as it is.
    again = OuterConfig.model_validate(paper.model_dump())
    assert again == paper
    with pytest.raises(Exception, match="set outer.placement=replicated"):
        load_config(["--outer.strategy=sparseloco", "--outer.placement=sharded"])
    quorum = load_config(["--outer.strategy=sparseloco", "--scaling.fault_tolerance=replica",
                          "--scaling.replicas=4", "--scaling.replicas_per_worker=1"]).outer
    assert quorum == paper


def test_every_merge_runs_with_its_defaults():
    matrices = [torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    for name, spec in MERGES.items():
        generator = torch.Generator().manual_seed(0) if "generator" in spec.defaults else None
        options = {"generator": generator} if generator is not None else {}
        merged = aggregators.merge(name, matrices, **options)
        assert merged.shape == (4, 3) and torch.isfinite(merged).all(), name


def test_a_merge_is_one_registry_entry_and_one_implementation():
    """aggregators.merge checks at import that every merge of strategies.MERGES has exactly one
    implementation of its kind (spectral or elementwise), and nothing else is implemented: a
    merge listed but not written (once run as TSV) cannot be chosen."""
    from isoloco_ray.aggregators.merge import check_implementations
    from isoloco_ray.strategies import MergeSpec

    def spec(name: str, spectral: bool) -> MergeSpec:
        return MergeSpec(name, {}, spectral=spectral, of_mean=True)

    def impl(*args):
        return None

    check_implementations({"a": spec("a", True), "b": spec("b", False)}, {"a": impl},
                          {"b": impl})
    with pytest.raises(ValueError, match=r"^aggregators.merge: 'new' has no spectral "
                                         r"implementation$"):
        check_implementations({"new": spec("new", True)}, {}, {})
    with pytest.raises(ValueError, match=r"'b' has no elementwise implementation \(it has one "
                                         r"of the other kind\); 'c' is implemented but not in "
                                         r"strategies.MERGES"):
        check_implementations({"b": spec("b", False)}, {"b": impl}, {"c": impl})


def test_an_unknown_merge_or_wire_format_is_refused_by_name():
    from isoloco_ray.workers.outer.codec import codec_for

    deltas = [torch.zeros(2, 2)] * 2
    with pytest.raises(ValueError, match="strategy"):
        aggregators.merge("tsv2", deltas)
    with pytest.raises(ValueError, match=r"outer.comm_dtype 'int3': use one of float32, "
                                         r"bfloat16, int8, float8, int2, int4"):
        codec_for("int3")


@pytest.mark.parametrize("flags, route", [
    (["--outer.strategy=diloco"], "all-reduce of sums"),
    (["--outer.strategy=dare", "--outer.placement=replicated"], "all-reduce of sums"),
    (["--outer.strategy=diloco", "--outer.placement=replicated", "--outer.comm_dtype=int8"],
     "all-gather of every Δ_r"),
    (["--outer.strategy=tsv", "--outer.placement=replicated"], "all-gather of every Δ_r"),
    (["--outer.strategy=isoc"], "sums to owners, updates back"),
    (["--outer.strategy=diloco", "--outer.comm_dtype=bfloat16"], "sums to owners, updates back"),
    (["--outer.strategy=diloco", "--outer.topk=0.1", "--outer.error_feedback=true"],
     "all-gather of every Δ_r"),  # float32 values: every rank means them itself
    (["--outer.strategy=isoc", "--outer.topk=0.1"], "every Δ_r to owners, updates back"),
    (["--outer.strategy=tsv", "--outer.placement=rank0"], "every Δ_r to owners, updates back"),
    (["--outer.strategy=ties", "--outer.disjoint=false"], "all-reduce of sums"),
])
def test_the_route_is_chosen_once_from_strategy_placement_and_wire(flags, route):
    outer = load_config(flags).outer
    chosen = Route.choose(outer, OuterMerge.of(outer))
    assert chosen.name == route
    assert OuterSync(outer, 4, seed=0).route == chosen
