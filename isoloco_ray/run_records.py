"""What the runs of a directory say, read from their own files: `config.json`,
`metrics.jsonl`, `summary.json`, `error.txt` and `stopped.json` (run_files.py), without Ray, also
while the runs are going on. A directory is a grid (`grid.json` and `runs/<trial>/`), one run,
or a directory holding runs.

A run whose final eval loss is not a finite number (NaN, inf; null in the strict JSON that
isoloco_ray.strict_json writes) is `diverged`: it ranks after every other run and is never the
best. Files written before strict JSON, with NaN/Infinity in them, are read as well. The report
(report.py), the grid's console and search (grids/) read runs through this module.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isoloco_ray import run_files
from isoloco_ray.config import check_name, flatten
from isoloco_ray.metrics import DIVERGED_IF_NOT_FINITE
from isoloco_ray.storage import location

# Fields every run sets differently by construction: never "varied" in a table.
_IGNORED_FIELDS = ("run.name", "run.storage_path", "outer.strategy")


class ReportError(ValueError):
    """A directory with nothing to report, or an unreadable run file."""


def finite(value: Any) -> float | None:
    """`value` as a float if it is a finite number, else None (NaN, inf, null, text)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


@dataclass
class RunRecord:
    """What the files of one run (or one grid trial) say."""

    name: str
    run_dir: Path
    overrides: dict[str, Any] = field(default_factory=dict)  # the grid's settings of this trial
    config: dict[str, Any] | None = None  # config.json: the resolved TrainConfig
    summary: dict[str, Any] | None = None  # summary.json: written when the run finished
    metrics: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl, one per round
    error: str | None = None  # error.txt: why the trial failed
    stopped: dict[str, Any] | None = None  # stopped.json: the scheduler stopped it early
    planned_strategy: str | None = None  # a grid trial's strategy, known before it starts

    @property
    def status(self) -> str:
        """done, diverged (finished with a non-finite final eval loss, or marked so by the run:
        its last rounds skipped, or no better than a uniform prediction), stopped (early, by the
        grid's scheduler), failed, incomplete (running or interrupted) or pending (not
        started). A stopped trial that still finished (its last rounds raced the stop) is
        done; one whose Train run failed as it was torn down is stopped."""
        if self.summary is not None:
            diverged = self.summary.get("status") == "diverged" or any(
                key in self.summary and finite(self.summary[key]) is None
                for key in DIVERGED_IF_NOT_FINITE)
            return "diverged" if diverged else "done"
        if self.stopped is not None:
            return "stopped"
        if self.error is not None:
            return "failed"
        return "incomplete" if self.metrics else "pending"

    @property
    def strategy(self) -> str:
        """The run's outer strategy, from whichever file has it."""
        if self.config is not None:
            return self.config["outer"]["strategy"]
        return self.planned_strategy or "?"

    def evals(self) -> list[tuple[int, float]]:
        """(tokens, eval loss) of every evaluation so far."""
        return [(m["tokens"], m["eval_loss"]) for m in self.metrics if "eval_loss" in m]

    def value(self, metric: str) -> float | None:
        """`metric` of the finished run, or for an unfinished one its latest eval loss; may be
        NaN or inf (shown as such), None when unknown."""
        if self.summary is not None:
            value = self.summary.get(metric)
            if value is None and metric in DIVERGED_IF_NOT_FINITE and metric in self.summary:
                return math.nan  # strict JSON's null for NaN/inf
            return float(value) if isinstance(value, (int, float)) else None
        evals = self.evals()
        if evals and metric in ("final_eval_loss", "final_eval_perplexity"):
            loss = evals[-1][1]
            loss = math.nan if loss is None else float(loss)  # null: not finite
            return loss if metric == "final_eval_loss" else math.exp(min(loss, 50.0))
        return None

    def tokens(self) -> int | None:
        """Training tokens done."""
        if self.summary is not None:
            return self.summary.get("tokens")
        return self.metrics[-1].get("tokens") if self.metrics else None


@dataclass
class Report:
    """The runs of a directory, ranked by `metric`."""

    title: str
    runs: list[RunRecord]
    varied: list[str]  # dotted config fields shown as columns
    metric: str = "final_eval_loss"
    mode: str = "min"
    skipped: list[str] = field(default_factory=list)  # why each unreadable run was left out

    def ranked(self) -> list[RunRecord]:
        """Runs best first; then runs without the metric, then diverged runs and runs whose
        metric is NaN or inf, each group in its original order."""
        sign = 1.0 if self.mode == "min" else -1.0

        def key(run: RunRecord) -> tuple[int, float]:
            value = run.value(self.metric)
            if run.status == "diverged" or (value is not None and finite(value) is None):
                return (2, 0.0)
            return (1, 0.0) if value is None else (0, sign * value)

        return sorted(self.runs, key=key)

    def best(self) -> RunRecord | None:
        """The best finished run (never one that diverged or whose metric is not finite)."""
        return next((run for run in self.ranked() if run.status == "done"
                     and finite(run.value(self.metric)) is not None), None)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(f"cannot read {path}: {exc}") from None


def _read_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in `path`; ReportError naming the file when it is not one."""
    value = _read_json(path)
    if not isinstance(value, dict):
        raise ReportError(f"{path}: not {what} (a JSON {type(value).__name__}, not an object)")
    return value


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl, one entry per round: a run restarted from an earlier point appended its
    rounds again, and the latest report of a round wins. A torn line is skipped; a line that
    is not a round's record (an object with an integer round and tokens) is a ReportError
    naming the file and the line."""
    by_round: dict[int, dict[str, Any]] = {}
    if not path.is_file():
        return []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            metrics = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not (isinstance(metrics, dict) and _count(metrics.get("round"))
                and _count(metrics.get("tokens"))):
            raise ReportError(f"{path}: line {number} is not a round's record (an object with "
                              "an integer round and tokens)")
        by_round[metrics["round"]] = metrics
    return [by_round[r] for r in sorted(by_round)]


def _count(value: Any) -> bool:
    """Whether `value` is a whole number ≥ 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def last_error_line(error: str) -> str:
    """The most telling line of a traceback: its last non-empty one."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"


def load_run(run_dir: Path, name: str | None = None,
             overrides: dict[str, Any] | None = None) -> RunRecord:
    """The record of one run directory (which may not exist yet: a pending trial)."""
    run = RunRecord(name=name or run_dir.name, run_dir=run_dir, overrides=overrides or {})
    if (run_dir / run_files.CONFIG).is_file():
        run.config = _read_object(run_dir / run_files.CONFIG, "a run's config.json")
        outer = run.config.get("outer")
        if not (isinstance(outer, dict) and isinstance(outer.get("strategy"), str)):
            raise ReportError(f"{run_dir / run_files.CONFIG}: not a run's config.json (it has "
                              "no outer.strategy)")
    if (run_dir / run_files.SUMMARY).is_file():
        run.summary = _read_object(run_dir / run_files.SUMMARY, "a run's summary.json")
    if (run_dir / run_files.ERROR).is_file():
        run.error = (run_dir / run_files.ERROR).read_text()
    if (run_dir / run_files.STOPPED).is_file():
        run.stopped = _read_object(run_dir / run_files.STOPPED, "a run's stopped.json")
    run.metrics = read_metrics(run_dir / run_files.METRICS)
    return run


def is_run_dir(path: Path) -> bool:
    """Whether `path` holds a training run's files."""
    return any((path / name).is_file() for name in (run_files.CONFIG, run_files.METRICS,
                                                    run_files.SUMMARY))


def varied_fields(configs: list[dict[str, Any]]) -> list[str]:
    """The config fields whose values differ between runs (in config order)."""
    flats = [flatten(c) for c in configs]
    keys = list(dict.fromkeys(k for flat in flats for k in flat))
    return [k for k in keys if k not in _IGNORED_FIELDS
            and len({json.dumps(flat.get(k), sort_keys=True) for flat in flats}) > 1]


def load_report(directory: Path) -> Report:
    """The runs in `directory`: a grid, a single run, or a directory of runs."""
    directory = location(directory)
    if not directory.exists():
        raise ReportError(f"{directory} does not exist; give a grid directory, a run directory "
                          "or a directory of runs")
    if not directory.is_dir():
        raise ReportError(f"{directory} is a file, not a directory; give the directory that "
                          "holds it (a grid directory, a run directory or a directory of runs)")
    if (directory / run_files.GRID).is_file():
        grid = _read_grid(directory / run_files.GRID)
        runs, skipped = _load_runs([(directory / run_files.RUNS / t["name"], t)
                                    for t in grid["trials"]], directory)
        varied = list(dict.fromkeys(k for t in grid["trials"] for k in t.get("overrides", {})
                                    if k not in _IGNORED_FIELDS))
        return Report(f"grid {grid['name']}", runs, varied, grid.get("metric", "final_eval_loss"),
                      grid.get("mode", "min"), skipped)
    if is_run_dir(directory):
        return Report(f"run {directory.name}", [load_run(directory)], [])
    runs, skipped = _load_runs([(path, None) for path in sorted(directory.iterdir())
                                if path.is_dir() and is_run_dir(path)], directory)
    return Report(f"runs in {directory.name}", runs,
                  varied_fields([run.config for run in runs if run.config is not None]),
                  skipped=skipped)


def _read_grid(path: Path) -> dict[str, Any]:
    """grid.json, checked: an object with a name and trials, each naming a directory under
    runs/ (nothing outside); ReportError naming the file otherwise."""
    grid = _read_object(path, "a grid's grid.json")
    trials = grid.get("trials")
    if not (isinstance(grid.get("name"), str) and isinstance(trials, list)
            and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                    and isinstance(t.get("overrides", {}), dict) for t in trials)):
        raise ReportError(f"{path}: not a grid's grid.json (it needs a name and trials, each "
                          "with a name)")
    for trial in trials:
        try:
            check_name(trial["name"], f"{path}: trial name")
        except ValueError as exc:
            raise ReportError(str(exc)) from None
    return grid


def _load_runs(candidates: list[tuple[Path, dict[str, Any] | None]], directory: Path
               ) -> tuple[list[RunRecord], list[str]]:
    """The runs of `candidates` (a run directory, and its grid trial or None), and why each
    run that cannot be read was skipped; ReportError when none is left."""
    runs, skipped = [], []
    for path, trial in candidates:
        try:
            run = (load_run(path) if trial is None
                   else load_run(path, trial["name"], trial.get("overrides")))
        except ReportError as exc:
            skipped.append(str(exc))
            continue
        if trial is not None:
            run.planned_strategy = trial.get("strategy")
        runs.append(run)
    if not runs:
        why = f": {'; '.join(skipped)}" if skipped else ""
        raise ReportError(f"{directory} holds no runs that can be read (no config.json, "
                          f"metrics.jsonl or summary.json in it or its subdirectories{why})")
    return runs, skipped
