"""Grid files (tune_configs/*.yaml), as pydantic models: what a file may say, checked field
by field. A grid file holds a `base:` training config (the sections of the train CLI), a
`grid:` mapping dotted field paths to lists of values (their Cartesian product), and
optionally `trials:` (explicit combinations, e.g. a strategy with its own tuned lr), each
crossed with the grid; `metric:`, `resources:`, `scheduler:` and `search:` (SearchSpec) say how
the grid runs. No Ray import here.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from isoloco_ray.config import (
    ConfigError,
    TrainConfig,
    check_name,
    setting_paths,
    flatten,
    format_validation_error,
    read_yaml_config,
)
from isoloco_ray.metrics import ROUND_METRICS, SUMMARY_METRICS
from isoloco_ray.strategies import STRATEGIES, option_strategies

# The most trials a grid file makes unless it sets max_trials: higher.
MAX_TRIALS = 1000
# The summary figures a grid may rank by (metrics.RunSummary's ranked fields).
SummaryMetric = Literal[SUMMARY_METRICS]  # type: ignore[valid-type]
# Paths with environment references ($DATA_DIR/...) expanded when a grid is loaded, so files
# converted from W&B sweeps keep working unchanged on another cluster.
ENV_PATH_FIELDS = ("data.path", "run.storage_path")
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
    """The types the TrainConfig setting at `path` takes (`int | None`: int, NoneType); a
    strategy's option (outer.sparsity): as its options model declares it."""
    import typing

    model: Any = TrainConfig
    *sections, name = path.split(".")
    for section in sections:
        model = model.model_fields[section].annotation
    if name not in model.model_fields:
        model = STRATEGIES[option_strategies()[name][0]].options_model
    annotation = model.model_fields[name].annotation
    return typing.get_args(annotation) or (annotation,)


def check_field_path(path: str) -> str:
    """`path` if it names a setting of TrainConfig, else ValueError with the closest one."""
    paths = setting_paths()
    if path in paths:
        if path in _GRID_OWNED:
            raise ValueError(f"{path} {_GRID_OWNED[path]}")
        return path
    close = difflib.get_close_matches(path, paths, n=1)
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
    max_trials: int = Field(MAX_TRIALS, gt=0, description="the most trials the grid and trials "
                            "may make together (counted before they are built); raise it for "
                            "a larger grid")

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
            for index, value in enumerate(values):
                if value in values[:index]:  # == : 1 and 1.0 are one setting, as in a config
                    raise ValueError(f"{path}: {value!r} is listed twice, which would run the "
                                     "same trial twice; list each value once")
        return grid

    @model_validator(mode="after")
    def _count_trials(self) -> GridFile:
        """Refuse a grid of more than max_trials trials from the axes' lengths alone, before
        any trial is built (a product of 10⁷ would take minutes and gigabytes to list)."""
        count = max(len(self.trials), 1) * math.prod(len(v) for v in self.grid.values())
        if count > self.max_trials:
            factors = [f"{path} {len(values)}" for path, values in self.grid.items()]
            if len(self.trials) > 1:
                factors.append(f"trials {len(self.trials)}")
            raise ValueError(f"the grid makes {count:,} trials ({' × '.join(factors)}), more "
                             f"than max_trials ({self.max_trials:,}): shorten an axis, or set "
                             "max_trials: higher in the grid file")
        return self

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
