"""Grid files (tune_configs/*.yaml): the model, the expansion into trials, the validation.

A grid file holds a `base:` training config (the sections of the train CLI), a `grid:` mapping
dotted field paths to lists of values (their Cartesian product), and optionally `trials:`
(explicit combinations, e.g. a strategy with its own tuned lr), each crossed with the grid.
With `search:` each of those trials is a point that Optuna searches around instead
(SearchSpec, Search): `samples` proposals per point. Every trial is validated as a
TrainConfig and against its data here, before Ray starts; no Ray import in this module.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from isoloco_ray.config import (NAME_MAX_LEN, ConfigError, TrainConfig, build_config,
                                check_name, field_paths, flatten, format_validation_error,
                                merge_nested, nest, read_yaml_config)
from isoloco_ray.storage import check_durable, location, run_directory

SummaryMetric = Literal["final_eval_loss", "final_eval_perplexity", "tokens_per_s", "seconds",
                        "train_seconds", "outer_bytes_per_round"]
FIELD_PATHS = field_paths(TrainConfig)
# Paths with environment references ($DATA_DIR/...) expanded when a grid is loaded, so files
# converted from W&B sweeps keep working unchanged on another cluster.
ENV_PATH_FIELDS = ("data.path", "run.storage_path")
# What a scheduler can judge a running trial by: figures of the per-round reports, lower is
# better (workers/loop.py; eval_* on evaluation rounds only, loss on every round after 0).
ROUND_METRICS = ("eval_loss", "eval_perplexity", "loss")
SCHEDULERS = {"asha": "asynchronous successive halving (Ray Tune's ASHAScheduler)",
              "median": "median stopping rule (Ray Tune's MedianStoppingRule)"}
SEARCH_ALGOS = {"optuna": "Optuna's TPE sampler through Ray Tune's OptunaSearch"}
# Fields a search may not vary: they decide the trial's data and the resources Tune reserves
# for it, which are checked and sized before Ray starts; vary them in grid: or trials:.
_NOT_SEARCHED = ("data.path", "run.storage_path", "scaling.")
# What the grid sets for each trial itself, so a grid: or trials: value would be ignored.
_GRID_OWNED = {
    "run.name": "is set by the grid (one run per trial); remove it",
    "run.storage_path": "is set by the grid (every trial runs in <grid>/runs); set it in base: "
                        "or with --run.storage_path",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MetricSpec(_Strict):
    """What ranks the trials: a figure of each run's summary.json."""

    name: SummaryMetric = Field("final_eval_loss", description="summary figure to rank by")
    mode: Literal["min", "max"] = Field("min", description="min: lower is better")


class TrialResources(_Strict):
    """How many trials run at once and what each trial's driver holds (its TorchTrainer's
    workers reserve `scaling.cpus_per_worker` and a GPU each on top)."""

    trial_cpus: float = Field(1.0, gt=0, description="logical CPUs of each trial's driver")
    max_concurrent: int | None = Field(
        None, gt=0, description="trials at once (default: as many as the cluster fits)")


class SchedulerSpec(_Strict):
    """`scheduler:` of a grid file: stop trials early on a per-round metric (Ray Tune's
    ASHAScheduler or MedianStoppingRule, mode min, one time step per outer round)."""

    name: str = Field(description="asha or median")
    metric: str = Field("eval_loss", description="per-round figure to judge trials by: "
                        + ", ".join(ROUND_METRICS))
    grace_rounds: int = Field(1, description="rounds every trial runs before it can be stopped")
    reduction_factor: float = Field(3.0, description="asha: 1/reduction_factor of the trials "
                                    "go on at each rung (rungs at grace_rounds x "
                                    "reduction_factor^k rounds)")
    min_trials: int = Field(3, description="median: other trials needed at a round before a "
                            "trial can be stopped there")

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if name not in SCHEDULERS:
            known = "; ".join(f"{key}: {what}" for key, what in SCHEDULERS.items())
            raise ValueError(f"unknown scheduler {name!r}; use one of {known}")
        return name

    @field_validator("metric")
    @classmethod
    def _check_metric(cls, metric: str) -> str:
        if metric not in ROUND_METRICS:
            raise ValueError(f"{metric!r} is not reported every round, so a scheduler cannot "
                             f"judge running trials by it; use one of {', '.join(ROUND_METRICS)}"
                             " (metric: ranks the finished trials, scheduler.metric stops "
                             "running ones)")
        return metric

    @field_validator("grace_rounds", "min_trials")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be a whole number >= 1 (got {value})")
        return value

    @field_validator("reduction_factor")
    @classmethod
    def _check_reduction(cls, value: float) -> float:
        if not math.isfinite(value) or value <= 1:
            raise ValueError(f"must be a finite number above 1 (got {value}); 3 keeps the best "
                             "third of the trials at each rung")
        return value

    @model_validator(mode="after")
    def _check_applies(self) -> SchedulerSpec:
        # A setting the chosen scheduler ignores is most likely meant for the other one.
        only = {"reduction_factor": "asha", "min_trials": "median"}
        for field, owner in only.items():
            if field in self.model_fields_set and self.name != owner:
                raise ValueError(f"scheduler.{field} applies to name: {owner} only; remove it "
                                 f"or set name: {owner}")
        return self


class SearchDimension(_Strict):
    """One field of `search.space`: exactly one of `uniform: [low, high]`,
    `loguniform: [low, high]` (low > 0) or `choice: [values]`."""

    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None
    choice: list[str | int | float | bool | None] | None = None

    @model_validator(mode="after")
    def _check(self) -> SearchDimension:
        given = [kind for kind in ("uniform", "loguniform", "choice")
                 if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of uniform: [low, high], loguniform: [low, high] "
                             f"or choice: [values] (got {', '.join(given) or 'none'})")
        if self.choice is not None:
            if not self.choice:
                raise ValueError("choice: an empty list proposes nothing")
            if len({json.dumps(value) for value in self.choice}) < len(self.choice):
                raise ValueError(f"choice: {self.choice} repeats a value; list each once")
            return self
        low, high = self.bounds
        if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
            raise ValueError(f"{self.kind}: [{low}, {high}] must be two finite numbers, low < "
                             "high")
        if self.loguniform is not None and low <= 0:
            raise ValueError(f"loguniform: low must be above 0 (got {low}); use uniform: for a "
                             "range from 0")
        return self

    @property
    def kind(self) -> str:
        """uniform, loguniform or choice."""
        return next(k for k in ("uniform", "loguniform", "choice") if getattr(self, k) is not None)

    @property
    def bounds(self) -> tuple[float, float]:
        """(low, high) of a uniform or loguniform range."""
        return self.uniform or self.loguniform  # type: ignore[return-value]

    def extremes(self) -> list[Any]:
        """The values that decide whether every proposal is valid: a range's bounds (the
        config's limits are ranges too), or every choice."""
        return list(self.choice) if self.choice is not None else list(self.bounds)

    def describe(self) -> str:
        """`loguniform [0.0001, 0.01]`, `choice [a, b]`."""
        shown = [f"{v:g}" if isinstance(v, float) else str(v) for v in self.extremes()]
        return f"{self.kind} [{', '.join(shown)}]"


class SearchSpec(_Strict):
    """`search:` of a grid file: instead of running each trial (grid point) once, propose
    `samples` variations of it from a seeded Optuna searcher over `space`."""

    algo: str = Field("optuna", description=", ".join(SEARCH_ALGOS))
    samples: int = Field(description="trials proposed for each grid point (trial)")
    seed: int = Field(0, description="seeds the sampler: the same file and seed propose the "
                      "same trials")
    space: dict[str, SearchDimension] = Field(description="field path -> {uniform: [low, "
                                              "high]} | {loguniform: [low, high]} | {choice: "
                                              "[values]}")

    @field_validator("algo")
    @classmethod
    def _check_algo(cls, algo: str) -> str:
        if algo not in SEARCH_ALGOS:
            known = "; ".join(f"{key}: {what}" for key, what in SEARCH_ALGOS.items())
            raise ValueError(f"unknown search algo {algo!r}; use {known}")
        return algo

    @field_validator("samples")
    @classmethod
    def _check_samples(cls, samples: int) -> int:
        if samples < 1:
            raise ValueError(f"must be a whole number >= 1 (got {samples}): the trials "
                             "proposed for each grid point")
        return samples

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, seed: int) -> int:
        if not 0 <= seed < 2**32:
            raise ValueError(f"must be a whole number from 0 to 2**32 - 1 (got {seed})")
        return seed

    @field_validator("space")
    @classmethod
    def _check_space(cls, space: dict[str, SearchDimension]) -> dict[str, SearchDimension]:
        if not space:
            raise ValueError("an empty space has nothing to search; name at least one field, "
                             "e.g. inner.lr: {loguniform: [1.0e-4, 1.0e-2]}")
        for path, dimension in space.items():
            check_field_path(path)
            if path.startswith(_NOT_SEARCHED):
                raise ValueError(f"{path} cannot be searched (it decides the trial's data or "
                                 "resources, checked before Ray starts); vary it in grid: or "
                                 "trials:")
            kinds = _field_types(path)
            if dimension.kind != "choice" and float not in kinds:
                what = "whole numbers" if int in kinds else "no numbers"
                raise ValueError(f"{path} takes {what} but {dimension.kind} proposes "
                                 f"fractions; use choice: [...] for {path}")
        return space

    def describe(self) -> str:
        """`optuna, 8 samples per grid point, seed 0`."""
        return (f"{self.algo}, {self.samples} sample{'s' if self.samples != 1 else ''} per "
                f"grid point, seed {self.seed}")


def _field_types(path: str) -> tuple[Any, ...]:
    """The types the TrainConfig field at `path` takes (`int | None`: int, NoneType)."""
    import typing

    model: Any = TrainConfig
    *sections, name = path.split(".")
    for section in sections:
        model = model.model_fields[section].annotation
    annotation = model.model_fields[name].annotation
    return typing.get_args(annotation) or (annotation,)


def check_field_path(path: str) -> str:
    """`path` if it names a field of TrainConfig, else ValueError with the closest one."""
    if path in FIELD_PATHS:
        if path in _GRID_OWNED:
            raise ValueError(f"{path} {_GRID_OWNED[path]}")
        return path
    close = difflib.get_close_matches(path, FIELD_PATHS, n=1)
    hint = f"; did you mean {close[0]}?" if close else " (fields are section.field, e.g. inner.lr)"
    raise ValueError(f"unknown field {path!r}{hint}")


class GridFile(_Strict):
    """A grid file: base config, grid, explicit trials, ranking metric, resources."""

    name: str | None = Field(None, description="grid name, its directory under "
                             "run.storage_path (default: the file's name)")
    base: dict[str, Any] = Field(default_factory=dict, description="the training config every "
                                 "trial starts from (sections as in the train CLI's YAML)")
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="field path -> values; "
                                       "every combination is a trial")
    trials: list[dict[str, Any]] = Field(default_factory=list, description="explicit "
                                         "combinations of field path -> value, each crossed "
                                         "with the grid")
    metric: MetricSpec = MetricSpec()
    resources: TrialResources = TrialResources()
    scheduler: SchedulerSpec | None = Field(None, description="stop trials early (asha or "
                                            "median on a per-round metric); default: none")
    search: SearchSpec | None = Field(None, description="propose samples around each trial "
                                      "with Optuna instead of running it once; default: none")

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str | None) -> str | None:
        return None if name is None else check_name(name, "name")

    @field_validator("grid")
    @classmethod
    def _check_grid(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for path, values in grid.items():
            check_field_path(path)
            if not values:
                raise ValueError(f"{path}: an empty list of values gives no trials")
        return grid

    @field_validator("trials")
    @classmethod
    def _check_trials(cls, trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
        checked = []
        for index, trial in enumerate(trials):
            flat = flatten(trial)  # nested sections and dotted paths both work
            for path in flat:
                try:
                    check_field_path(path)
                except ValueError as exc:
                    raise ValueError(f"trials[{index}]: {exc}") from None
            checked.append(flat)
        return checked


def load_grid_file(path: Path) -> GridFile:
    """Read and check a grid file; ConfigError naming the file and the field."""
    values = read_yaml_config(path)
    try:
        return GridFile.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(f"{path}: " + format_validation_error(exc).replace(
            "\n", f"\n{path}: ")) from None


def expand(grid_file: GridFile) -> list[dict[str, Any]]:
    """Every trial's settings (dotted path -> value): each explicit trial (or none) crossed
    with the grid's Cartesian product, in order: trials outer, grid inner (last key fastest)."""
    paths = list(grid_file.grid)
    combos = [dict(zip(paths, values)) for values in itertools.product(*grid_file.grid.values())]
    expanded = []
    for index, trial in enumerate(grid_file.trials or [{}]):
        clash = sorted(set(trial) & set(paths))
        if clash:
            raise ConfigError(f"trials[{index}] sets {clash[0]}, which grid: varies too; set it "
                              "in one place")
        expanded += [{**trial, **combo} for combo in combos]
    return expanded


def unset_variable(raw: str) -> str | None:
    """The first environment variable `raw` refers to ($DATA_DIR, ${DATA_DIR}) that is not
    set, or None."""
    missing = re.search(r"\$\{?(\w+)", os.path.expandvars(raw))
    return missing.group(1) if missing else None


def add_warning(warnings: list[str], message: str) -> None:
    """Append `message` to `warnings` unless it is there already (one warning per cause)."""
    if message not in warnings:
        warnings.append(message)


def expand_env_paths(values: dict[str, Any],
                     warnings: list[str] | None = None) -> dict[str, Any]:
    """`values` with environment references in path fields ($DATA_DIR/x) expanded.

    An unset variable is a ConfigError; with a `warnings` list (a dry run) the path stays as
    written and a warning is added instead."""
    values = json.loads(json.dumps(values, default=str))
    for path in ENV_PATH_FIELDS:
        section, name = path.split(".")
        raw = values.get(section, {}).get(name)
        if isinstance(raw, str) and "$" in raw:
            missing = unset_variable(raw)
            if missing is None:
                values[section][name] = os.path.expandvars(raw)
                continue
            message = f"{path}: environment variable {missing} is not set ({raw})"
            if warnings is None:
                raise ConfigError(f"{message}; set it, or set {path} without it")
            add_warning(warnings, f"{message}; a dry run keeps the path as written")
    return values


def describe(overrides: dict[str, Any]) -> str:
    """`outer.strategy=isoc, inner.lr=0.001`."""
    return ", ".join(f"{path}={value}" for path, value in overrides.items()) or "the base"


def distinguishing_fields(strategies: list[str], expanded: list[dict[str, Any]]) -> set[str]:
    """The fields whose values differ between trials of the same strategy: what a trial's
    name needs besides its strategy (a paper config pinning each strategy's own lr needs
    none)."""
    fields = set()
    for path in {p for overrides in expanded for p in overrides} - {"outer.strategy"}:
        seen: dict[str, set[str]] = {}
        for strategy, overrides in zip(strategies, expanded):
            seen.setdefault(strategy, set()).add(json.dumps(overrides.get(path, "<base>")))
        if any(len(values) > 1 for values in seen.values()):
            fields.add(path)
    return fields


def trial_name(index: int, width: int, strategy: str, overrides: dict[str, Any],
               fields: set[str]) -> str:
    """A stable, path-safe name: `03-isoloco-inner.lr=0.001` (index, strategy, the `fields`
    the trial sets). It names the trial's run directory, so --resume finds the same run."""
    parts = [f"{index:0{width}d}", strategy]
    parts += [f"{path}={value}" for path, value in overrides.items() if path in fields]
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", "-".join(parts))[:NAME_MAX_LEN]
    # Starts with the index, safe characters only, bounded: unique and one path component.
    return check_name(name, "trial name")


@dataclass
class Trial:
    """One trial of a grid: its name, what the grid set, the validated config, its data."""

    index: int
    name: str
    overrides: dict[str, Any]
    config: TrainConfig
    data_dir: Path | None = None

    @property
    def run_dir(self) -> Path:
        """Where the trial's training run writes (config, metrics, summary, model)."""
        return run_directory(self.config.run.storage_path, self.config.run.name)


def build_trials(grid_file: GridFile, cli_overrides: dict[str, Any], grid_dir: Path,
                 warnings: list[str] | None = None) -> list[Trial]:
    """Every trial as a validated TrainConfig whose run lives under `grid_dir/runs/` (with
    `search:`, the points that are searched: Search).

    `cli_overrides` (nested, from --section.field=value) change the base; setting a field the
    grid varies or searches is an error. Raises ConfigError naming the trial and the field.
    `warnings` (a dry run): an unset environment variable in a path is a warning there, not
    an error."""
    expanded = expand(grid_file)
    set_by_grid = {path for overrides in expanded for path in overrides}
    searched = set(grid_file.search.space) if grid_file.search is not None else set()
    clash = sorted(searched & set_by_grid)
    if clash:
        raise ConfigError(f"search.space.{clash[0]}: grid: or trials: set this field too; "
                          "search it or set it, in one place")
    for path in flatten(cli_overrides):
        if path in set_by_grid | searched:
            raise ConfigError(f"--{path}: the grid varies this field; change it in the grid "
                              "file instead")
    base = merge_nested(grid_file.base, cli_overrides)
    configs = [_build_config(base, overrides, index, warnings)
               for index, overrides in enumerate(expanded)]
    width = len(str(len(expanded) - 1))
    fields = distinguishing_fields([cfg.outer.strategy for cfg in configs], expanded)
    trials = []
    for index, (overrides, cfg) in enumerate(zip(expanded, configs)):
        name = trial_name(index, width, cfg.outer.strategy, overrides, fields)
        trials.append(Trial(index, name, overrides, _placed(cfg, name, grid_dir / "runs")))
    first = trials[0].config.run
    for trial in trials:
        # One W&B group and one Ray cluster (started for trial 0) serve the whole grid.
        for field in ("wandb", "num_cpus"):
            if getattr(trial.config.run, field) != getattr(first, field):
                raise ConfigError(f"trial {trial.index} ({describe(trial.overrides)}): "
                                  f"run.{field} must be the same for every trial of a grid; "
                                  "set it in base:")
    return trials


def _build_config(base: dict[str, Any], overrides: dict[str, Any], index: int,
                  warnings: list[str] | None) -> TrainConfig:
    """`base` with a trial's `overrides` as a TrainConfig; ConfigError naming the trial."""
    try:
        cfg = build_config(expand_env_paths(merge_nested(base, nest(overrides)), warnings))
    except ConfigError as exc:
        raise ConfigError(f"trial {index} ({describe(overrides)}): " + str(exc).replace(
            "\n", f"\ntrial {index}: ")) from None
    if cfg.scaling.fault_tolerance == "replica":
        # Tune ranks and stops trials from every worker's ray.train.report, and a replica-mode
        # run reports no round through Ray Train (a lost worker would hold every report).
        raise ConfigError(f"trial {index} ({describe(overrides)}): scaling.fault_tolerance: "
                          "replica does not run in a grid (Tune needs every worker's reports); "
                          "run it alone with python -m isoloco_ray.train, or use restart")
    return cfg


def _placed(cfg: TrainConfig, name: str, runs_dir: Path) -> TrainConfig:
    """`cfg` whose run is `runs_dir/name`."""
    return cfg.model_copy(update={"run": cfg.run.model_copy(
        update={"name": name, "storage_path": str(runs_dir)})})


@dataclass
class Search:
    """A grid's `search:`, ready to propose trials: each of the grid's trials is a point,
    searched `spec.samples` times; proposal `sample` of `point` is trial number
    point x samples + sample, so its name does not depend on when it was proposed."""

    spec: SearchSpec
    base: dict[str, Any]  # the grid file's base with the command line's overrides
    points: list[Trial]
    point_fields: set[str]  # what tells the points apart (their names)

    @property
    def count(self) -> int:
        """Trials the whole search runs."""
        return len(self.points) * self.spec.samples

    def name(self, point: int, sample: int, proposal: dict[str, Any]) -> str:
        """The trial name of `proposal` at `point`: its number, strategy, what tells the points
        apart and the proposal's values (3 significant digits); the same for the same
        proposal, whenever it is made."""
        source = self.points[point]
        proposal = self._ordered(proposal)
        shown = {**source.overrides,
                 **{path: f"{value:.3g}" if isinstance(value, float) else value
                    for path, value in proposal.items()}}
        strategy = proposal.get("outer.strategy", source.config.outer.strategy)
        return trial_name(point * self.spec.samples + sample, len(str(self.count - 1)),
                          str(strategy), shown, self.point_fields | set(proposal))

    def trial(self, point: int, sample: int, proposal: dict[str, Any]) -> Trial:
        """The trial of `proposal` (field path -> value) at `point`, validated as a
        TrainConfig (ConfigError naming the trial and the field), in the grid's runs/ like a
        grid trial."""
        source = self.points[point]
        index = point * self.spec.samples + sample
        overrides = {**source.overrides, **self._ordered(proposal)}
        cfg = _build_config(self.base, overrides, index, None)
        name = self.name(point, sample, proposal)
        return Trial(index, name, overrides,
                     _placed(cfg, name, source.config.run.storage_path), source.data_dir)

    def _ordered(self, proposal: dict[str, Any]) -> dict[str, Any]:
        # In the space's order (Optuna returns its parameters sorted): names read as the
        # file does.
        return {path: proposal[path] for path in sorted(proposal, key=list(self.spec.space)
                                                       .index)}

    def probes(self) -> list[tuple[str, Trial]]:
        """(search.space field, trial) for every point at each bound (or choice) of each
        field, the other fields at their lowest: whether every proposal can be valid."""
        probes = []
        for point in range(len(self.points)):
            for path, dimension in self.spec.space.items():
                for value in dimension.extremes():
                    proposal = {other: dim.extremes()[0] for other, dim in self.spec.space.items()}
                    proposal[path] = value
                    try:
                        probes.append((path, self.trial(point, 0, proposal)))
                    except ConfigError as exc:
                        raise ConfigError(f"search.space.{path}: {dimension.kind} value "
                                          f"{value!r} is not valid: {exc}") from None
        return probes


def make_search(grid_file: GridFile, cli_overrides: dict[str, Any],
                points: list[Trial]) -> Search | None:
    """The grid's Search over its trials `points` (build_trials), or None without
    `search:`."""
    if grid_file.search is None:
        return None
    fields = distinguishing_fields([t.config.outer.strategy for t in points],
                                   [t.overrides for t in points])
    return Search(grid_file.search, merge_nested(grid_file.base, cli_overrides), points,
                  fields)


def check_search(search: Search | None, warnings: list[str] | None = None) -> list[Trial]:
    """The probe trials of the search (Search.probes; none without one); ConfigError/
    DataError unless each bound (and choice) of the search space gives a valid trial at every
    point, against the points' data too: the config's limits are ranges, so a proposal
    between valid bounds is valid. `warnings`: as in validate_against_data (a dry run)."""
    import importlib.util

    from isoloco_ray.data.format import DataError

    if search is None:
        return []
    if importlib.util.find_spec("optuna") is None:
        raise ConfigError("search: needs the optuna package, which is not installed; "
                          'pip install -e ".[tune]"')
    probes = search.probes()
    for path, probe in probes:
        try:
            validate_against_data([probe], warnings)
        except (ConfigError, DataError) as exc:
            raise type(exc)(f"search.space.{path}: {exc}") from None
    return [probe for _, probe in probes]


def check_scheduler(spec: SchedulerSpec | None, trials: list[Trial]) -> None:
    """ConfigError unless the scheduler could stop some trial: grace_rounds must be below the
    rounds of the longest trial (a trial is never stopped at or after its last round)."""
    if spec is None:
        return
    longest = max(trial.config.run.rounds for trial in trials)
    if spec.grace_rounds >= longest:
        raise ConfigError(f"scheduler.grace_rounds ({spec.grace_rounds}) must be below "
                          f"run.rounds ({longest}, the longest trial): no trial could be "
                          "stopped; lower grace_rounds or remove scheduler:")
    if spec.metric.startswith("eval_") and not any(
            _judged_rounds(trial.config.run, spec.grace_rounds) for trial in trials):
        every = min(trial.config.run.eval_every for trial in trials)
        raise ConfigError(f"scheduler.metric: {spec.metric} is reported every run.eval_every "
                          f"({every}) rounds, and in no trial on a round from "
                          f"scheduler.grace_rounds ({spec.grace_rounds}) to before its last "
                          "round, where a trial can be stopped: lower run.eval_every or "
                          "grace_rounds, or use metric: loss")


def _judged_rounds(run: Any, grace_rounds: int) -> list[int]:
    """The rounds of a trial with `run` settings at which a scheduler judging an eval_*
    metric can stop it: evaluation rounds from `grace_rounds` on, before the last."""
    return [r for r in range(run.eval_every, run.rounds, run.eval_every) if r >= grace_rounds]


def grid_directory(grid_file: GridFile, cli_overrides: dict[str, Any], name: str,
                   warnings: list[str] | None = None) -> Path:
    """`run.storage_path` of the base (default runs/) / the grid's name, absolute.

    `warnings`: as in expand_env_paths (a dry run)."""
    base = expand_env_paths(merge_nested(grid_file.base, cli_overrides), warnings)
    storage = base.get("run", {}).get("storage_path") or "runs"
    check_durable(storage)
    return location(storage) / name


def validate_against_data(trials: list[Trial], warnings: list[str] | None = None) -> None:
    """Check every trial against its data (and W&B availability); sets `trial.data_dir`.

    ConfigError/DataError naming the trial. Each data directory is read once. With a
    `warnings` list (a dry run, e.g. on a laptop without the cluster's data) a data directory
    that is missing, broken or named with an unset variable is one warning naming its trials,
    and those trials are not checked against it; a config that does not fit data that is
    there is still an error."""
    from isoloco_ray.data.format import DataError
    from isoloco_ray.data.checks import check_against_data
    from isoloco_ray.wandb_log import check_wandb_available

    data: dict[Any, tuple[Path, Any] | str] = {}  # data.path -> (directory, meta), or why not
    unchecked: dict[Any, list[int]] = {}  # data.path -> trials not checked (a dry run)
    for trial in trials:
        cfg = trial.config
        try:
            if cfg.data.path not in data:
                data[cfg.data.path] = _load_data(cfg, lenient=warnings is not None)
            loaded = data[cfg.data.path]
            if isinstance(loaded, tuple):
                try:
                    check_against_data(cfg, loaded[1], loaded[0])
                    trial.data_dir = loaded[0]
                except DataError as exc:  # the data is broken (or not this model's)
                    if warnings is None:
                        raise
                    data[cfg.data.path] = str(exc)
            if trial.data_dir is None:
                unchecked.setdefault(cfg.data.path, []).append(trial.index)
            check_wandb_available(cfg)
        except (ConfigError, DataError) as exc:
            raise type(exc)(f"trial {trial.index} ({describe(trial.overrides)}): {exc}") from None
    for path, indices in unchecked.items():
        add_warning(warnings, f"{format_indices(indices)} not checked against their data: "
                              f"{data[path]}")


def _load_data(cfg: TrainConfig, lenient: bool) -> tuple[Path, Any] | str:
    """(data directory, its DatasetMeta) of `cfg`; ConfigError/DataError when it is missing
    or broken, or when `lenient` (a dry run) the reason as a string."""
    from isoloco_ray.data.format import DataError, DatasetMeta
    from isoloco_ray.data.checks import check_demo_fallback, resolve_data_dir

    check_demo_fallback(cfg)  # an error in a dry run too: the grid file itself is wrong
    raw = "" if cfg.data.path is None else str(cfg.data.path)
    if lenient and unset_variable(raw) is not None:
        return f"data.path {raw} names the unset environment variable {unset_variable(raw)}"
    try:
        data_dir = resolve_data_dir(cfg)
        return data_dir, DatasetMeta.load(data_dir)
    except (ConfigError, DataError) as exc:
        if not lenient:
            raise
        return str(exc)


def format_indices(indices: list[int]) -> str:
    """`trial 3`, `trials 0-4` (a run of indices) or `trials 0, 2, 5`."""
    if len(indices) == 1:
        return f"trial {indices[0]}"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"trials {indices[0]}-{indices[-1]}"
    return "trials " + ", ".join(str(i) for i in indices)
