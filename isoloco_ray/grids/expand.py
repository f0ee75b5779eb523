"""A grid file expanded into trials, each validated as a TrainConfig and against its data
before Ray starts (`build_trials`, `validate_against_data`); with `search:` each trial is a
point that Optuna searches around instead (`Search`: `samples` proposals per point). No Ray
import here.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isoloco_ray import run_files
from isoloco_ray.config import (
    NAME_MAX_LEN,
    ConfigError,
    TrainConfig,
    build_config,
    check_name,
    flatten,
    merge_nested,
    nest,
)
from isoloco_ray.grids.spec import ENV_PATH_FIELDS, GridFile, SchedulerSpec, SearchSpec
from isoloco_ray.storage import check_durable, location, run_directory


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


# A grid of at least PROGRESS_FROM trials says how far the check of its trials' settings has
# got, every PROGRESS_EVERY_S seconds (about 5 ms per trial on a laptop core).
PROGRESS_FROM, PROGRESS_EVERY_S = 1000, 2.0


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
    configs = []
    shown = time.monotonic()
    for index, overrides in enumerate(expanded):
        configs.append(_build_config(base, overrides, index, warnings))
        if len(expanded) >= PROGRESS_FROM and time.monotonic() - shown >= PROGRESS_EVERY_S:
            # A large grid (max_trials raised) takes seconds per thousand trials: say so.
            print(f"checked {index + 1:,} of {len(expanded):,} trials' settings",
                  file=sys.stderr, flush=True)
            shown = time.monotonic()
    width = len(str(len(expanded) - 1))
    fields = distinguishing_fields([cfg.outer.strategy for cfg in configs], expanded)
    trials = []
    for index, (overrides, cfg) in enumerate(zip(expanded, configs)):
        name = trial_name(index, width, cfg.outer.strategy, overrides, fields)
        trials.append(Trial(index, name, overrides, _placed(cfg, name, grid_dir / run_files.RUNS)))
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
    from isoloco_ray.data.checks import check_against_data
    from isoloco_ray.data.format import DataError
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
    from isoloco_ray.data.checks import resolve_data_dir
    from isoloco_ray.data.format import DataError, DatasetMeta
    from isoloco_ray.data.prepare.documents import check_demo_fallback, ensure_demo_for

    check_demo_fallback(cfg)  # an error in a dry run too: the grid file itself is wrong
    raw = "" if cfg.data.path is None else str(cfg.data.path)
    if lenient and unset_variable(raw) is not None:
        return f"data.path {raw} names the unset environment variable {unset_variable(raw)}"
    try:
        if not lenient:  # a dry run prepares nothing
            ensure_demo_for(cfg)
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
