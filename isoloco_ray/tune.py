"""`python -m isoloco_ray.tune GRID.yaml [--section.field=value ...]`: a grid of runs on Ray Tune.

Every trial of the grid file (isoloco_ray.grid) is validated, with its data, before Ray starts.
Then a Tune function trainable builds one TorchTrainer per trial (the Ray Train V2 pattern:
`Tuner(trainer)` no longer works), its per-round metrics flow to Tune through
`TuneReportCallback`, trials run at once as far as the cluster fits them, and a failed trial
is recorded without stopping the others. With a `scheduler:` (isoloco_ray.grid.SchedulerSpec)
Tune's ASHA or median stopping rule ends trials that fall behind, on the rounds that report
its metric (make_scheduler). With a `search:` (isoloco_ray.grid.SearchSpec) each trial is a
point that one seeded Optuna searcher per point varies `samples` times (make_searcher), each
proposal added to grid.json as it is made. At the end (and after `--resume` of an
interrupted grid) the results table, eval-loss plot and best config are written
(isoloco_ray.report).

Layout of a grid directory (`<run.storage_path>/<grid name>/`): `grid.json` (the trials),
`runs/<trial>/` (each trial's training run, as the train CLI writes it), `tune/` (Tune's
experiment; each `--resume` gets a fresh one, `tune-resume-<n>/`), `results.md`,
`results.csv`, `eval_loss.png`, `best_config.yaml`.

`--resume` never reads Tune's state: grid directories live on shared storage, and Tune's
state is pickled (`tuner.pkl`, pickles inside `experiment_state-*.json`, searcher state), so a
tampered file would run code. The grid's own JSON decides instead: `grid.json` must match the
command line, and a trial whose run directory holds `summary.json` (finished), `error.txt`
(failed) or `stopped.json` (stopped early by the grid's `scheduler:`) is kept; the others
run in a fresh Tuner under their old names, so Ray Train finds their run directories and
continues from their last checkpoint (Ray Train reads `checkpoint_manager_snapshot.json`,
JSON; the checkpoints load with `torch.load(weights_only=True)`). A search resumes likewise
(search_state): fresh searchers are told the outcome of the trials over from their run files,
and propose the samples left.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isoloco_ray import run_files
from isoloco_ray import strict_json
from isoloco_ray.config import ConfigError, TrainConfig, check_name, parse_cli_overrides
from isoloco_ray.data.format import DataError
from isoloco_ray.grid import (GridFile, SchedulerSpec, Search, Trial, build_trials,
                              check_scheduler, check_search, describe, grid_directory,
                              load_grid_file, make_search, validate_against_data)
from isoloco_ray.report import (ERROR_FILE, GRID_FILE, RUNS_DIR, STOPPED_FILE, RunRecord,
                                finite, last_error_line, load_run, print_report, write_report)
from isoloco_ray.storage import check_writable, hold_run, location, run_directory

PROG = "python -m isoloco_ray.tune"
TUNE_DIR = "tune"  # Tune's experiment inside the grid directory (a resume's: tune-resume-<n>)
SUMMARY_FILE = run_files.SUMMARY
# Logical CPUs a trial needs beyond its driver and workers: Ray Data's read tasks.
DATA_CPUS = 1.0
# Proposals of each grid point's searcher drawn at random (seeded) before TPE models the
# results (Optuna's default, named so that --dry-run can say which proposals are fixed).
STARTUP_TRIALS = 10


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


def print_plan(plan: GridPlan) -> None:
    """One line per trial: what it trains and what the grid set. A search: the space, the
    points searched and each point's first proposals (fixed by the seed)."""
    if plan.search is None:
        print(f"grid {plan.name}: {len(plan.trials)} trials -> {plan.grid_dir}")
    else:
        print(f"grid {plan.name}: a search of {len(plan.trials)} grid point"
              f"{'s' if len(plan.trials) != 1 else ''} x {plan.search.spec.samples} samples = "
              f"{plan.search.count} trials -> {plan.grid_dir}")
        print(f"  search: {plan.search.spec.describe()}, {plan.file.metric.mode} "
              f"{plan.file.metric.name}")
        for path, dimension in plan.search.spec.space.items():
            print(f"    {path}: {dimension.describe()}")
    if plan.file.scheduler is not None:
        print(f"  early stopping: {describe_scheduler(plan.file.scheduler)}")
    if plan.search is None:
        print_trials(plan.trials)
        return
    print("  grid points:")
    print_trials(plan.trials)
    samples = plan.search.spec.samples
    if samples > STARTUP_TRIALS:
        print(f"  first {STARTUP_TRIALS} proposals of each point (random, fixed by the seed; "
              "TPE proposes the rest from the results):")
    else:  # TPE would start after STARTUP_TRIALS results: a seeded random search
        print(f"  the {samples} proposal{'s' if samples != 1 else ''} of each point (random, "
              f"fixed by the seed: TPE starts after {STARTUP_TRIALS}):")
    shown = min(samples, STARTUP_TRIALS)
    print_trials(first_proposals(plan, shown))


def print_trials(trials: list[Trial]) -> None:
    """One line per trial: its layout, length, learning rates and what the grid set."""
    width = max(len(t.name) for t in trials)
    for trial in trials:
        cfg = trial.config
        workers = cfg.scaling.num_workers
        print(f"  {trial.name:<{width}}  R={cfg.scaling.replicas} on {workers} "
              f"{'GPU ' if cfg.scaling.use_gpu else ''}worker{'s' if workers > 1 else ''}, "
              f"{cfg.run.rounds} rounds x H={cfg.inner.steps}, "
              f"{cfg.run.rounds * cfg.tokens_per_round:,} tokens, inner lr {cfg.inner.lr:g}"
              + ("" if cfg.outer.strategy == "adamw_ddp" else f", outer lr {cfg.outer.lr:g}")
              + f" | {describe(trial.overrides)}")


# ---------------------------------------------------------------------------------------------
# What runs inside Ray


def run_trial(params: dict[str, Any]) -> dict[str, Any]:
    """The Tune function trainable: one trial's TorchTrainer, reporting every round to Tune.

    Returns the run's summary (Tune's last result). A trial whose run already finished (the
    grid was interrupted right after) returns that run's summary without training again.
    The traceback of a failure is kept in the run's error.txt for the report. The run's
    directory is held while the trial runs (storage.hold_run)."""
    trial = params["trial"]
    cfg = TrainConfig.model_validate(trial["config"])
    data_dir = location(trial["data_dir"], "data.path")
    run_dir = run_directory(cfg.run.storage_path, cfg.run.name)
    with hold_run(run_dir):
        return _run_trial_held(cfg, data_dir, run_dir)


def _run_trial_held(cfg: TrainConfig, data_dir: Any, run_dir: Any) -> dict[str, Any]:
    """`run_trial` once its run directory is held."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from isoloco_ray.train import fit, write_config, write_summary

    if (run_dir / SUMMARY_FILE).is_file():
        return strict_json.finite_or_none(json.loads((run_dir / SUMMARY_FILE).read_text()))
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    write_config(run_dir, cfg)
    started = time.perf_counter()
    try:
        final = fit(cfg, data_dir, run_dir, callbacks=[TuneReportCallback()])
        wait_for_tune_to_take_reports()
        if "error" in final:  # the loop gave up (e.g. every replica diverged)
            raise RuntimeError(f"the run stopped after round {final['rounds']}: "
                               f"{final['error']}")
    except Exception:
        (run_dir / ERROR_FILE).write_text(traceback.format_exc())
        raise
    # summary.json is strict JSON (a NaN eval loss is null: the report says "diverged");
    # so is what Tune records.
    summary = write_summary(cfg, final, data_dir, run_dir, time.perf_counter() - started)
    return strict_json.finite_or_none(summary)


def wait_for_tune_to_take_reports(settle_seconds: float = 0.5, limit_seconds: float = 60) -> None:
    """Return once the trial's Tune session has taken every report Ray Train sent it.

    TuneReportCallback hands each round's report from Train's controller to this trial's
    actor through a one-slot queue, which the actor's main thread moves into the session's
    one-slot result queue. A trial function that returns while the last report is still in
    the first queue makes Tune put its "function returned" marker in the result queue first,
    and the main thread then blocks for ever putting the report behind it (Ray 2.60: a grid
    hung once in a few dozen trials on a loaded machine). Both queues must stay empty for
    `settle_seconds` (the main thread takes an item from one and puts it in the other at
    once); after `limit_seconds` the function returns regardless."""
    from ray.train._internal.session import get_session

    session = get_session()
    reports = getattr(session, "_inter_actor_queue", None)
    results = getattr(session, "result_queue", None)
    if reports is None or results is None:
        return
    deadline = time.monotonic() + limit_seconds
    empty_since = None
    while time.monotonic() < deadline:
        if reports.empty() and results.empty():
            empty_since = empty_since or time.monotonic()
            if time.monotonic() - empty_since >= settle_seconds:
                return
        else:
            empty_since = None
        time.sleep(0.05)


def trial_name(trial: Any) -> str:
    """Tune's name and directory of a trial: the grid's stable trial name."""
    return trial.config["trial"]["name"]


def trial_run_dir(trial: Any) -> Path:
    """The run directory of a Tune trial (its config's run.storage_path / run.name)."""
    run = trial.config["trial"]["config"]["run"]
    return run_directory(run["storage_path"], run["name"])


def describe_scheduler(spec: SchedulerSpec) -> str:
    """`asha on eval_loss (lower is better), judged on the rounds that report it, after 1
    grace round, reduction factor 3`."""
    text = (f"{spec.name} on {spec.metric} (lower is better), judged on the rounds that report "
            f"it, after {spec.grace_rounds} grace round{'s' if spec.grace_rounds != 1 else ''}")
    if spec.name == "asha":
        return f"{text}, reduction factor {spec.reduction_factor:g}"
    return f"{text}, against at least {spec.min_trials} other trials"


# Tune's own fields of a result besides ray.tune.result.AUTO_RESULT_KEYS (time, host, config):
# left out of stopped.json, which keeps what the trial reported.
_TUNE_RESULT_FIELDS = ("trial_id", "experiment_tag", "done", "should_checkpoint")


def make_scheduler(spec: SchedulerSpec, max_rounds: int) -> Any:
    """Ray Tune's ASHAScheduler or MedianStoppingRule for `spec`, on time step `round`,
    wrapped so that it fits trials that each run a TorchTrainer:

    - it sees only the rounds that report `spec.metric` (eval_loss: the evaluation rounds,
      every run.eval_every), never Tune's final result (the run's summary, without `round`),
      so MedianStoppingRule never reads a result without its metric;
    - a non-finite value (a diverging trial) reaches it as +inf, the worst value, instead of
      NaN, which ASHA would record and never stop;
    - PAUSE becomes CONTINUE: pausing would tear down the trial's Train run only to restart it;
    - a trial is never stopped at its last round: it is writing its summary then;
    - a STOP writes the trial's stopped.json before Tune stops the trial (report and
      `--resume` read it).
    """
    from ray.tune.result import DEFAULT_METRIC
    from ray.tune.schedulers import ASHAScheduler, MedianStoppingRule, TrialScheduler

    if spec.name == "asha":
        inner: TrialScheduler = ASHAScheduler(
            time_attr="round", metric=spec.metric, mode="min", max_t=max_rounds,
            grace_period=spec.grace_rounds, reduction_factor=spec.reduction_factor)
    else:
        inner = MedianStoppingRule(time_attr="round", metric=spec.metric, mode="min",
                                   grace_period=spec.grace_rounds,
                                   min_samples_required=spec.min_trials)

    class RoundScheduler(TrialScheduler):
        def __init__(self) -> None:
            super().__init__()
            self.last: dict[Any, dict[str, Any]] = {}  # trial -> last result `inner` saw
            self.finishing: set[Any] = set()  # trials `inner` would stop at their last round

        @property
        def metric(self) -> str:
            # Tune refuses a result without its scheduler's metric (_validate_result_metrics)
            # unless that is the anonymous default; rounds between evaluations and the final
            # summary have no eval_loss, and on_trial_result sorts them out instead.
            return DEFAULT_METRIC

        def set_search_properties(self, metric: str | None, mode: str | None,
                                  **kwargs: Any) -> bool:
            return inner.set_search_properties(metric, mode, **kwargs)

        def on_trial_add(self, controller: Any, trial: Any) -> None:
            inner.on_trial_add(controller, trial)

        def on_trial_error(self, controller: Any, trial: Any) -> None:
            inner.on_trial_error(controller, trial)

        def on_trial_remove(self, controller: Any, trial: Any) -> None:
            inner.on_trial_remove(controller, trial)

        def on_trial_result(self, controller: Any, trial: Any, result: dict) -> str:
            if "round" not in result or spec.metric not in result or trial in self.finishing:
                return TrialScheduler.CONTINUE
            value = finite(result[spec.metric])
            seen = {**result, spec.metric: math.inf if value is None else value}
            self.last[trial] = seen
            decision = inner.on_trial_result(controller, trial, seen)
            if decision == TrialScheduler.STOP:
                if result["round"] >= trial.config["trial"]["config"]["run"]["rounds"]:
                    self.finishing.add(trial)
                    return TrialScheduler.CONTINUE
                write_stopped(trial, spec, result)
                return TrialScheduler.STOP
            return TrialScheduler.CONTINUE  # PAUSE too (see above)

        def on_trial_complete(self, controller: Any, trial: Any, result: dict) -> None:
            if trial in self.last:  # the last round it saw: Tune's final result has no round
                inner.on_trial_complete(controller, trial, self.last.pop(trial))

        def choose_trial_to_run(self, controller: Any) -> Any:
            return inner.choose_trial_to_run(controller)

        def debug_string(self) -> str:
            return inner.debug_string()

    return RoundScheduler()


def write_stopped(trial: Any, spec: SchedulerSpec, result: dict[str, Any]) -> None:
    """The trial's stopped.json (atomic, strict JSON): the round it was stopped at, why, and
    what it reported then. `trial_pid` is the trial's process, gone once Tune stopped it."""
    from ray.tune.result import AUTO_RESULT_KEYS

    metrics = {key: value for key, value in result.items()
               if key not in AUTO_RESULT_KEYS and key not in _TUNE_RESULT_FIELDS
               and not key.startswith("config/")}
    run_dir = trial_run_dir(trial)
    run_dir.mkdir(parents=True, exist_ok=True)
    strict_json.write(run_dir / STOPPED_FILE, {
        "round": result["round"], "scheduler": spec.name, "metric": spec.metric,
        "value": result[spec.metric], "reason": f"stopped early by {describe_scheduler(spec)}",
        "trial_pid": result.get("pid"), "metrics": metrics}, indent=2)


# ---------------------------------------------------------------------------------------------
# Search: one seeded Optuna searcher per grid point


def optuna_space(search: Search) -> dict[str, Any]:
    """The search space as Optuna distributions, keyed by field path."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    space: dict[str, Any] = {}
    for path, dimension in search.spec.space.items():
        if dimension.choice is not None:
            space[path] = CategoricalDistribution(dimension.choice)
        else:
            low, high = dimension.bounds
            space[path] = FloatDistribution(low, high, log=dimension.loguniform is not None)
    return space


def point_searcher(search: Search, metric: str, mode: str, seed: int) -> Any:
    """Ray Tune's OptunaSearch over the space for one grid point, its TPE sampler seeded with
    `seed`: the first STARTUP_TRIALS proposals are seeded random draws, the later ones TPE's
    model of the results told so far."""
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no log line per told trial
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=STARTUP_TRIALS)
    return OptunaSearch(space=optuna_space(search), metric=metric, mode=mode, sampler=sampler)


def sampler_seed(seed: int, proposed: int) -> int:
    """The samplers' seed: the file's on a fresh start; after `proposed` trials (a resume)
    one derived from both, so that a resume does not draw the proposals it already ran, and
    the same interrupted grid resumes the same way."""
    return seed if proposed == 0 else (seed * 1_000_003 + proposed) % 2**32


def first_proposals(plan: GridPlan, count: int) -> list[Trial]:
    """The first `count` trials of each point on a fresh start, as the run proposes them
    (before any result they do not depend on results); ConfigError for a proposal that is
    not a valid config."""
    search = _search_of(plan)
    trials = []
    for point in range(len(search.points)):
        searcher = point_searcher(search, plan.file.metric.name, plan.file.metric.mode,
                                  search.spec.seed)
        trials += [search.trial(point, sample, searcher.suggest(f"{point}-{sample}"))
                   for sample in range(count)]
    return trials


def _search_of(plan: GridPlan) -> Search:
    if plan.search is None:
        raise ValueError(f"grid {plan.name} has no search:")
    return plan.search


@dataclass
class Proposal:
    """A trial a search proposed: its grid point, its sample number there, the proposed
    values (field path -> value) and its name."""

    point: int
    sample: int
    values: dict[str, Any]
    name: str

    @property
    def key(self) -> str:
        """Its id in its point's searcher."""
        return f"{self.point}-{self.sample}"


@dataclass
class SearchState:
    """Where a search stands (grid.json's trials, the runs' own files): the proposals that
    are over, those to run again, and the (point, sample) pairs not proposed yet, in the
    order they are proposed (round-robin over the points)."""

    over: list[Proposal]
    rerun: list[Proposal]
    todo: list[tuple[int, int]]

    @property
    def proposed(self) -> int:
        """Trials proposed so far."""
        return len(self.over) + len(self.rerun)


def search_state(plan: GridPlan, entries: list[Any]) -> SearchState:
    """The state of `plan`'s search from grid.json's `trials` (none on a fresh start).
    ConfigError unless each entry is a proposal this grid file names as it does (its name
    is rebuilt from its point, sample and values), each (point, sample) once."""
    search = _search_of(plan)
    proposals: list[Proposal] = []
    for index, entry in enumerate(entries):
        try:
            point, sample = entry["point"], entry["sample"]
            values = {path: entry["overrides"][path] for path in search.spec.space}
            valid = (type(point) is int and type(sample) is int
                     and 0 <= point < len(search.points) and 0 <= sample < search.spec.samples
                     and search.name(point, sample, values) == entry["name"])
        except (KeyError, TypeError, ValueError, AttributeError):
            valid = False
        if not valid:
            raise ConfigError(f"--resume: {plan.grid_dir / GRID_FILE}: trials[{index}] is not a "
                              "trial this grid file proposes; start a new grid (--name)")
        proposals.append(Proposal(point, sample, values, entry["name"]))
    taken = {(p.point, p.sample) for p in proposals}
    if len(taken) < len(proposals):
        raise ConfigError(f"--resume: {plan.grid_dir / GRID_FILE} lists a trial twice; start a "
                          "new grid (--name)")
    over = [p for p in proposals if run_is_over(plan.grid_dir / RUNS_DIR / p.name)]
    return SearchState(over, [p for p in proposals if p not in over],
                       [(point, sample) for sample in range(search.spec.samples)
                        for point in range(len(search.points)) if (point, sample) not in taken])


def search_outcome(run_dir: Path, metric: str) -> tuple[float | None, str]:
    """What a search learns from a trial, from its run's own files (as the report ranks it):
    (the metric, "complete") for a finished run; (None, "pruned") for one that diverged,
    was stopped early or did not finish, which TPE counts as worse than every finished one;
    (None, "fail") for a failed one, which TPE leaves out."""
    run = load_run(run_dir)
    value = finite(run.value(metric)) if run.status == "done" else None
    if value is not None:
        return value, "complete"
    return None, "fail" if run.status == "failed" else "pruned"


def make_searcher(plan: GridPlan, state: SearchState, manifest: dict[str, Any]) -> Any:
    """A Ray Tune Searcher running `plan`'s search from `state`: one seeded OptunaSearch per
    grid point (point_searcher), told the outcome of each trial over (search_outcome). It
    hands out the trials to run again first, then proposes the rest round-robin over the
    points; each proposal is validated as a TrainConfig and added to grid.json (`manifest`,
    rewritten atomically) before Tune sees it. A proposal that is not a valid config is
    recorded as failed (its run's error.txt) and told to its searcher, never run."""
    from ray.tune.search import Searcher

    search = _search_of(plan)
    metric, mode = plan.file.metric.name, plan.file.metric.mode
    seed = sampler_seed(search.spec.seed, state.proposed)
    searchers = [point_searcher(search, metric, mode, seed) for _ in search.points]
    runs_dir = plan.grid_dir / RUNS_DIR

    def tell(proposal: Proposal, asked: bool) -> None:
        value, outcome = search_outcome(runs_dir / proposal.name, metric)
        searcher = searchers[proposal.point]
        if asked:  # proposed by this searcher: it waits for the trial's result
            searcher.on_trial_complete(proposal.key, None if value is None else {metric: value},
                                       error=outcome == "fail")
        else:
            searcher.add_evaluated_point(proposal.values, value, error=outcome == "fail",
                                         pruned=outcome == "pruned")

    def record(entry: dict[str, Any]) -> None:
        manifest["trials"].append(entry)
        strict_json.write(plan.grid_dir / GRID_FILE, manifest, indent=2)

    for proposal in state.over:
        tell(proposal, asked=False)

    class ProposalSearcher(Searcher):
        def __init__(self) -> None:
            # No metric: Tune would demand it in every round's result; each trial's outcome
            # is read from its run's files when it completes (search_outcome).
            super().__init__()
            self.rerun = list(state.rerun)
            self.todo = list(state.todo)
            self.live: dict[str, tuple[Proposal, bool]] = {}  # Tune's trial id -> proposal

        def set_search_properties(self, metric: str | None, mode: str | None, config: dict,
                                  **spec: Any) -> bool:
            return True  # the space and the grid's metric are set already

        def suggest(self, trial_id: str) -> dict | None:
            if self.rerun:
                proposal = self.rerun.pop(0)
                self.live[trial_id] = (proposal, False)
                return {"trial": trial_space(search.trial(proposal.point, proposal.sample,
                                                          proposal.values))}
            while self.todo:
                point, sample = self.todo.pop(0)
                key = f"{point}-{sample}"
                values = searchers[point].suggest(key)
                proposal = Proposal(point, sample, values, search.name(point, sample, values))
                try:
                    trial = search.trial(point, sample, values)
                except ConfigError as exc:
                    self.refuse(proposal, str(exc))
                    continue
                record(trial_entry(trial, point=point, sample=sample))
                self.live[trial_id] = (proposal, True)
                return {"trial": trial_space(trial)}
            return Searcher.FINISHED

        def refuse(self, proposal: Proposal, error: str) -> None:
            source = search.points[proposal.point]
            run_dir = runs_dir / proposal.name
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / ERROR_FILE).write_text(f"ConfigError: the proposal is not a valid "
                                              f"config: {error}\n")
            record({"name": proposal.name, "overrides": {**source.overrides, **proposal.values},
                    "strategy": proposal.values.get("outer.strategy",
                                                    source.config.outer.strategy),
                    "config": None, "point": proposal.point, "sample": proposal.sample,
                    "error": error})
            tell(proposal, asked=True)
            print(f"{proposal.name}: FAILED: the proposal is not a valid config: "
                  f"{last_error_line(error)}", flush=True)

        def on_trial_complete(self, trial_id: str, result: dict | None = None,
                              error: bool = False) -> None:
            if trial_id in self.live:
                proposal, asked = self.live.pop(trial_id)
                tell(proposal, asked)

    return ProposalSearcher()


def trial_space(trial: Trial) -> dict[str, Any]:
    """What run_trial receives of a trial (Tune's config["trial"])."""
    return {"name": trial.name, "overrides": trial.overrides, "data_dir": str(trial.data_dir),
            "config": trial.config.model_dump(mode="json")}


def _progress_printer() -> Any:
    """A Tune callback printing each trial's rounds, completion and failure on the console
    (Tune's own status tables are turned off)."""
    from ray import tune

    from isoloco_ray.train import format_progress

    class ProgressPrinter(tune.Callback):
        def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict,
                            **info: Any) -> None:
            if "round" in result:
                config = trial.config["trial"]["config"]
                line = format_progress(result, config["run"]["rounds"],
                                       overlapped=config["outer"]["delay"] > 0)
                print(f"{trial_name(trial)}: {line}", flush=True)

        def on_trial_complete(self, iteration: int, trials: list, trial: Any,
                              **info: Any) -> None:
            result = trial.last_result or {}
            if "final_eval_loss" in result:
                loss = finite(result["final_eval_loss"])
                if result.get("status") == "diverged":
                    outcome = f"diverged: {result.get('diverged')}"
                elif loss is None:
                    outcome = "diverged, final eval loss not a finite number"
                else:
                    outcome = f"done, final eval loss {loss:.4f}"
                print(f"{trial_name(trial)}: {outcome}, {result.get('seconds', 0.0):.0f}s",
                      flush=True)
            elif (trial_run_dir(trial) / STOPPED_FILE).is_file():  # the scheduler stopped it
                marker = json.loads((trial_run_dir(trial) / STOPPED_FILE).read_text())
                print(f"{trial_name(trial)}: stopped early at round {marker['round']} "
                      f"({marker['metric']} {_number(marker['value'])})", flush=True)

        def on_trial_error(self, iteration: int, trials: list, trial: Any,
                           **info: Any) -> None:
            error_file = trial_run_dir(trial) / ERROR_FILE
            error = error_file.read_text() if error_file.is_file() else trial.get_error() or ""
            print(f"{trial_name(trial)}: FAILED: {last_error_line(str(error))}", flush=True)

    return ProgressPrinter()


def _number(value: Any) -> str:
    """`5.4321`, or `not a finite number` (null in strict JSON)."""
    number = finite(value)
    return "not a finite number" if number is None else f"{number:.4f}"


def trial_needs(cfg: TrainConfig, trial_cpus: float) -> dict[str, float]:
    """Logical resources one trial holds while it trains: its driver, its workers, data."""
    workers = cfg.scaling.num_workers
    return {"CPU": trial_cpus + workers * cfg.scaling.worker_cpus + DATA_CPUS,
            "GPU": float(workers) if cfg.scaling.use_gpu else 0.0}


def start_cluster(plan: GridPlan, requested: int | None, count: int | None = None) -> int:
    """Join or start Ray and choose how many trials run at once.

    A local cluster gets enough logical CPUs for the trials asked for (Tune's trial drivers
    and Ray Data need slots besides the workers); the concurrency is capped by what the
    cluster fits, because a trial whose driver holds a CPU its workers need would wait."""
    import ray

    from isoloco_ray.train import start_ray

    need: dict[str, float] = {}
    for trial in plan.trials:
        for key, value in trial_needs(trial.config, plan.file.resources.trial_cpus).items():
            need[key] = max(need.get(key, 0.0), value)
    cfg = plan.trials[0].config
    local = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    if local and cfg.run.num_cpus is None:
        cores = os.cpu_count() or 1
        num_cpus = max(4, 2 * cores, math.ceil((requested or 1) * need["CPU"]))
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"num_cpus": num_cpus})})
    # With the dashboard (on 127.0.0.1): Ray Train's PlacementGroupCleaner asks the state API,
    # which the dashboard serves, whether a trial's TrainController is alive. Without it, the
    # workers' placement group of a trial that Tune stopped (a scheduler's verdict, a failed
    # trial) is never removed, and the next trial waits for those CPUs forever.
    start_ray(cfg, dashboard=True)
    available = ray.cluster_resources()
    fits = min(int(available.get(key, 0.0) // value) for key, value in need.items() if value)
    if requested is not None:
        if requested > fits:
            print(f"warning: --max-concurrent {requested} is more trials than the cluster fits "
                  f"now ({fits}; each needs {_format_needs(need)}): a trial beyond that holds "
                  "its driver's CPU while it waits for workers, which can stall the grid",
                  file=sys.stderr)
        return requested
    if fits < 1:
        print(f"warning: a trial needs {_format_needs(need)} but the cluster has "
              f"{_format_needs(available)} now; trials wait until it grows", file=sys.stderr)
    return max(1, min(fits, len(plan.trials) if count is None else count))


def _format_needs(resources: dict[str, float]) -> str:
    return ", ".join(f"{resources.get(key, 0.0):g} {key}" for key in ("CPU", "GPU")
                     if key == "CPU" or resources.get(key))


@contextlib.contextmanager
def quiet_tune() -> Iterator[None]:
    """Keep Tune's status tables and failure tracebacks off the console: the progress
    printer says what happens, in one line per round, and error.txt keeps the traceback."""
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the legacy reporter obeys verbose=0
    loggers = [logging.getLogger(name) for name in ("ray.tune.execution.tune_controller",
                                                    "ray.tune.tune")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def unfinished_trials(trials: list[Trial]) -> list[Trial]:
    """The trials a resume runs again: those whose run is not over (run_is_over). Read from
    our own files only, never Tune's state."""
    return [trial for trial in trials if not run_is_over(trial.run_dir)]


def run_is_over(run_dir: Path) -> bool:
    """Whether a trial's run holds summary.json (finished), error.txt (failed) or
    stopped.json (stopped early by the scheduler, which stays its verdict)."""
    return any((run_dir / name).is_file() for name in (SUMMARY_FILE, ERROR_FILE, STOPPED_FILE))


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
    path = plan.grid_dir / GRID_FILE
    if not path.is_file():
        raise ConfigError(f"--resume: {plan.grid_dir} holds no grid to resume (no {GRID_FILE})")
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


def run_grid(plan: GridPlan, max_concurrent: int | None, resume: bool) -> int:
    """Run (or resume) the grid with Ray Tune, then write and print the report.

    A resume runs only the unfinished trials (unfinished_trials; a search: search_state), in
    a fresh Tune experiment. Returns 0 when every trial finished or was stopped early by the
    scheduler, 1 when any failed, diverged or did not finish, 2 when the grid directory does
    not match the request."""
    manifest_path = plan.grid_dir / GRID_FILE
    todo = plan.trials
    state = None
    try:
        if resume:
            manifest = read_manifest(plan)
            if max_concurrent is not None and max_concurrent != manifest.get("max_concurrent"):
                print("note: --resume keeps the concurrency the grid started with "
                      f"({manifest.get('max_concurrent') or 'as many as fit'})",
                      file=sys.stderr)
            max_concurrent = manifest.get("max_concurrent")
            todo = unfinished_trials(plan.trials)
        elif manifest_path.exists() or (plan.grid_dir / TUNE_DIR).exists():
            raise ConfigError(f"{plan.grid_dir} already holds a grid; continue it with --resume "
                              "or choose another --name")
        else:
            manifest = plan.manifest(max_concurrent)
        if plan.search is not None:
            state = search_state(plan, manifest["trials"])
        check_writable(plan.grid_dir.parent)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    count = len(todo) if state is None else len(state.rerun) + len(state.todo)
    if count:
        run_trials(plan if state is not None else dataclasses.replace(plan, trials=todo),
                   max_concurrent, resume, manifest, state)
    else:
        print(f"grid {plan.name}: every trial has finished, failed or been stopped early; "
              "nothing to resume", flush=True)

    report, written = write_report(plan.grid_dir)
    print_report(report, written)
    return grid_status(report.runs)


def run_trials(plan: GridPlan, max_concurrent: int | None, resume: bool,
               manifest: dict[str, Any], state: SearchState | None = None) -> None:
    """Run `plan.trials` (a search: what `state` leaves to run) in a fresh Tune experiment
    of the grid directory; the first run writes grid.json (`manifest`) too."""
    from ray import tune

    from isoloco_ray.wandb_log import export_wandb_mode, tune_wandb_callback

    count = len(plan.trials) if state is None else len(state.rerun) + len(state.todo)
    concurrency = start_cluster(plan, max_concurrent, count)
    plan.grid_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (plan.grid_dir / GRID_FILE).write_text(strict_json.dumps(manifest, indent=2))
    experiment = new_experiment_name(plan.grid_dir)
    print(f"grid {plan.name}: {'resuming ' if resume else ''}{count} trial"
          f"{'s' if count != 1 else ''}, up to {concurrency} at once, in {plan.grid_dir}"
          + (f" (Tune: {experiment}/)" if resume else ""), flush=True)

    trainable = tune.with_resources(run_trial, {"CPU": plan.file.resources.trial_cpus})
    scheduler = None
    if plan.file.scheduler is not None:
        scheduler = make_scheduler(plan.file.scheduler, plan.max_rounds)
        print(f"early stopping: {describe_scheduler(plan.file.scheduler)}", flush=True)
    searcher = None
    param_space: dict[str, Any] = {"trial": tune.grid_search([trial_space(t)
                                                              for t in plan.trials])}
    if state is not None:
        searcher = make_searcher(plan, state, manifest)
        param_space = {}
        print(f"search: {_search_of(plan).spec.describe()}"
              + (f", {state.proposed} trials proposed before" if state.proposed else ""),
              flush=True)
    export_wandb_mode(plan.trials[0].config.run.wandb)
    callbacks = [_progress_printer()]
    wandb_callback = tune_wandb_callback(plan.trials[0].config.run.wandb, plan.name)
    if wandb_callback is not None:
        callbacks.append(wandb_callback)
    tuner = tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(max_concurrent_trials=concurrency, scheduler=scheduler,
                                    search_alg=searcher,
                                    num_samples=1 if state is None else count,
                                    # A stopped trial's actor must end (its TorchTrainer's
                                    # controller and workers with it), not wait for reuse.
                                    reuse_actors=False,
                                    trial_name_creator=trial_name,
                                    trial_dirname_creator=trial_name),
        run_config=tune.RunConfig(name=experiment, storage_path=str(plan.grid_dir),
                                  callbacks=callbacks, verbose=0))
    with quiet_tune():
        tuner.fit()  # a failed trial is recorded in its result, not raised


def grid_status(runs: list[RunRecord]) -> int:
    """Print what did not finish; 0 when every trial is done or was stopped early by the
    scheduler (its verdict, not a failure), else 1."""
    counts: dict[str, int] = {}
    for run in runs:
        if run.status not in ("done", "stopped"):
            counts[run.status] = counts.get(run.status, 0) + 1
    stopped = sum(run.status == "stopped" for run in runs)
    if stopped:
        print(f"{stopped} of {len(runs)} trials were stopped early by the scheduler "
              f"({STOPPED_FILE} in their run directories)")
    if not counts:
        return 0
    print(f"{sum(counts.values())} of {len(runs)} trials are not done: "
          + ", ".join(f"{n} {status}" for status, n in counts.items())
          + ("; rerun with --resume to continue the unfinished ones"
             if counts.keys() & {"incomplete", "pending"} else ""))
    return 1


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    """The tune CLI's own options; everything else is a --section.field=value override."""
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Run a grid of trainings (tune_configs/*.yaml) with Ray Tune, then write "
                    "a results table, an eval-loss plot and the best trial's config.",
        epilog="Any --section.field=value option of `python -m isoloco_ray.train --help` "
               "changes the base config of every trial (not a field the grid varies).")
    parser.add_argument("config", nargs="?", type=Path, metavar="GRID.yaml",
                        help="grid file: base:, grid:, trials:, metric:, resources:, "
                             "scheduler:, search:")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate and print the expanded trials, then exit; missing data "
                             "and unset $VARS in paths are warnings here (check a grid away "
                             "from its cluster)")
    parser.add_argument("--max-concurrent", type=int, metavar="N",
                        help="trials at once (default: resources.max_concurrent, else as many "
                             "as the cluster fits)")
    parser.add_argument("--resume", action="store_true",
                        help="continue an interrupted grid: unfinished trials run again (from "
                             "their last checkpoint), finished and failed ones are kept")
    parser.add_argument("--name", help="grid name, its directory under run.storage_path "
                                       "(default: the file's name: field, else its file name)")
    parser.add_argument("--from-wandb-sweep", type=Path, metavar="SWEEP.yaml",
                        help="print a grid file converted from a W&B sweep file, and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for configuration errors)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.from_wandb_sweep is not None:
        from isoloco_ray.sweep_convert import convert_main

        return convert_main(args.from_wandb_sweep)
    if args.config is None:
        parser.error("a grid file is required (e.g. tune_configs/demo_strategies.yaml)")
    if args.max_concurrent is not None and args.max_concurrent < 1:
        parser.error("--max-concurrent must be at least 1")
    try:
        plan = plan_grid(args.config, rest, args.name, dry_run=args.dry_run)
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.dry_run:
        try:
            print_plan(plan)
        except ConfigError as exc:  # a search's first proposal is not a valid config
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    max_concurrent = args.max_concurrent or plan.file.resources.max_concurrent
    try:
        return run_grid(plan, max_concurrent, args.resume)
    except ConfigError as exc:  # the cluster cannot hold a trial (train.start_ray)
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
