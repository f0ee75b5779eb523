"""A grid file, loaded, expanded and validated with its data before Ray starts: `GridPlan`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isoloco_ray.config import ConfigError, check_name, parse_cli_overrides
from isoloco_ray.grids.expand import (
    Search,
    Trial,
    build_trials,
    check_scheduler,
    check_search,
    grid_directory,
    make_search,
    validate_against_data,
)
from isoloco_ray.grids.spec import GridFile, load_grid_file

PROG = "python -m isoloco_ray.tune"


@dataclass
class GridPlan:
    """A validated grid, ready to run. With `search:`, `trials` are the points searched and
    `probes` the trials at the bounds of the space (grid.Search)."""

    name: str
    grid_dir: Path
    file: GridFile
    trials: list[Trial]
    warnings: list[str] = dataclasses.field(default_factory=list)  # a dry run's, e.g. no data
    search: Search | None = None
    probes: list[Trial] = dataclasses.field(default_factory=list)

    def manifest(self, max_concurrent: int | None) -> dict[str, Any]:
        """grid.json: what `report` and `--resume` need to know about the grid. A search's
        `trials` start empty: each is added when it is proposed (make_searcher), and `points`
        and `search` tell --resume whether the grid is the same."""
        manifest = {"name": self.name, "metric": self.file.metric.name,
                    "mode": self.file.metric.mode, "max_concurrent": max_concurrent,
                    "scheduler": (None if self.file.scheduler is None
                                  else self.file.scheduler.model_dump(mode="json"))}
        if self.search is None:
            return {**manifest, "trials": [trial_entry(t) for t in self.trials]}
        return {**manifest, "search": self.search.spec.model_dump(mode="json"),
                "points": [trial_entry(t) for t in self.trials], "trials": []}

    @property
    def max_rounds(self) -> int:
        """Rounds of the longest trial (a search's: of the longest a proposal can have)."""
        return max(t.config.run.rounds for t in self.trials + self.probes)


def trial_entry(trial: Trial, **extra: Any) -> dict[str, Any]:
    """A trial in grid.json: its name, strategy, what the grid set, its config."""
    return {"name": trial.name, "strategy": trial.config.outer.strategy,
            "overrides": trial.overrides, "config": trial.config.model_dump(mode="json"),
            **extra}


def grid_name(path: Path, grid_file: GridFile | None, name: str | None) -> str:
    """The grid's name, its directory: `--name`, else the file's `name:`, else the file's
    name; ConfigError unless it is one safe directory name (config.check_name)."""
    try:
        if name is not None:
            return check_name(name, "--name")
        if grid_file is not None and grid_file.name is not None:
            return grid_file.name  # checked when the file was loaded
        return check_name(path.stem, f"the grid's name (from the file name {path.name})")
    except ValueError as exc:
        hint = "" if name is not None else "; set name: in the file or pass --name"
        raise ConfigError(f"{exc}{hint}") from None


def plan_grid(path: Path, cli_args: list[str], name: str | None = None,
              dry_run: bool = False) -> GridPlan:
    """Load, expand and validate the grid file with the command line's overrides, against
    the data too; raises ConfigError/DataError naming the trial and the field.

    In a `dry_run`, an unset environment variable in a path and missing or broken data are
    warnings (`GridPlan.warnings`), so a grid can be checked away from its cluster."""
    if name is not None:
        name = grid_name(path, None, name)  # checked before anything is read
    overrides = parse_cli_overrides(cli_args, PROG)
    grid_file = load_grid_file(path)
    if name is None:
        name = grid_name(path, grid_file, None)
    warnings: list[str] | None = [] if dry_run else None
    grid_dir = grid_directory(grid_file, overrides, name, warnings)
    trials = build_trials(grid_file, overrides, grid_dir, warnings)
    validate_against_data(trials, warnings)
    search = make_search(grid_file, overrides, trials)
    probes = check_search(search, warnings)
    check_scheduler(grid_file.scheduler, trials + probes)
    return GridPlan(name, grid_dir, grid_file, trials, warnings or [], search, probes)
