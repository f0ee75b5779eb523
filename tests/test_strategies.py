"""The strategy registry: one table that config, outer sync and aggregators agree on, and
random-pruning masks keyed by (seed, round, replica, tensor) wherever they are drawn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import Field

from helpers import TINY_RUN
from isoloco_ray import aggregators
from isoloco_ray.config import OuterConfig, load_config
from isoloco_ray.strategies import (
    MERGES,
    STRATEGIES,
    MergeOptions,
    MergeSpec,
    OuterMerge,
    Route,
    StrategySpec,
    option_strategies,
)
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


def test_every_strategy_resolves_to_its_paper_values_and_its_options_defaults():
    for spec in STRATEGIES.values():
        resolved = load_config([f"--outer.strategy={spec.name}", "--scaling.replicas=4"])
        assert resolved.inner.lr == spec.paper["inner_lr"]
        for key, value in spec.paper.items():
            if key != "inner_lr":
                assert getattr(resolved.outer, key) == value, (spec.name, key)
        defaults = spec.options_model().for_replicas(4).model_dump()
        assert resolved.outer.strategy_options == defaults, spec.name
        # A resolved config loads again as it is (config.json of a run, a resume).
        assert OuterConfig.model_validate(resolved.outer.model_dump()) == resolved.outer
    for option, takers in option_strategies().items():
        assert all(name in STRATEGIES for name in takers)
        assert option in OuterConfig.model_fields or all(
            option in STRATEGIES[name].options_model.model_fields for name in takers)
    # TSV's keep_fraction: 1/R where unset (one owner: strategies.tsv_keep_fraction).
    assert load_config(["--outer.strategy=tsv", "--scaling.replicas=8"]).outer \
        .strategy_options["keep_fraction"] == 1 / 8


@pytest.mark.parametrize("flags, message", [
    (["--outer.strategy=ties", "--outer.sparsity=1.5"],
     r"^outer.sparsity: Input should be less than 1 \(got '1.5'\)$"),
    (["--outer.sparsity=0.2"],
     r"^outer.sparsity does not apply to outer.strategy 'diloco' \(only to ties, dare\); "
     r"remove it$"),
    (["--outer.strategy=dare", "--outer.prune=magnitude"],
     r"^outer.prune must be 'random' for outer.strategy 'dare' \(got 'magnitude'\): DARE "
     r"drops entries at random; for magnitude pruning use outer.strategy=ties$"),
    (["--outer.strategy=ties", "--outer.sparsity=0", "--outer.prune_dim=row",
      "--outer.rescale=true"],
     r"^outer.prune_dim=row, outer.rescale=True have no effect with outer.sparsity=0 \(every "
     r"entry is kept\); set outer.sparsity > 0 or remove them$"),
    (["--outer.strategy=isoloco", "--outer.orthogonalize=both"],
     r"^outer.orthogonalize: Input should be 'gradient' or 'update' \(got 'both'\)$"),
    (["--outer.strategy=tsv", "--outer.keep_fraction"],
     r"^--outer.keep_fraction: give it a value, e.g. --outer.keep_fraction=VALUE"),
    (["--outer.strategy=tsv2"], r"^outer.strategy must be one of diloco, .* \(got 'tsv2'\)$"),
    (["--outer.keep_fractoin=0.5"], r"^--outer.keep_fractoin: unknown option; did you mean "
                                    r"--outer.keep_fraction\?$"),
])
def test_a_strategys_options_are_checked_by_its_options_model(flags, message):
    with pytest.raises(ValueError, match=message):
        load_config(flags)


def test_a_yaml_config_sets_a_strategys_options_and_refuses_unknown_keys(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("outer:\n  strategy: ties\n  sparsity: 0.3\n  prune: random\n")
    assert load_config([str(path)]).outer.strategy_options["prune"] == "random"
    path.write_text("outer:\n  strategy: ties\n  sparsty: 0.3\n")
    with pytest.raises(ValueError, match=r"^outer.sparsty: unknown field; see --help"):
        load_config([str(path)])
    # Another strategy's option left unset (as an older config.json holds it) is dropped.
    path.write_text("outer:\n  strategy: diloco\n  sparsity: null\n  keep_fraction: null\n")
    assert load_config([str(path)]).outer.strategy_options == {}


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
    # Nor on a lossless wire the run chose: its error feedback would have nothing to correct.
    lossless = load_config(["--outer.strategy=sparseloco", "--outer.comm_dtype=float32",
                            "--outer.topk=null"]).outer
    assert (lossless.error_feedback, lossless.error_decay) == (False, 1.0)
    with pytest.raises(ValueError, match="outer.error_feedback corrects what the transport "
                                         "loses, and float32 without outer.topk loses nothing"):
        load_config(["--outer.strategy=sparseloco", "--outer.comm_dtype=float32",
                     "--outer.topk=null", "--outer.error_feedback=true"])
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
        generator = torch.Generator().manual_seed(0) if spec.options.draws_at_random else None
        options = {"generator": generator} if generator is not None else {}
        merged = aggregators.merge(name, matrices, **options)
        assert merged.shape == (4, 3) and torch.isfinite(merged).all(), name


def scaled_mean(deltas: list[torch.Tensor], opts, generators) -> torch.Tensor:
    """The toy merge of the registry test: the mean of the Δ_r times its one option."""
    return (torch.stack(deltas).double().mean(0) * opts["scale"]).to(deltas[0].dtype)


class ScaledOptions(MergeOptions):
    scale: float = Field(0.5, gt=0, le=1, description="the factor on the mean")


@pytest.fixture
def toy_merge(monkeypatch):
    """A merge with one option and its strategy, added as one entry each."""
    monkeypatch.setitem(MERGES, "scaled_mean", MergeSpec(
        "scaled_mean", f"{__name__}:scaled_mean", spectral=False, of_mean=False,
        options=ScaledOptions))
    monkeypatch.setitem(STRATEGIES, "scaled", StrategySpec(
        "scaled", "the mean Δ, scaled", "scaled_mean",
        dict(inner_lr=2e-3, lr=1.0, momentum=0.0, nesterov=False)))


def test_a_new_merge_with_an_option_is_one_registry_entry_and_trains(toy_merge,
                                                                    small_dataset: Path):
    """The toy merge (the mean times `scale`) at outer lr 1 moves the matrices exactly as the
    mean at outer lr `scale` does (diloco_sgd), and the other tensors as the mean at lr 1 (a
    merge applies to 2-D tensors): its option travels from the command line to the merge; it is
    checked, listed in --help and refused for other strategies, with nothing else edited."""
    from isoloco_ray.config.loading import strategy_options_help
    from isoloco_ray.workers.local import run_local

    run = [*TINY_RUN, f"--data.path={small_dataset}", "--scaling.replicas=2",
           "--scaling.replicas_per_worker=2", "--inner.steps=2", "--run.rounds=1",
           "--run.eval_tokens=256", "--inner.lr=2e-3"]
    toy = load_config([*run, "--outer.strategy=scaled", "--outer.scale=0.25"])
    assert toy.outer.strategy_options == {"scale": 0.25}
    assert OuterMerge.of(toy.outer).options == ("scale",)
    _, trained = run_local(toy, small_dataset)
    _, at_scale = run_local(load_config([*run, "--outer.strategy=diloco_sgd", "--outer.lr=0.25"]),
                            small_dataset)
    _, at_one = run_local(load_config([*run, "--outer.strategy=diloco_sgd", "--outer.lr=1"]),
                          small_dataset)
    for name, value in trained.items():
        # Equal up to float sums (the toy's Δ_r are gathered, the mean's all-reduced).
        torch.testing.assert_close(value, (at_scale if value.dim() == 2 else at_one)[name],
                                   rtol=0, atol=1e-6)
        assert not torch.equal(at_scale[name], at_one[name])
    assert "--outer.scale  (scaled; default 0.5) the factor on the mean" in \
        strategy_options_help()
    with pytest.raises(ValueError, match=r"^outer.scale: Input should be less than or equal "
                                         r"to 1 \(got '2'\)$"):
        load_config(["--outer.strategy=scaled", "--outer.scale=2"])
    with pytest.raises(ValueError, match=r"outer.scale does not apply to outer.strategy "
                                         r"'ties' \(only to scaled\)"):
        load_config(["--outer.strategy=ties", "--outer.scale=0.5"])
    merged = aggregators.merge("scaled_mean", [torch.ones(2, 2), 3 * torch.ones(2, 2)],
                               scale=0.5)
    assert merged.eq(1.0).all()


def test_every_merge_names_an_implementation_that_loads(monkeypatch):
    from isoloco_ray.aggregators.merge import implementation

    for name in MERGES:
        assert callable(implementation(name)), name
    monkeypatch.setitem(MERGES, "unwritten", MergeSpec(
        "unwritten", f"{__name__}:no_such_function", spectral=True, of_mean=True))
    with pytest.raises(ValueError, match=r"^merge 'unwritten': its implementation "
                                         r"'[\w.]+:no_such_function' \(strategies.MERGES\) "
                                         r"cannot be loaded"):
        aggregators.merge("unwritten", [torch.zeros(2, 2)])
    # An elementwise function named for a spectral merge: refused when it is loaded (at the
    # outer sync's start in a run).
    monkeypatch.setitem(MERGES, "wrong_kind", MergeSpec(
        "wrong_kind", f"{__name__}:scaled_mean", spectral=True, of_mean=True))
    with pytest.raises(ValueError, match=r"^merge 'wrong_kind': '[\w.]+:scaled_mean' must take "
                                         r"2 arguments, as a spectral merge does"):
        implementation("wrong_kind")


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
    (["--outer.strategy=tsv", "--outer.comm_dtype=int2", "--outer.topk=0.03"],
     "every Δ_r to owners, updates back"),  # packed both ways (exchange.OwnersMerge)
    (["--outer.strategy=ties", "--outer.disjoint=false"], "all-reduce of sums"),
])
def test_the_route_is_chosen_once_from_strategy_placement_and_wire(flags, route):
    outer = load_config(flags).outer
    chosen = Route.choose(outer, OuterMerge.of(outer))
    assert chosen.name == route
    assert OuterSync(outer, 4, seed=0).route == chosen


def test_help_names_each_options_default_per_strategy_where_they_differ():
    from isoloco_ray.config.loading import strategy_options_help

    text = strategy_options_help()
    assert "--outer.sparsity  (ties, dare; default 0.1) " in text
    assert "--outer.prune  (ties: default magnitude; dare: default random) " in text
    assert "--outer.keep_fraction  (tsv) " in text  # its default depends on R: the text says


def test_no_strategy_option_is_named_like_a_setting_of_the_outer_section():
    """An option is an extra key of OuterConfig: one named like a field or property of it would
    be taken by that instead, silently."""
    taken = set(OuterConfig.model_fields) | {name for name in dir(OuterConfig)
                                             if not name.startswith("_")}
    for name, spec in STRATEGIES.items():
        clashes = set(spec.options_model.model_fields) & taken
        assert not clashes, f"{name}'s options {sorted(clashes)} are OuterConfig's names"
