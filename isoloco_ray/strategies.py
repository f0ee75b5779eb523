"""The registry of merges and outer strategies: one table that every other part reads.

Two levels (docs/strategies.md has the math):

- A **merge** (`MERGES`) is a pure function of R pseudo-gradients of one tensor: where its
  implementation lives ("module:function", in `isoloco_ray.aggregators` for the built-in ones),
  its options model (a pydantic model: each option's default, range and description), and
  whether it is spectral (batched float64 linear algebra on each matrix) or elementwise.
- An **outer strategy** (`STRATEGIES`) is what a run sets in `outer.strategy`: which merge it
  applies, its options (those of its merge unless it has its own), the paper's
  hyperparameters (178M, R = 8) and its wire.

Config validation (`outer.<option>` on the command line, in YAML and in grid files), the outer
sync (what travels, who merges), the owner plan's cost model, the sweep converter and the
benchmarks all dispatch on the properties resolved here (`OuterMerge`, and the `Route` an outer
step's data takes), never on strategy names. Adding a merge is one entry in `MERGES`, its
function and its test; a strategy is one entry in `STRATEGIES` (docs/strategies.md, "Adding a
merge"). A wire format (`outer.comm_dtype`) is one entry in `WIRE_FORMATS` and one in
`workers/outer/codec.py`. No torch import: the config reads this before anything heavy is
loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator


class MergeOptions(BaseModel):
    """The options of a merge (or of a strategy): each a field with its default (the paper's
    value), its range and a description. Refuses unknown keys and non-finite numbers. A run
    sets them as `outer.<field>`; `aggregators.merge` takes them as keyword arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    # Whether the merge draws at random (a generator in aggregators.merge; in a run, streams
    # keyed by seed, round, replica and tensor).
    draws_at_random: ClassVar[bool] = False

    def for_replicas(self, replicas: int) -> MergeOptions:
        """These options with the defaults that depend on R filled in."""
        return self


def have_no_effect(settings: list[str]) -> str:
    """'a has no effect', 'a, b have no effect' (the config's messages for inert settings)."""
    return f"{', '.join(settings)} {'has' if len(settings) == 1 else 'have'} no effect"


def _named(info: ValidationInfo, *names: str) -> tuple[str, ...]:
    """The settings as the caller spells them (`outer.sparsity` in a config)."""
    prefix = (info.context or {}).get("prefix", "")
    return tuple(prefix + name for name in names)


class NoOptions(MergeOptions):
    """A merge without options (mean, isoc)."""


class IsoctsOptions(MergeOptions):
    """ISO-CTS: how much of each Δ_r's spectrum is shared."""

    common_fraction: float = Field(0.8, ge=0, le=1, description="the share of the rank given "
                                   "to the common subspace")


def tsv_keep_fraction(keep_fraction: float | None, replicas: int) -> float:
    """TSV's share of its singular directions each replica keeps: 1/R unless set (R replicas
    then fill the rank)."""
    return 1.0 / replicas if keep_fraction is None else keep_fraction


class TsvOptions(MergeOptions):
    """TSV-Merge: each replica's top singular directions, decorrelated."""

    keep_fraction: float | None = Field(None, gt=0, le=1, description="the share of its "
                                        "singular directions each replica keeps (default 1/R)")
    decorrelate: bool = Field(True, description="orthogonalise the stacked bases")

    def for_replicas(self, replicas: int) -> TsvOptions:
        return self.model_copy(update={
            "keep_fraction": tsv_keep_fraction(self.keep_fraction, replicas)})


class TiesOptions(MergeOptions):
    """TIES: prune each Δ_r, then the sign-elected disjoint mean (or the plain mean)."""

    draws_at_random: ClassVar[bool] = True
    sparsity: float = Field(0.1, ge=0, lt=1, description="the share of each Δ_r's entries "
                            "dropped")
    prune: Literal["magnitude", "random"] = Field("magnitude", description="drop the smallest "
                                                  "entries (magnitude) or entries at random")
    prune_dim: Literal["all", "row", "column"] = Field(
        "all", description="prune entries, whole rows or whole columns")
    rescale: bool = Field(False, description="rescale the kept entries by 1/(1 - sparsity)")
    disjoint: bool = Field(True, description="the TIES sign-elected disjoint merge (false: "
                           "the mean of the pruned Δ_r)")

    @model_validator(mode="after")
    def _pruning_has_an_effect(self, info: ValidationInfo) -> TiesOptions:
        if self.sparsity != 0:
            return self
        defaults = type(self)()
        inert = [f"{name}={getattr(self, key)}" for key, name in
                 zip(("prune", "prune_dim", "rescale"),
                     _named(info, "prune", "prune_dim", "rescale"), strict=True)
                 if getattr(self, key) != getattr(defaults, key)]
        if inert:
            (sparsity,) = _named(info, "sparsity")
            raise ValueError(f"{have_no_effect(inert)} with {sparsity}=0 (every entry is "
                             f"kept); set {sparsity} > 0 or remove "
                             f"{'it' if len(inert) == 1 else 'them'}")
        return self


class DareOptions(TiesOptions):
    """DARE: entries dropped at random, rescaled, then the mean (or the disjoint merge)."""

    prune: Literal["magnitude", "random"] = Field("random", description="random: DARE drops "
                                                  "entries at random")
    rescale: bool = Field(True, description="rescale the kept entries by 1/(1 - sparsity)")
    disjoint: bool = Field(False, description="the TIES sign-elected disjoint merge (false: "
                           "the mean of the pruned Δ_r)")

    @model_validator(mode="after")
    def _drops_at_random(self, info: ValidationInfo) -> DareOptions:
        if self.prune != "random":
            prune, strategy = _named(info, "prune", "strategy")
            raise ValueError(f"{prune} must be 'random' for {strategy} 'dare' (got "
                             f"{self.prune!r}): DARE drops entries at random; for magnitude "
                             f"pruning use {strategy}=ties")
        return self


class IsolocoOptions(MergeOptions):
    """IsoLoCo: ISO-C with Nesterov momentum, before or after it."""

    orthogonalize: Literal["gradient", "update"] = Field(
        "gradient", description="ISO-C of the merged pseudo-gradient (gradient) or of the "
        "momentum update (update)")


@dataclass(frozen=True)
class MergeSpec:
    """One merge: its implementation, its options and how it computes."""

    name: str
    # "module:function" of its implementation, imported when first used (this file imports no
    # torch). Spectral: f(R stacks (b, m, n), options) -> (b, m, n) in float64; elementwise:
    # f(R tensors, options, R generators) -> the merged tensor (aggregators/merge.py).
    implementation: str
    spectral: bool  # per 2-D tensor: float64 factorisations (else elementwise)
    of_mean: bool  # a function of the replicas' mean alone: their sum is all it needs
    options: type[MergeOptions] = NoOptions
    factored_inputs: str = "none"  # what a spectral merge factors: "mean" (one) or "each" (R)


_MERGE = "isoloco_ray.aggregators.merge"
MERGES: dict[str, MergeSpec] = {spec.name: spec for spec in (
    MergeSpec("mean", f"{_MERGE}:mean_merge", spectral=False, of_mean=True),
    MergeSpec("isoc", f"{_MERGE}:isoc_merge", spectral=True, of_mean=True,
              factored_inputs="mean"),
    MergeSpec("isocts", f"{_MERGE}:isocts_merge", spectral=True, of_mean=False,
              options=IsoctsOptions, factored_inputs="each"),
    MergeSpec("tsv", f"{_MERGE}:tsv_merge", spectral=True, of_mean=False, options=TsvOptions,
              factored_inputs="each"),
    MergeSpec("ties", f"{_MERGE}:sparse_merge_of", spectral=False, of_mean=False,
              options=TiesOptions),
    MergeSpec("dare", f"{_MERGE}:sparse_merge_of", spectral=False, of_mean=False,
              options=DareOptions),
)}


@dataclass(frozen=True)
class StrategySpec:
    """One `outer.strategy`: its merge, its options and the paper's settings."""

    name: str
    summary: str  # one line: what its outer step does
    merge: str | None  # the merge of MERGES it applies; None: no outer step (adamw_ddp)
    paper: Mapping[str, Any]  # the paper's inner_lr, lr, momentum and nesterov
    # Its outer.* options (their defaults the paper's); None: those of its merge.
    options: type[MergeOptions] | None = None
    momentum_is_optional: bool = False  # takes an outer momentum, though the paper sets none
    inner_weight_decay: float = 0.1
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

    @property
    def options_model(self) -> type[MergeOptions]:
        """The model of its outer.* options."""
        if self.options is not None:
            return self.options
        return MERGES[self.merge].options if self.merge is not None else NoOptions


STRATEGIES: dict[str, StrategySpec] = {spec.name: spec for spec in (
    StrategySpec("diloco", "Nesterov momentum on the mean Δ", "mean",
                 dict(inner_lr=1.38e-3, lr=0.7, momentum=0.9, nesterov=True)),
    StrategySpec("diloco_sgd", "the mean Δ", "mean",
                 dict(inner_lr=1.38e-3, lr=1.6, momentum=0.0, nesterov=False)),
    StrategySpec("isoc", "ISO-C of the mean Δ (all singular values set to their mean)", "isoc",
                 dict(inner_lr=3.91e-3, lr=2.1, momentum=0.0, nesterov=False)),
    StrategySpec("isoloco", "ISO-C and Nesterov momentum", "isoc",
                 dict(inner_lr=1.38e-3, lr=1.8, momentum=0.8, nesterov=True),
                 options=IsolocoOptions),
    StrategySpec("isocts", "ISO-CTS: common + per-replica subspaces, isotropic", "isocts",
                 dict(inner_lr=3.91e-3, lr=3.1, momentum=0.0, nesterov=False),
                 momentum_is_optional=True),
    StrategySpec("tsv", "TSV-Merge: per-replica top singular vectors, decorrelated", "tsv",
                 dict(inner_lr=2.76e-3, lr=0.6, momentum=0.0, nesterov=False)),
    StrategySpec("ties", "TIES: keep the largest entries of each Δ, sign-elected disjoint mean",
                 "ties", dict(inner_lr=2.76e-3, lr=0.7, momentum=0.0, nesterov=False),
                 momentum_is_optional=True),
    StrategySpec("dare", "DARE: drop entries of each Δ at random, rescale, mean", "dare",
                 dict(inner_lr=2.76e-3, lr=1.5, momentum=0.0, nesterov=False),
                 momentum_is_optional=True),
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


def options_error(error: ValidationError, prefix: str = "") -> ValueError:
    """An options model's complaint as one line per problem, each naming the setting as the
    caller spells it (`outer.sparsity: Input should be less than 1 (got 1.5)`)."""
    lines = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        where = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden":
            message = "unknown option"
        elif item["type"] != "value_error":
            message = f"{message} (got {item.get('input')!r})"
        lines.append(f"{prefix}{where}: {message}" if where else message)
    return ValueError("\n".join(lines))


def strategy_options(strategy: str, given: Mapping[str, Any], replicas: int | None = None,
                     prefix: str = "outer.") -> dict[str, Any]:
    """Every option of `strategy` (its options model), `given` where set, else the default;
    with `replicas`, the defaults that depend on R filled in too. A known option of other
    strategies given as None (unset) is dropped; given a value it is an error naming the
    strategies that take it, as is a name no strategy takes. ValueError, one line per
    problem, each naming `prefix` + the option."""
    model = STRATEGIES[strategy].options_model
    takers = option_strategies()
    problems = []
    for name, value in given.items():
        if name in model.model_fields:
            continue
        if name not in takers:
            problems.append(f"{prefix}{name}: unknown field; see --help for the fields of "
                            "each section")
        elif value is not None:
            problems.append(f"{prefix}{name} does not apply to {prefix}strategy '{strategy}' "
                            f"(only to {', '.join(takers[name])}); remove it")
    if problems:
        raise ValueError("\n".join(problems))
    ours = {name: value for name, value in given.items()
            if name in model.model_fields and value is not None}
    try:
        options = model.model_validate(ours, context={"prefix": prefix})
    except ValidationError as exc:
        raise options_error(exc, prefix) from None
    return (options if replicas is None else options.for_replicas(replicas)).model_dump()


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
    """Each outer.* option a strategy takes (its options model's fields, and lr, momentum and
    nesterov for those with an outer step) -> the strategies that take it: setting it for
    another strategy is a configuration error, not silently ignored."""
    takers: dict[str, list[str]] = {}
    for spec in STRATEGIES.values():
        names = (*spec.options_model.model_fields,
                 *(OUTER_STEP_OPTIONS if spec.has_outer_step else ()))
        for option in names:
            takers.setdefault(option, []).append(spec.name)
    return {option: tuple(names) for option, names in takers.items()}


class OuterSettings(Protocol):
    """What `OuterMerge.of` reads of a config's outer section (config.OuterConfig)."""

    @property
    def strategy(self) -> str: ...
    @property
    def strategy_options(self) -> Mapping[str, Any]: ...
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
        spec, options = STRATEGIES[outer.strategy], outer.strategy_options
        merge, prune_where_hosted, orthogonalize_update = spec.merge or "mean", False, False
        if options.get("orthogonalize") == "update":
            merge, orthogonalize_update = "mean", True
        if options.get("disjoint") is False:
            merge, prune_where_hosted = "mean", True
        merge_spec = MERGES[merge]
        return cls(spec.name, merge, merge_spec.of_mean, merge_spec.spectral,
                   merge_spec.factored_inputs, prune_where_hosted, orthogonalize_update,
                   tuple(merge_spec.options.model_fields) if merge == spec.merge else ())

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
