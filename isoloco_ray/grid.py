"""Grid files (tune_configs/*.yaml): the model, the expansion into trials, the validation.

A grid file holds a `base:` training config (the sections of the train CLI), a `grid:` mapping
dotted field paths to lists of values (their Cartesian product), and optionally `trials:`
(explicit combinations, e.g. a strategy with its own tuned lr), each crossed with the grid.
Every trial is validated as a TrainConfig and against its data here, before Ray starts; no Ray
import in this module.
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
# The grid names and places each trial's run itself.
_GRID_OWNED = ("run.name",)


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


def check_field_path(path: str) -> str:
    """`path` if it names a field of TrainConfig, else ValueError with the closest one."""
    if path in FIELD_PATHS:
        if path in _GRID_OWNED:
            raise ValueError(f"{path} is set by the grid (one run per trial); remove it")
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
        return self.config.run.storage_path / self.config.run.name


def build_trials(grid_file: GridFile, cli_overrides: dict[str, Any], grid_dir: Path,
                 warnings: list[str] | None = None) -> list[Trial]:
    """Every trial as a validated TrainConfig whose run lives under `grid_dir/runs/`.

    `cli_overrides` (nested, from --section.field=value) change the base; setting a field the
    grid varies is an error. Raises ConfigError naming the trial and the field. `warnings`
    (a dry run): an unset environment variable in a path is a warning there, not an error."""
    expanded = expand(grid_file)
    varied = {path for overrides in expanded for path in overrides}
    for path in flatten(cli_overrides):
        if path in varied:
            raise ConfigError(f"--{path}: the grid varies this field; change it in the grid "
                              "file instead")
    base = merge_nested(grid_file.base, cli_overrides)
    configs = []
    for index, overrides in enumerate(expanded):
        try:
            values = expand_env_paths(merge_nested(base, nest(overrides)), warnings)
            configs.append(build_config(values))
        except ConfigError as exc:
            raise ConfigError(f"trial {index} ({describe(overrides)}): " + str(exc).replace(
                "\n", f"\ntrial {index}: ")) from None
    width = len(str(len(expanded) - 1))
    fields = distinguishing_fields([cfg.outer.strategy for cfg in configs], expanded)
    trials = []
    for index, (overrides, cfg) in enumerate(zip(expanded, configs)):
        name = trial_name(index, width, cfg.outer.strategy, overrides, fields)
        run = cfg.run.model_copy(update={"name": name, "storage_path": grid_dir / "runs"})
        trials.append(Trial(index, name, overrides, cfg.model_copy(update={"run": run})))
    first_wandb = trials[0].config.run.wandb
    for trial in trials:
        if trial.config.run.wandb != first_wandb:
            raise ConfigError(f"trial {trial.index} ({describe(trial.overrides)}): run.wandb "
                              "must be the same for every trial of a grid; set it in base:")
    return trials


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


def grid_directory(grid_file: GridFile, cli_overrides: dict[str, Any], name: str,
                   warnings: list[str] | None = None) -> Path:
    """`run.storage_path` of the base (default runs/) / the grid's name, absolute.

    `warnings`: as in expand_env_paths (a dry run)."""
    base = expand_env_paths(merge_nested(grid_file.base, cli_overrides), warnings)
    storage = Path(base.get("run", {}).get("storage_path") or "runs")
    return storage.expanduser().resolve() / name


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
    from isoloco_ray.data.checks import resolve_data_dir

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
