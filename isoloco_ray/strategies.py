"""The registry of merges and outer strategies: one table that every other part reads.

Two levels (docs/strategies.md has the math):

- A **merge** (`MERGES`) is a pure function of R pseudo-gradients of one tensor, implemented in
  `isoloco_ray.aggregators`: its options with their defaults, and whether it is spectral
  (batched float64 linear algebra on each matrix) or elementwise.
- An **outer strategy** (`STRATEGIES`) is what a run sets in `outer.strategy`: which merge it
  applies, which `outer.*` options it takes, and the paper's hyperparameters (178M, R = 8).

Config validation, the outer sync (what travels, who merges), the owner plan's cost model, the
sweep converter and the benchmarks all dispatch on the properties resolved here (`OuterMerge`,
and the `Route` an outer step's data takes), never on strategy names. Adding a strategy is one
entry in `STRATEGIES` (plus its merge in `MERGES` and its function in `aggregators.merge`'s
table if it is new); a wire format (`outer.comm_dtype`) is one entry in `WIRE_FORMATS` and one
in `workers/outer/codec.py`. No torch import: the config reads this before anything heavy is
loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args


@dataclass(frozen=True)
class MergeSpec:
    """One merge of `aggregators.merge`."""

    name: str
    defaults: Mapping[str, Any]  # every option it takes, with its default (None: see merge)
    spectral: bool  # per 2-D tensor: float64 factorisations (else elementwise)
    of_mean: bool  # a function of the replicas' mean alone: their sum is all it needs
    factored_inputs: str = "none"  # what a spectral merge factors: "mean" (one) or "each" (R)


MERGES: dict[str, MergeSpec] = {spec.name: spec for spec in (
    MergeSpec("mean", {}, spectral=False, of_mean=True),
    MergeSpec("isoc", {}, spectral=True, of_mean=True, factored_inputs="mean"),
    MergeSpec("isocts", {"common_fraction": 0.8}, spectral=True, of_mean=False,
              factored_inputs="each"),
    MergeSpec("tsv", {"keep_fraction": None, "decorrelate": True}, spectral=True,
              of_mean=False, factored_inputs="each"),
    MergeSpec("ties", {"sparsity": 0.1, "prune": "magnitude", "prune_dim": "all",
                       "rescale": False, "disjoint": True, "generator": None},
              spectral=False, of_mean=False),
    MergeSpec("dare", {"sparsity": 0.1, "prune": "random", "prune_dim": "all", "rescale": True,
                       "disjoint": False, "generator": None}, spectral=False, of_mean=False),
)}

# The sparsifying merges' options: with disjoint off, their merge is the mean of the pruned
# Δ_r, so each Δ_r can be pruned where it is hosted and only the sum travels.
SPARSIFY_OPTIONS = ("sparsity", "prune", "prune_dim", "rescale")


@dataclass(frozen=True)
class StrategySpec:
    """One `outer.strategy`: its merge, the options it takes and the paper's settings."""

    name: str
    summary: str  # one line: what its outer step does
    merge: str | None  # the merge of MERGES it applies; None: no outer step (adamw_ddp)
    paper: Mapping[str, Any]  # the paper's values: inner_lr, lr, momentum, nesterov, options
    options: tuple[str, ...] = ()  # the outer.* merge options it takes
    momentum_is_optional: bool = False  # takes an outer momentum, though the paper sets none
    inner_weight_decay: float = 0.1
    fixed: Mapping[str, tuple[Any, str]] = field(default_factory=dict)  # option -> (the only
    # value it may take, what to use instead for another)
    # option -> its value for R replicas, where the user sets none (the config fills it in).
    per_replica_defaults: Mapping[str, Callable[[int], Any]] = field(default_factory=dict)
    # The outer sync's own settings (outer.comm_dtype, topk, placement, error_feedback,
    # error_decay) this strategy takes where the user leaves them unset: its wire.
    wire: Mapping[str, Any] = field(default_factory=dict)

    @property
    def has_outer_step(self) -> bool:
        """False for the data-parallel baseline: no outer lr, momentum or merge."""
        return self.merge is not None

    @property
    def takes_momentum(self) -> bool:
        """Whether outer.momentum means anything for this strategy (the sweep converter leaves
        a shared momentum out of the others' trials)."""
        return self.has_outer_step and (self.paper["momentum"] > 0 or self.momentum_is_optional)


def _merge_options(merge: str, *extra: str) -> tuple[str, ...]:
    return tuple(key for key in MERGES[merge].defaults if key != "generator") + extra


STRATEGIES: dict[str, StrategySpec] = {spec.name: spec for spec in (
    StrategySpec("diloco", "Nesterov momentum on the mean Δ", "mean",
                 dict(inner_lr=1.38e-3, lr=0.7, momentum=0.9, nesterov=True)),
    StrategySpec("diloco_sgd", "the mean Δ", "mean",
                 dict(inner_lr=1.38e-3, lr=1.6, momentum=0.0, nesterov=False)),
    StrategySpec("isoc", "ISO-C of the mean Δ (all singular values set to their mean)", "isoc",
                 dict(inner_lr=3.91e-3, lr=2.1, momentum=0.0, nesterov=False)),
    StrategySpec("isoloco", "ISO-C and Nesterov momentum", "isoc",
                 dict(inner_lr=1.38e-3, lr=1.8, momentum=0.8, nesterov=True,
                      orthogonalize="gradient"), options=("orthogonalize",)),
    StrategySpec("isocts", "ISO-CTS: common + per-replica subspaces, isotropic", "isocts",
                 dict(inner_lr=3.91e-3, lr=3.1, momentum=0.0, nesterov=False,
                      common_fraction=0.8), options=_merge_options("isocts"),
                 momentum_is_optional=True),
    StrategySpec("tsv", "TSV-Merge: per-replica top singular vectors, decorrelated", "tsv",
                 dict(inner_lr=2.76e-3, lr=0.6, momentum=0.0, nesterov=False, decorrelate=True),
                 options=_merge_options("tsv"),
                 # Each replica keeps 1/R of its singular directions: R replicas fill the rank.
                 per_replica_defaults={"keep_fraction": lambda replicas: 1.0 / replicas}),
    StrategySpec("ties", "TIES: keep the largest entries of each Δ, sign-elected disjoint mean",
                 "ties", dict(inner_lr=2.76e-3, lr=0.7, momentum=0.0, nesterov=False,
                              sparsity=0.1, prune="magnitude", prune_dim="all", rescale=False,
                              disjoint=True),
                 options=_merge_options("ties"), momentum_is_optional=True),
    StrategySpec("dare", "DARE: drop entries of each Δ at random, rescale, mean", "dare",
                 dict(inner_lr=2.76e-3, lr=1.5, momentum=0.0, nesterov=False, sparsity=0.1,
                      prune="random", prune_dim="all", rescale=True, disjoint=False),
                 options=_merge_options("dare"), momentum_is_optional=True,
                 fixed={"prune": ("random", "DARE drops entries at random; for magnitude "
                                            "pruning use outer.strategy=ties")}),
    StrategySpec("sparseloco", "SparseLoCo: the mean of each replica's top-k 2-bit payload, "
                 "error feedback decayed by β, no momentum", "mean",
                 dict(inner_lr=1e-3, lr=1.0, momentum=0.0, nesterov=False),
                 # Sarfi et al. 2025: 128 of each 4096-entry chunk, 2-bit codes, β = 0.95,
                 # every worker gathers every payload.
                 wire=dict(comm_dtype="int2", topk=128 / 4096, placement="replicated",
                           error_feedback=True, error_decay=0.95)),
    StrategySpec("adamw_ddp", "baseline: AdamW on gradients averaged over all replicas every "
                 "step", None, dict(inner_lr=1.95e-3, lr=0.0, momentum=0.0, nesterov=False),
                 inner_weight_decay=0.15),
)}

# Who merges each tensor in the outer step (outer.placement; workers/outer/plan.py).
Placement = Literal["sharded", "rank0", "replicated"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)


@dataclass(frozen=True)
class WireFormat:
    """One `outer.comm_dtype`: how pseudo-gradients and updates travel (workers/outer/codec.py
    implements each)."""

    name: str
    lossless: bool  # what arrives is what was sent (error feedback has nothing to correct)
    per_replica: bool  # codes with statistics of their own: each replica's, not summable
    # SparseLoCo's chunk-wise top-k with 2- or 4-bit codes: needs outer.topk (the share of each
    # chunk kept), and every worker gathers every payload (outer.placement=replicated).
    chunked: bool = False


WIRE_FORMATS: dict[str, WireFormat] = {spec.name: spec for spec in (
    WireFormat("float32", lossless=True, per_replica=False),
    WireFormat("bfloat16", lossless=False, per_replica=False),
    WireFormat("int8", lossless=False, per_replica=True),
    WireFormat("float8", lossless=False, per_replica=True),
    WireFormat("int2", lossless=False, per_replica=True, chunked=True),
    WireFormat("int4", lossless=False, per_replica=True, chunked=True),
)}


# The outer.* settings that only strategies with an outer step take.
OUTER_STEP_OPTIONS = ("lr", "momentum", "nesterov")


def option_strategies() -> dict[str, tuple[str, ...]]:
    """Each outer.* option -> the strategies that take it (setting it for another strategy is
    a configuration error, not silently ignored)."""
    takers: dict[str, list[str]] = {}
    for spec in STRATEGIES.values():
        names = spec.options + (OUTER_STEP_OPTIONS if spec.has_outer_step else ())
        for option in names:
            takers.setdefault(option, []).append(spec.name)
    return {option: tuple(names) for option, names in takers.items()}


class OuterSettings(Protocol):
    """What `OuterMerge.of` reads of a config's outer section (config.OuterConfig)."""

    @property
    def strategy(self) -> str: ...
    @property
    def orthogonalize(self) -> str | None: ...
    @property
    def disjoint(self) -> bool | None: ...
    @property
    def comm_dtype(self) -> str: ...
    @property
    def topk(self) -> float | None: ...
    @property
    def error_feedback(self) -> bool: ...
    @property
    def placement(self) -> str: ...


@dataclass(frozen=True)
class OuterMerge:
    """How a configured outer step runs, resolved from the registry and the options.

    `merge` is the merge applied to what arrives at a tensor's owner: to the replicas' mean
    when `of_mean` (each rank sends the sum of its replicas' Δ_r), else to every Δ_r.
    `prune_where_hosted`: the merge is the mean of sparsified Δ_r (a TIES/DARE merge without
    the disjoint step), so each Δ_r is pruned on its host and only the sum travels.
    `orthogonalize_update`: ISO-C applied to the momentum update instead (isoloco, update).
    """

    strategy: str
    merge: str
    of_mean: bool
    spectral: bool
    factored_inputs: str
    prune_where_hosted: bool = False
    orthogonalize_update: bool = False
    options: tuple[str, ...] = field(default=())

    @classmethod
    def of(cls, outer: OuterSettings) -> OuterMerge:
        """Resolve `outer` (a validated OuterConfig). A strategy without an outer step
        resolves to the plain mean, which is never applied."""
        spec = STRATEGIES[outer.strategy]
        merge, prune_where_hosted, orthogonalize_update = spec.merge or "mean", False, False
        if spec.name == "isoloco" and outer.orthogonalize == "update":
            merge, orthogonalize_update = "mean", True
        if "disjoint" in spec.options and not outer.disjoint:
            merge, prune_where_hosted = "mean", True
        merge_spec = MERGES[merge]
        options = () if merge_spec.name != spec.merge else spec.options
        return cls(spec.name, merge, merge_spec.of_mean, merge_spec.spectral,
                   merge_spec.factored_inputs, prune_where_hosted, orthogonalize_update,
                   tuple(option for option in options if option in merge_spec.defaults))

    @property
    def elementwise(self) -> bool:
        """Merge and update are elementwise: every rank can do them on the all-reduced sum."""
        return self.merge == "mean" and not self.orthogonalize_update


@dataclass(frozen=True)
class Route:
    """How one run's outer steps move data, chosen once from its settings (docs/design.md,
    "The outer sync"): two independent choices.

    - **What a rank sends** (`sums`): when the merge needs only the replicas' mean and the
      wire carries a plain cast of it, one sum per tensor of its good replicas' Δ_r;
      otherwise every hosted Δ_r, for per-replica merges and for codes that are each
      replica's own (int8/float8 rows, top-k, error feedback: what each replica loses on the
      wire stays its own).
    - **Who merges** (`everyone_merges`): every rank, with every payload (replicated
      placement, and sharded for elementwise means sent losslessly, whose float32 all-reduce
      is balanced already); else each tensor's owner (workers/outer/plan.py), who sends the
      update back.

    Together: an all-reduce of sums, an all-gather of every Δ_r, or payloads to owners and
    updates back.
    """

    sums: bool  # each rank sends the sum of its good replicas' Δ_r (else every hosted Δ_r)
    everyone_merges: bool  # every rank merges every tensor (else owners merge theirs)

    @classmethod
    def choose(cls, outer: OuterSettings, merge: OuterMerge) -> Route:
        """The route of `outer` (a validated OuterConfig) with its resolved merge."""
        wire = WIRE_FORMATS[outer.comm_dtype]
        own_codes = wire.per_replica or outer.topk is not None or outer.error_feedback
        everyone = outer.placement == "replicated" or (
            outer.placement == "sharded" and merge.elementwise and wire.lossless)
        return cls(sums=merge.of_mean and not own_codes, everyone_merges=everyone)

    @property
    def name(self) -> str:
        """How it reads in docs and benchmarks."""
        if self.everyone_merges:
            return "all-reduce of sums" if self.sums else "all-gather of every Δ_r"
        return f"{'sums' if self.sums else 'every Δ_r'} to owners, updates back"
