"""`python -m isoloco_ray.tune GRID.yaml [--section.field=value ...]`: a grid of runs on Ray Tune.

Every trial of the grid file (isoloco_ray.grid) is validated, with its data, before Ray starts.
Then a Tune function trainable builds one TorchTrainer per trial (the Ray Train V2 pattern:
`Tuner(trainer)` no longer works), its per-round metrics flow to Tune through
`TuneReportCallback`, trials run at once as far as the cluster fits them, and a failed trial
is recorded without stopping the others. With a `scheduler:` (isoloco_ray.grid.SchedulerSpec)
Tune's ASHA or median stopping rule ends trials that fall behind, on the rounds that report
its metric (make_scheduler). At the end (and after `--resume` of an interrupted
grid) the results table, eval-loss plot and best config are written (isoloco_ray.report).

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
JSON; the checkpoints load with `torch.load(weights_only=True)`).
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

from isoloco_ray import strict_json
from isoloco_ray.config import ConfigError, TrainConfig, check_name, parse_cli_overrides
from isoloco_ray.data.format import DataError
from isoloco_ray.grid import (GridFile, SchedulerSpec, Trial, build_trials, check_scheduler,
                              describe, grid_directory, load_grid_file, validate_against_data)
from isoloco_ray.report import (ERROR_FILE, GRID_FILE, STOPPED_FILE, RunRecord, finite,
                                last_error_line, print_report, write_report)
from isoloco_ray.train import check_writable

PROG = "python -m isoloco_ray.tune"
TUNE_DIR = "tune"  # Tune's experiment inside the grid directory (a resume's: tune-resume-<n>)
SUMMARY_FILE = "summary.json"  # written by a finished run
# Logical CPUs a trial needs beyond its driver and workers: Ray Data's read tasks.
DATA_CPUS = 1.0


@dataclass
class GridPlan:
    """A validated grid, ready to run."""

    name: str
    grid_dir: Path
    file: GridFile
    trials: list[Trial]
    warnings: list[str] = dataclasses.field(default_factory=list)  # a dry run's, e.g. no data

    def manifest(self, max_concurrent: int | None) -> dict[str, Any]:
        """grid.json: what `report` and `--resume` need to know about the grid."""
        return {"name": self.name, "metric": self.file.metric.name,
                "mode": self.file.metric.mode, "max_concurrent": max_concurrent,
                "scheduler": (None if self.file.scheduler is None
                              else self.file.scheduler.model_dump(mode="json")),
                "trials": [{"name": t.name, "strategy": t.config.outer.strategy,
                            "overrides": t.overrides,
                            "config": t.config.model_dump(mode="json")} for t in self.trials]}


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
    check_scheduler(grid_file.scheduler, trials)
    validate_against_data(trials, warnings)
    return GridPlan(name, grid_dir, grid_file, trials, warnings or [])


def print_plan(plan: GridPlan) -> None:
    """One line per trial: what it trains and what the grid set."""
    print(f"grid {plan.name}: {len(plan.trials)} trials -> {plan.grid_dir}")
    if plan.file.scheduler is not None:
        print(f"  early stopping: {describe_scheduler(plan.file.scheduler)}")
    width = max(len(t.name) for t in plan.trials)
    for trial in plan.trials:
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
    The traceback of a failure is kept in the run's error.txt for the report."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from isoloco_ray.train import fit, write_summary

    trial = params["trial"]
    cfg = TrainConfig.model_validate(trial["config"])
    data_dir = Path(trial["data_dir"])
    run_dir = cfg.run.storage_path / cfg.run.name
    if (run_dir / SUMMARY_FILE).is_file():
        return strict_json.finite_or_none(json.loads((run_dir / SUMMARY_FILE).read_text()))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    started = time.perf_counter()
    try:
        final = fit(cfg, data_dir, run_dir, callbacks=[TuneReportCallback()])
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


def trial_name(trial: Any) -> str:
    """Tune's name and directory of a trial: the grid's stable trial name."""
    return trial.config["trial"]["name"]


def trial_run_dir(trial: Any) -> Path:
    """The run directory of a Tune trial (its config's run.storage_path / run.name)."""
    run = trial.config["trial"]["config"]["run"]
    return Path(run["storage_path"]) / run["name"]


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


def _progress_printer() -> Any:
    """A Tune callback printing each trial's rounds, completion and failure on the console
    (Tune's own status tables are turned off)."""
    from ray import tune

    from isoloco_ray.train import format_progress

    class ProgressPrinter(tune.Callback):
        def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict,
                            **info: Any) -> None:
            if "round" in result:
                rounds = trial.config["trial"]["config"]["run"]["rounds"]
                print(f"{trial_name(trial)}: {format_progress(result, rounds)}", flush=True)

        def on_trial_complete(self, iteration: int, trials: list, trial: Any,
                              **info: Any) -> None:
            result = trial.last_result or {}
            if "final_eval_loss" in result:
                loss = finite(result["final_eval_loss"])
                print(f"{trial_name(trial)}: "
                      + (f"done, final eval loss {loss:.4f}" if loss is not None else
                         "diverged, final eval loss not a finite number")
                      + f", {result.get('seconds', 0.0):.0f}s", flush=True)
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


def start_cluster(plan: GridPlan, requested: int | None) -> int:
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
    start_ray(cfg)
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
    return max(1, min(fits, len(plan.trials)))


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
    """The trials a resume runs again: those whose run directory holds none of summary.json
    (finished), error.txt (failed) and stopped.json (stopped early by the scheduler, which
    stays its verdict). Read from our own files only, never Tune's state."""
    return [trial for trial in trials
            if not any((trial.run_dir / name).is_file()
                       for name in (SUMMARY_FILE, ERROR_FILE, STOPPED_FILE))]


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
    trials as `plan` (same file, same flags)."""
    path = plan.grid_dir / GRID_FILE
    if not path.is_file():
        raise ConfigError(f"--resume: {plan.grid_dir} holds no grid to resume (no {GRID_FILE})")
    try:
        stored = json.loads(path.read_text())
        trials = stored["trials"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--resume: cannot read {path} ({exc}); start a new grid (--name)"
                          ) from None
    if trials != json.loads(strict_json.dumps(plan.manifest(None)))["trials"]:
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

    A resume runs only the unfinished trials (unfinished_trials), in a fresh Tune experiment.
    Returns 0 when every trial finished or was stopped early by the scheduler, 1 when any
    failed, diverged or did not finish, 2 when
    the grid directory does not match the request."""
    manifest_path = plan.grid_dir / GRID_FILE
    todo = plan.trials
    try:
        if resume:
            stored = read_manifest(plan)
            if max_concurrent is not None and max_concurrent != stored.get("max_concurrent"):
                print("note: --resume keeps the concurrency the grid started with "
                      f"({stored.get('max_concurrent') or 'as many as fit'})", file=sys.stderr)
            max_concurrent = stored.get("max_concurrent")
            todo = unfinished_trials(plan.trials)
        elif manifest_path.exists() or (plan.grid_dir / TUNE_DIR).exists():
            raise ConfigError(f"{plan.grid_dir} already holds a grid; continue it with --resume "
                              "or choose another --name")
        check_writable(plan.grid_dir.parent)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    if todo:
        run_trials(dataclasses.replace(plan, trials=todo), max_concurrent, resume)
    else:
        print(f"grid {plan.name}: every trial has finished, failed or been stopped early; "
              "nothing to resume", flush=True)

    report, written = write_report(plan.grid_dir)
    print_report(report, written)
    return grid_status(report.runs)


def run_trials(plan: GridPlan, max_concurrent: int | None, resume: bool) -> None:
    """Run `plan.trials` in a fresh Tune experiment of the grid directory (the first run's
    writes grid.json too)."""
    from ray import tune

    from isoloco_ray.wandb_log import export_wandb_mode, tune_wandb_callback

    concurrency = start_cluster(plan, max_concurrent)
    plan.grid_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        manifest = strict_json.dumps(plan.manifest(max_concurrent), indent=2)
        (plan.grid_dir / GRID_FILE).write_text(manifest)
    experiment = new_experiment_name(plan.grid_dir)
    count = len(plan.trials)
    print(f"grid {plan.name}: {'resuming ' if resume else ''}{count} trial"
          f"{'s' if count != 1 else ''}, up to {concurrency} at once, in {plan.grid_dir}"
          + (f" (Tune: {experiment}/)" if resume else ""), flush=True)

    trainable = tune.with_resources(run_trial, {"CPU": plan.file.resources.trial_cpus})
    scheduler = None
    if plan.file.scheduler is not None:
        scheduler = make_scheduler(plan.file.scheduler,
                                   max(t.config.run.rounds for t in plan.trials))
        print(f"early stopping: {describe_scheduler(plan.file.scheduler)}", flush=True)
    export_wandb_mode(plan.trials[0].config.run.wandb)
    callbacks = [_progress_printer()]
    wandb_callback = tune_wandb_callback(plan.trials[0].config.run.wandb, plan.name)
    if wandb_callback is not None:
        callbacks.append(wandb_callback)
    space = [{"name": t.name, "overrides": t.overrides, "data_dir": str(t.data_dir),
              "config": t.config.model_dump(mode="json")} for t in plan.trials]
    tuner = tune.Tuner(
        trainable,
        param_space={"trial": tune.grid_search(space)},
        tune_config=tune.TuneConfig(max_concurrent_trials=concurrency, scheduler=scheduler,
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
                        help="grid file: base:, grid:, trials:, metric:, resources:")
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
        print_plan(plan)
        return 0
    max_concurrent = args.max_concurrent or plan.file.resources.max_concurrent
    try:
        return run_grid(plan, max_concurrent, args.resume)
    except ConfigError as exc:  # the cluster cannot hold a trial (train.start_ray)
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
