"""`--resume` from the grid's own JSON: which trials are over, a fresh Tune experiment
name, the stored grid.json checked against the request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from isoloco_ray import run_files, strict_json
from isoloco_ray.config import ConfigError
from isoloco_ray.grids.expand import Trial
from isoloco_ray.grids.plan import GridPlan

TUNE_DIR = "tune"  # Tune's experiment inside the grid directory (a resume's: tune-resume-<n>)


def unfinished_trials(trials: list[Trial]) -> list[Trial]:
    """The trials a resume runs again: those whose run is not over (run_is_over). Read from
    our own files only, never Tune's state."""
    return [trial for trial in trials if not run_is_over(trial.run_dir)]


def run_is_over(run_dir: Path) -> bool:
    """Whether a trial's run holds summary.json (finished), error.txt (failed) or
    stopped.json (stopped early by the scheduler, which stays its verdict)."""
    return any((run_dir / name).is_file()
               for name in (run_files.SUMMARY, run_files.ERROR, run_files.STOPPED))


def new_experiment_name(grid_dir: Path) -> str:
    """The name of a fresh Tune experiment in `grid_dir`: `tune`, else (a resume)
    `tune-resume-<n>` with the first n not taken. Tune never sees an older experiment's
    (pickled) state, so it has none to load."""
    if not (grid_dir / TUNE_DIR).exists():
        return TUNE_DIR
    n = 1
    while (grid_dir / f"{TUNE_DIR}-resume-{n}").exists():
        n += 1
    return f"{TUNE_DIR}-resume-{n}"


def read_manifest(plan: GridPlan) -> dict[str, Any]:
    """The stored grid.json of the grid to resume; ConfigError unless it holds the same
    trials as `plan` (same file, same flags; a search: the same search and points)."""
    path = plan.grid_dir / run_files.GRID
    if not path.is_file():
        raise ConfigError(f"--resume: {plan.grid_dir} holds no grid to resume (no "
                          f"{run_files.GRID})")
    try:
        stored = json.loads(path.read_text())
        trials = stored["trials"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--resume: cannot read {path} ({exc}); start a new grid (--name)"
                          ) from None
    expected = json.loads(strict_json.dumps(plan.manifest(None)))
    # A grid is the same when its trials are; a search when its settings and points are (its
    # trials are the proposals so far).
    identity = ("search", "points") if plan.search is not None else ("search", "trials")
    if not isinstance(trials, list) or any(stored.get(key) != expected.get(key)
                                           for key in identity):
        raise ConfigError(f"--resume: the grid's trials changed since {plan.grid_dir} was "
                          "started; resume with the same file and flags, or start a new grid "
                          "(--name)")
    concurrency = stored.get("max_concurrent")
    if concurrency is not None and (type(concurrency) is not int or concurrency < 1):
        raise ConfigError(f"--resume: {path}: max_concurrent must be a whole number >= 1 or "
                          f"null (got {concurrency!r}); start a new grid (--name)")
    return stored
